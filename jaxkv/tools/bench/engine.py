"""Suite ``engine``: end to end, side by side, under a device budget of a quarter of the
working set.

- ``no_cache``: every prompt recomputed;
- ``device_lru``: prefix reuse in device memory only, LRU eviction, nothing below it
  (what automatic prefix caching does without offload);
- ``jaxkv``: the same device budget with a host tier below it and the cost-based plan.
Same model, weights, compiled steps and prompts; interleaved turn by turn.
"""

from __future__ import annotations

import statistics
import time

from flax import nnx

from jaxkv import models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import EngineConfig, SchedulerConfig, TierConfig
from jaxkv.serving.engine import Engine
from jaxkv.tools.workloads import Chat, ChatSpec


def run(*, quick: bool = False) -> dict:
  mesh = common.bench_mesh()
  mc = common.bench_model_config()
  data = mesh.shape["data"]
  spec = ChatSpec(users=2 * data if quick else 4 * data, turns=3 if quick else 4,
                  system_prompt_tokens=256, user_tokens=(32, 64), max_new_tokens=16,
                  vocab_size=512, seed=11)
  page = 16
  seq_pages = -(-spec.max_seq_len() // page)
  working_set = (spec.users // data) * seq_pages  # pages per shard at the end
  budget = max(seq_pages + 2, working_set // 4)
  cache = common.bench_cache_config(page_size=page, pages_per_shard=budget, max_pages_per_seq=seq_pages)
  engine_cfg = EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=4)

  def make(reuse: bool, tiers: TierConfig | None, decision: str) -> Engine:
    return Engine(models.Llama(mc, rngs=nnx.Rngs(0)), KVCache(cache, mesh, tiers),
                  EngineConfig(**{**engine_cfg.__dict__, "prefix_reuse": reuse}),
                  scheduler=SchedulerConfig(decision=decision))

  engines = {
      "no_cache": make(False, None, "fetch"),
      "device_lru": make(True, None, "fetch"),
      "jaxkv": make(True, TierConfig(host_pages_per_shard=working_set + seq_pages), "cost"),
  }
  t0 = time.perf_counter()
  for e in engines.values():
    e.warmup(max_seq_len=spec.max_seq_len(), rows_per_shard=[1])
  warmup_s = time.perf_counter() - t0
  chats = {n: Chat(spec) for n in engines}
  ttft = {n: [] for n in engines}
  wall = {n: 0.0 for n in engines}
  outputs = {n: [] for n in engines}
  for turn in range(spec.turns):
    for name, e in engines.items():
      before = len(e.stats()["ttft_s"])
      t = time.perf_counter()
      out = e.generate(chats[name].prompts(turn), spec.max_new_tokens)
      wall[name] += time.perf_counter() - t
      chats[name].record(turn, out)
      outputs[name].append(out)
      ttft[name].append(e.stats()["ttft_s"][before:])
  later = {n: statistics.mean(x for turn in ttft[n][1:] for x in turn) for n in engines}
  stats = {n: e.stats() for n, e in engines.items()}
  return {
      "ttft_speedup_vs_no_cache": later["no_cache"] / later["jaxkv"],
      "ttft_speedup_vs_device_lru": later["device_lru"] / later["jaxkv"],
      "mean_ttft_s": later,
      "tokens_per_s": {n: stats[n]["generated_tokens"] / wall[n] for n in engines},
      "hits": {n: stats[n]["hits"] for n in engines},
      "computed_tokens": {n: stats[n]["computed_tokens"] for n in engines},
      "plans": {k: stats["jaxkv"][f"plans_{k}"] for k in ("fetch", "recompute", "split")},
      "outputs_identical": all(outputs[n] == outputs["no_cache"] for n in engines),
      "device_pages_per_shard": budget, "working_set_pages_per_shard": working_set,
      "workload": {"users": spec.users, "turns": spec.turns, "max_seq_tokens": spec.max_seq_len()},
      "warmup_s": warmup_s, "costs": engines["jaxkv"].costs.to_json() if engines["jaxkv"].costs
      else None,
  }
