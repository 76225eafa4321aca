"""Calibration prices a prefill from steps that attend over real context, and touches no page.

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
