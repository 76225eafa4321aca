"""Suite ``scheduler``: fetch vs recompute vs split, decision against decision, side by side.

A multi-turn chat whose history is moved below device memory after every turn
(``Engine.offload``), so each turn's TTFT is the cost of bringing the history back plus
prefilling the new message. Each link speed runs every decision on its own engine (same
weights, same compiled steps), interleaved turn by turn:

- ``jaxkv``: the cost-based plan (calibrated prefill curve, the link's cost);
- ``always_fetch``, ``always_recompute``; ``threshold_256`` (fetch iff >= 256 cached
  tokens, as common peers do); ``split_half`` (a fixed split, an oracle candidate);
- ``oracle``: per turn, the best mean TTFT any of the runs reached (found offline).

Link speeds: the real host tier, and links slowed by a wrapper (labelled ``emulated``)
whose bandwidth is a multiple of the recompute break-even rate (the bandwidth at which
fetching a block takes as long as recomputing it), from 100x faster to 10x slower. An
emulated link only adds delay: it cannot be faster than the real copy, so the planner is
given ``min(emulated, measured)``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from flax import nnx

from jaxkv.planning import calibration
from jaxkv import models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import EngineConfig, SchedulerConfig, TierConfig
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
from jaxkv.serving.engine import Engine
from jaxkv.planning.plan import DISK, HOST, HOT, PlanInputs, plan
from jaxkv.tools.workloads import Chat, ChatSpec

DECISIONS = {  # a run's name: its SchedulerConfig (the fetch-or-recompute decision)
    "jaxkv": SchedulerConfig(decision="cost"),
    "always_fetch": SchedulerConfig(decision="fetch"),
    "always_recompute": SchedulerConfig(decision="recompute"),
    "threshold_256": SchedulerConfig(decision="threshold", threshold_tokens=256),
}


class EmulatedLink:
  """Makes every promotion into ``cache`` finish no earlier than ``latency + bytes / rate``
  after it started (the wait overlaps whatever compute was dispatched meanwhile)."""

  def __init__(self, cache: KVCache, bytes_per_s: float, latency_s: float):
    mover = cache.worker.mover
    real = mover.finish_promote
    page_bytes = cache.config.page_bytes

    def finish(pools, pending, t_end):
      ready = pending.t_start + latency_s + len(pending.fetches) * page_bytes / bytes_per_s
      delay = ready - time.perf_counter()
      if delay > 0:
        time.sleep(delay)
      return real(pools, pending, t_end + max(delay, 0.0))

    mover.finish_promote = finish


def _setup(quick: bool):
  mesh = common.bench_mesh()
  mc = common.bench_model_config()
  cache = common.bench_cache_config(pages_per_shard=64, max_pages_per_seq=64)
  spec = ChatSpec(users=4, turns=3 if quick else 4, system_prompt_tokens=256,
                  user_tokens=(24, 48), max_new_tokens=8, vocab_size=512, seed=3)
  tiers = TierConfig(host_pages_per_shard=64)
  engine_cfg = EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=4)
  return mesh, mc, cache, spec, tiers, engine_cfg


def _engine(mesh, mc, cache, tiers, engine_cfg, scheduler, costs):
  model = models.Llama(mc, rngs=nnx.Rngs(0))
  return Engine(model, KVCache(cache, mesh, tiers), engine_cfg, scheduler=scheduler,
                costs=costs)


def run(*, quick: bool = False) -> dict:
  mesh, mc, cache, spec, tiers, engine_cfg = _setup(quick)
  probe = _engine(mesh, mc, cache, tiers, engine_cfg, DECISIONS["always_fetch"], None)
  probe.warmup(max_seq_len=spec.max_seq_len())
  measured = calibration.calibrate(probe.cache, probe.runner,
                                   max_seqs_per_shard=engine_cfg.max_seqs_per_shard)
  real_link = measured.link("host_to_device")
  # Break-even: the bandwidth at which fetching the cold histories of one wave (half the
  # longest, for every user: their fetches share the link while their recomputes share
  # the batched steps) takes as long as recomputing them.
  n = spec.max_seq_len() // 2
  t_history = measured.prefill.seconds(n, 0)
  break_even = spec.users * (n / cache.page_size) * cache.page_bytes / max(t_history, 1e-9)
  factors = [100.0, 1.0, 0.1] if quick else [100.0, 10.0, 3.0, 1.0, 0.3, 0.1]
  speeds = {"real": None, **{f"emulated_x{f:g}": f for f in factors}}

  decisions = dict(DECISIONS)
  decisions["split_half"] = None  # filled per request count below
  results = {}
  for speed_name, factor in speeds.items():
    costs = CostModel(links=dict(measured.links), prefill=measured.prefill,
                      source="calibrated" if factor is None else "emulated")
    if factor is not None:
      rate = min(break_even * factor, real_link.bytes_per_s)
      costs.links["host_to_device"] = LinkCost(real_link.latency_s, rate)
    engines = {}
    for name, sched in decisions.items():
      if name == "split_half":
        sched = SchedulerConfig(decision="split",
                                force_split=(spec.max_seq_len() // cache.page_size) // 4)
      e = _engine(mesh, mc, cache, tiers, engine_cfg, sched,
                  CostModel.from_json(costs.to_json()))
      if factor is not None:
        EmulatedLink(e.cache, costs.links["host_to_device"].bytes_per_s, real_link.latency_s)
      e.warmup(max_seq_len=spec.max_seq_len())  # compiled already: only the plan's buckets
      engines[name] = e
    chats = {name: Chat(spec) for name in engines}
    turn_ttft = {name: [] for name in engines}
    outputs = {name: [] for name in engines}
    for turn in range(spec.turns):
      for name, e in engines.items():  # interleaved: every decision, then the next turn
        before = len(e.stats()["ttft_s"])
        out = e.generate(chats[name].prompts(turn), spec.max_new_tokens)
        chats[name].record(turn, out)
        outputs[name].append(out)
        turn_ttft[name].append(statistics.mean(e.stats()["ttft_s"][before:]))
        e.offload()  # the whole history goes below device before the next turn
    exact = all(outputs[n] == outputs["always_recompute"] for n in outputs)
    later = lambda n: statistics.mean(turn_ttft[n][1:])  # turn 0 has nothing cached
    oracle_turns = [min(turn_ttft[n][t] for n in engines) for t in range(spec.turns)]
    js = engines["jaxkv"].stats()
    results[speed_name] = {
        "emulated": factor is not None,
        "link_gb_per_s": costs.links["host_to_device"].bytes_per_s / 1e9,
        "link_vs_break_even": costs.links["host_to_device"].bytes_per_s / break_even,
        "ttft_s": {n: later(n) for n in engines} | {"oracle": statistics.mean(oracle_turns[1:])},
        "ttft_s_by_turn": turn_ttft,
        "jaxkv_plans": {k: js[f"plans_{k}"] for k in ("fetch", "recompute", "split")},
        "fetch_s": js["fetch_s"], "fetch_wait_s": js["fetch_wait_s"],
        "outputs_identical": exact,
    }

  ratios = {k: v["ttft_s"]["jaxkv"] / v["ttft_s"]["oracle"] for k, v in results.items()}
  crossover = min((k for k in results if results[k]["emulated"]),
                  key=lambda k: abs(np.log(results[k]["link_vs_break_even"])))
  c = results[crossover]["ttft_s"]
  fetch_time = sum(v["fetch_s"] for v in results.values())
  wait_time = sum(v["fetch_wait_s"] for v in results.values())
  return {
      "vs_oracle": max(ratios.values()),
      "vs_oracle_by_link": ratios,
      "vs_best_fixed_at_crossover": min(c["always_fetch"], c["always_recompute"]) / c["jaxkv"],
      "crossover_link": crossover,
      "plan_overhead_ms": plan_overhead_ms(),
      "plan_overhead_ms_4_shards": plan_overhead_ms(shards=4),
      "overlap_fraction": 1.0 - wait_time / fetch_time if fetch_time > 0 else float("nan"),
      "break_even_gb_per_s": break_even / 1e9,
      "measured_costs": json_costs(measured),
      "links": results,
      "workload": {"users": spec.users, "turns": spec.turns, "history_offloaded": True},
  }


def json_costs(costs: CostModel) -> dict:
  import json
  return json.loads(costs.to_json())


def plan_overhead_ms(requests: int = 256, blocks: int = 64, shards: int = 1, reps: int = 50
                     ) -> float:
  """Median wall time of one jitted plan over 256 requests x 64 blocks, after compile."""
  import jax
  rng = np.random.default_rng(0)
  tiers = rng.choice([HOT, HOST, DISK], size=(requests, shards, blocks)).astype(np.int32)
  inputs = PlanInputs(
      tiers=tiers, block_bytes=np.full(tiers.shape, 1 << 20, np.float32),
      hot=np.zeros((requests, shards), np.int32),
      cached_end=np.full((requests, shards), blocks, np.int32),
      tail_tokens=np.full((requests,), 64, np.int32), free_pages=np.full((shards,), 512, np.int32),
      inflight_blocks=np.full((shards,), 512, np.int32), link_group=np.zeros((shards,), np.int32),
      valid=np.ones((requests,), bool), page_size=16)
  costs = CostModel(links={"host_to_device": LinkCost(1e-5, 25e9),
                           "disk_to_host": LinkCost(1e-4, 3e9)},
                    prefill=PrefillCurve(1e-3, 2e-5, 1e-9)).arrays()
  inputs = jax.device_put(inputs, jax.devices()[0])
  jax.block_until_ready(plan(inputs, costs))
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(plan(inputs, costs))
    times.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(times))
