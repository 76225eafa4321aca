"""Restoring into a cache that is already full: what the restore's placements evict is kept
(carried out, one batch per shard), and a shard that cannot take every row takes as many
as it has room for, one at a time."""

import jaxkv
from jaxkv.worker.checkpoint import Checkpointer

import helpers

MC = dict(num_heads=8, num_kv_heads=4)
SAVED = [[1 + (i * 37 + j * 5) % 120 for j in range(45)] for i in range(4)]
OTHER = [[1 + (i * 53 + j * 7 + 3) % 121 for j in range(45)] for i in range(4)]


def engine_on(mesh, *, host=0, reuse=True):
  mc = helpers.tiny_model_config(**MC)
  cc = helpers.cache_config_for(mc, pages_per_shard=16, max_pages_per_seq=16)
  return helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=reuse, max_seqs_per_shard=2,
                             tiers=jaxkv.TierConfig(host_pages_per_shard=host) if host else None)


def test_a_restore_into_a_full_cache_keeps_what_it_evicts(mesh, tmp_path):
  a = engine_on(mesh)
  a.generate(SAVED, 2)
  per_shard = [a.cache.index.num_cached(s) for s in range(a.cache.num_shards)]
  saved = sum(per_shard)
  Checkpointer(a.cache, str(tmp_path / "ckpt")).save()

  b = engine_on(mesh, host=32)
  want = b.generate(OTHER, 2)
  held = b.occupancy()["cached_blocks"]
  assert held["host"] == 0 and held["device"] > 0
  evictions = b.cache.index.counters.evictions
  counts = Checkpointer(b.cache, str(tmp_path / "ckpt")).restore()
  assert counts["placed"] == saved and counts["skipped_no_room"] == 0, counts
  evicted = b.cache.index.counters.evictions - evictions
  assert evicted > 0  # the restore took pages that held b's own blocks ...
  assert b.occupancy()["cached_blocks"]["host"] == evicted  # ... and kept every one of them
  b.cache.index.check_invariants()
  follow = [p + w + [7, 8, 9] for p, w in zip(OTHER, want)]
  assert b.generate(follow, 2) == engine_on(mesh, reuse=False).generate(follow, 2)
  assert b.stats()["hits"]["host"] > 0

  # A host tier too small for a shard's rows: the batch cannot be had, so rows are placed
  # one at a time while there is room, and the rest are counted.
  c = engine_on(mesh, host=8)
  counts = Checkpointer(c.cache, str(tmp_path / "ckpt")).restore(into="host")
  assert max(per_shard) > 8, per_shard  # some shard's rows do not all fit
  assert counts["placed"] == sum(min(n, 8) for n in per_shard), (counts, per_shard)
  assert counts["skipped_no_room"] == saved - counts["placed"]
  assert c.occupancy()["cached_blocks"]["host"] == counts["placed"]
  c.cache.index.check_invariants()
