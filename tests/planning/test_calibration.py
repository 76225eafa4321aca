"""Calibration prices a prefill from steps that attend over real context, and touches no page
in use.

A prefill step of padding alone attends over nothing (the attention loop runs only over the
chunks below the longest row's length), so a curve fitted to such steps prices every chunk as
if its prompt had no past: the plan then takes recompute for cheaper than it is, more so the
longer the prefix, and recomputes what it should fetch.
"""

import numpy as np

import jaxkv
from jaxkv.planning import calibration

import helpers


def _engine(mesh):
  # Attention-heavy: a narrow model whose KV is wide, so a chunk's cost is mostly its
  # attention over the context before it.
  mc = helpers.tiny_model_config(hidden_size=32, num_heads=8, num_kv_heads=4, head_dim=64,
                                 mlp_dim=64, num_layers=2)
  cc = helpers.cache_config_for(mc, page_size=16, pages_per_shard=160, max_pages_per_seq=128,
                                attention_chunk_pages=8)
  return helpers.make_engine(
      mesh, mc, cache=cc, max_seqs_per_shard=1,
      prefill_chunk_pages=8, tiers=jaxkv.TierConfig(host_pages_per_shard=32),
      scheduler=jaxkv.SchedulerConfig(decision="cost"))


def test_the_calibrated_prefill_grows_with_the_context_and_leaves_the_cache_as_it_was(mesh):
  engine = _engine(mesh)
  prompt = np.random.default_rng(0).integers(1, 128, 300).tolist()
  want = engine.generate([prompt], 4)
  before = [np.asarray(x) for x in engine.cache.worker.pools]
  costs = calibration.calibrate(engine.cache, engine.runner, max_seqs_per_shard=1)
  # A chunk after 1.5k tokens of context costs clearly more than the same chunk alone
  # (steps of padding alone priced both the same: per_token_context_s was 0).
  chunk = engine.runner.chunk_tokens
  assert costs.prefill.per_token_context_s > 0
  assert costs.prefill.seconds(chunk, 1536) > 1.5 * costs.prefill.seconds(chunk, 0)
  # The timed steps wrote nothing: every page is as it was, and the cached prompt still
  # answers as it did.
  for a, b in zip(before, engine.cache.worker.pools):
    np.testing.assert_array_equal(a, np.asarray(b))
  assert engine.generate([prompt], 4) == want
  assert engine.stats()["hits"].get("device", 0) > 0


def _changed_pages(before, after, num_shards):
  """``{(shard, page)}`` whose bytes differ in any of the pools (pages on axis ndim - 3,
  split evenly over the data shards)."""
  out = set()
  for a, b in zip(before, after):
    b = np.asarray(b)
    axis = a.ndim - 3
    per_shard = a.shape[axis] // num_shards
    differs = np.any(np.moveaxis(a != b, axis, 0).reshape(a.shape[axis], -1), axis=1)
    out |= {(int(g) // per_shard, int(g) % per_shard) for g in np.flatnonzero(differs)}
  return out


def test_a_window_models_steps_attend_with_positions_writing_one_empty_page_per_shard(mesh):
  """A model with a window group (a small random Gemma 3: local layers see 40 tokens) is
  timed with steps whose tokens have positions: a query with none sees nothing through a
  sliding window, and a curve fitted to such steps priced the local layers' attention at
  nothing. Their tokens are written into one empty device page per shard taken for the
  purpose (and the window group's page 0, which no sequence is ever given); no other page
  changes, the pages are given back, and the cached prompt still answers as it did.
  (Planted: steps with no positions write no page -> the first assertion fails.)"""
  from jaxkv.models import gemma3
  from flax import nnx
  cfg = gemma3.Gemma3Config(vocab_size=128, hidden_size=64, num_layers=6, num_heads=4,
                            num_kv_heads=2, head_dim=32, mlp_dim=128, sliding_window=40,
                            global_every=3)
  model = gemma3.Gemma3(cfg, rngs=nnx.Rngs(0))
  cc = jaxkv.CacheConfig.for_model(model, page_size=8, pages_per_shard=48,
                                   max_pages_per_seq=32, attention_chunk_pages=4)
  engine = jaxkv.Engine(model, jaxkv.KVCache(cc, mesh),
                        jaxkv.EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=2),
                        scheduler=jaxkv.SchedulerConfig(decision="fetch"))
  prompt = np.random.default_rng(0).integers(1, 128, 120).tolist()
  want = engine.generate([prompt], 4)
  worker, index, shards = engine.cache.worker, engine.cache.index, engine.cache.num_shards
  blocks_before = [np.asarray(x) for x in worker.pools]
  windows_before = [np.asarray(x) for x in worker.window_pools]
  assert windows_before  # (the model has a window group)
  calibration.calibrate(engine.cache, engine.runner, max_seqs_per_shard=1)
  written = _changed_pages(blocks_before, worker.pools, shards)
  assert sorted(s for s, _ in written) == list(range(shards)), written  # one page per shard
  assert all(index.key_of(s, p) is None for s, p in written)  # empty before, and still
  assert {p for _, p in _changed_pages(windows_before, worker.window_pools, shards)} <= {0}
  assert all(not index.held_slots(s) for s in range(shards))  # given back
  index.check_invariants()
  assert engine.generate([prompt], 4) == want
  assert engine.stats()["hits"].get("device", 0) > 0


def test_the_overlap_is_measured_from_a_step_and_reads_beside_it():
  """``overlap_beside`` times a step alone, reads of about as long alone, and both at once
  on two threads: reads that share what the step holds (a lock here; on a CPU, its cores)
  run after it and measure near 0, reads that do not measure near 1. Threads and sleeps are
  real; only what they share differs. (Planted: ``both`` running the reads after the step
  on one thread -> the free reads measure 0 and the second assertion fails.)"""
  import threading
  import time
  from jaxkv.planning.costs import LinkCost
  shared = threading.Lock()

  def hold(lock):
    def go():
      with lock:
        time.sleep(0.06)
    return go

  def reader(lock):  # a 20 ms "block" (the link's cost says so): 3 blocks match the step
    return calibration.Reader(lambda k: hold(lock) if k else (lambda: None), 3, 20_000)

  link = LinkCost(latency_s=0.0, bytes_per_s=1e6)
  serial = calibration.overlap_beside(hold(shared), reader(shared), link, reps=3)
  free = calibration.overlap_beside(hold(shared), reader(threading.Lock()), link, reps=3)
  assert serial is not None and serial < 0.35, serial
  assert free is not None and free > 0.65, free


def test_calibration_measures_the_overlap_it_plans_with_beside_the_disk_tier(mesh, tmp_path):
  """An engine with a disk tier starts from the overlap calibration measured beside the
  disk's reads (logged with its three times), not from 1 assumed, and the measured value
  is the CostModel's; the scratch records are gone after. (Planted: calibrate returning
  overlap 1 -> the logged value differs unless it measured 1.00.)"""
  from absl import logging as absl_logging
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, page_size=8, pages_per_shard=32, max_pages_per_seq=16)
  engine = helpers.make_engine(
      mesh, mc, cache=cc, max_seqs_per_shard=1,
      tiers=jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"), disk_pages=64),
      scheduler=jaxkv.SchedulerConfig(decision="cost"))
  disk = tmp_path / "disk"
  before = sorted(disk.rglob("*"))
  seen = []
  handler = type("H", (absl_logging.logging.Handler,), {
      "emit": lambda self, record: seen.append(record.getMessage())})()
  logger, level = absl_logging.get_absl_logger(), absl_logging.get_verbosity()
  logger.addHandler(handler)
  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    costs = calibration.calibrate(engine.cache, engine.runner, max_seqs_per_shard=1)
  finally:
    absl_logging.set_verbosity(level)
    logger.removeHandler(handler)
  said = [m for m in seen if m.startswith("calibrated overlap of a prefill and a disk_to_host")]
  assert len(said) == 1, seen
  assert float(said[0].rsplit(" ", 1)[1]) == round(costs.overlap, 2)
  assert any(m.startswith("calibration: prefill step") for m in seen)
  assert 0.0 <= costs.overlap <= 1.0
  assert sorted(disk.rglob("*")) == before  # the scratch records are gone
