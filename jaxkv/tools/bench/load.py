"""Suite ``load``: requests arriving over time (Poisson), continuous batching vs waves vs no cache.

Requests share a system prompt and one of a few documents, then ask their own question;
answers are 4-48 tokens. Each run (a batching, or no cache) has its own engine (same
weights, same compiled steps, same arrival times):
- ``continuous``: ``EngineConfig(batching="continuous")``: each arrival is submitted on
  time and joins the running batch at the next step;
- ``waves``: ``batching="static"``: whatever arrived while the previous wave ran is
  generated as the next call (requests run in waves to their longest answer);
- ``no_cache``: continuous batching with prefix reuse off.
Rates are set from the measured saturation throughput (every request arriving at once,
continuous): 0.5x (under), 0.9x (near) and 1.5x (over). TTFT counts from arrival.
"""

from __future__ import annotations

import time

import numpy as np
from flax import nnx

from jaxkv import models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import EngineConfig, SamplingParams, SchedulerConfig
from jaxkv.serving.engine import Engine
from jaxkv.metrics import percentile


def _requests(n: int, seed: int):
  rng = np.random.default_rng(seed)
  system = rng.integers(1, 512, 96).tolist()
  docs = [rng.integers(1, 512, 128).tolist() for _ in range(4)]
  out = []
  for _ in range(n):
    prompt = system + docs[int(rng.integers(0, 4))] + rng.integers(1, 512, int(
        rng.integers(8, 32))).tolist()
    out.append((prompt, SamplingParams(max_new_tokens=int(rng.integers(4, 49)))))
  return out


def _run_continuous(engine: Engine, requests, arrivals) -> dict:
  handles, t0, i = [], time.perf_counter(), 0
  while i < len(requests) or engine.has_unfinished():
    now = time.perf_counter() - t0
    while i < len(requests) and arrivals[i] <= now:
      handles.append(engine.submit(*requests[i]))
      i += 1
    if engine.has_unfinished():
      engine.step()
    elif i < len(requests):
      time.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
  makespan = time.perf_counter() - t0
  return {"ttft_s": [h.ttft_s for h in handles], "tokens": [h.tokens for h in handles],
          "makespan_s": makespan}


def _run_waves(engine: Engine, requests, arrivals) -> dict:
  ttft, tokens, t0, i = [0.0] * len(requests), [None] * len(requests), time.perf_counter(), 0
  while i < len(requests):
    now = time.perf_counter() - t0
    if arrivals[i] > now:
      time.sleep(arrivals[i] - now)
      continue
    j = i
    while j < len(requests) and arrivals[j] <= now:
      j += 1
    before = len(engine.stats()["ttft_s"])
    start = time.perf_counter() - t0
    out = engine.generate([r[0] for r in requests[i:j]], [r[1] for r in requests[i:j]])
    for k, (toks, t) in enumerate(zip(out, engine.stats()["ttft_s"][before:])):
      tokens[i + k], ttft[i + k] = toks, start - arrivals[i + k] + t
    i = j
  return {"ttft_s": ttft, "tokens": tokens, "makespan_s": time.perf_counter() - t0}


def _summary(r: dict) -> dict:
  generated = sum(len(t) for t in r["tokens"])
  return {"tokens_per_s": generated / r["makespan_s"],
          "ttft_p50_s": percentile(r["ttft_s"], 0.5), "ttft_p90_s": percentile(r["ttft_s"], 0.9),
          "ttft_p99_s": percentile(r["ttft_s"], 0.99), "makespan_s": r["makespan_s"]}


def run(*, quick: bool = False, reference_rps: float | None = None) -> dict:
  """``reference_rps``: the rate the three arrival rates are fractions of (default: the
  saturation measured here), to compare two builds at the same arrival rates."""
  mesh = common.bench_mesh()
  mc = common.bench_model_config()
  n = 24 if quick else 64
  requests = _requests(n, seed=5)
  max_len = max(len(p) + sp.max_new_tokens for p, sp in requests)
  pages = -(-max_len // 16)
  cache = common.bench_cache_config(pages_per_shard=8 * pages, max_pages_per_seq=pages)

  def make(batching: str, reuse: bool) -> Engine:
    return Engine(models.Llama(mc, rngs=nnx.Rngs(0)), KVCache(cache, mesh),
                  EngineConfig(max_seqs_per_shard=4, prefill_chunk_pages=4, batching=batching,
                               prefix_reuse=reuse), scheduler=SchedulerConfig(decision="fetch"))

  engines = {"continuous": make("continuous", True), "waves": make("static", True),
             "no_cache": make("continuous", False)}
  t0 = time.perf_counter()
  for e in engines.values():
    e.warmup(max_seq_len=max_len)
  warmup_s = time.perf_counter() - t0
  runners = {"continuous": _run_continuous, "waves": _run_waves, "no_cache": _run_continuous}
  for name, e in engines.items():  # one untimed pass each: every prefix cache is warm
    runners[name](e, requests, [0.0] * n)
  sat = _run_continuous(engines["continuous"], requests, [0.0] * n)  # all at once
  sat_rps = n / sat["makespan_s"]
  ref_rps = reference_rps or sat_rps
  rng = np.random.default_rng(7)
  gaps = rng.exponential(1.0, n)
  table, outputs = {}, {}
  for label, factor in (("under", 0.5), ("near", 0.9), ("over", 1.5)):
    arrivals = np.cumsum(gaps) / (factor * ref_rps)
    row = {"requests_per_s": factor * ref_rps}
    for name, e in engines.items():  # each engine's cache is warm from the previous rates
      result = runners[name](e, requests, arrivals)
      row[name] = _summary(result)
      outputs.setdefault(name, []).append(result["tokens"])
    table[label] = row
  near = table["near"]
  return {
      "tokens_per_s_vs_waves": near["continuous"]["tokens_per_s"] / near["waves"]["tokens_per_s"],
      "ttft_p90_vs_waves": near["continuous"]["ttft_p90_s"] / near["waves"]["ttft_p90_s"],
      "ttft_p90_vs_no_cache": near["continuous"]["ttft_p90_s"] / near["no_cache"]["ttft_p90_s"],
      "saturation_requests_per_s": sat_rps, "reference_requests_per_s": ref_rps,
      "rates": table, "requests": n,
      "outputs_identical": all(outputs[k] == outputs["continuous"] for k in outputs),
      "warmup_s": warmup_s,
  }
