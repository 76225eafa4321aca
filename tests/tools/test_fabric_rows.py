"""The fabric bench's pool and S3 rows (``jaxkv.tools.bench.fabric``) on a real, shaped link.

Pool: a Mooncake master on a node of its own, a process on the lender's node lending the
memory, and a writer there that put a chat's first turns in it; an engine on another node
finds them only across the lender's link. S3: an S3 server on the lender's node, the first
turns written through to a disk tier in its bucket; the engine opens the same prefix. At a
fast rate the plan fetches them (hits from the row's tier) and answers as recomputing does;
with the pool's lender killed (the master lives on), the same engine misses, answers the
same and waits for nothing. Needs root and iproute2, like tests/tools/test_fabric.py."""

import pytest

from jaxkv.tools.bench import fabric as fabric_bench

# One fast point, two conversations; the policy that always fetches (every cached block from
# the row's tier), the plan, and recomputing, whose answers both must give.
RUN = dict(quick=True, reps=2, rates=[3200.0], prefix=128,
           policies=("fetch", "recompute", "cost"))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> str:
  """One compilation cache for both rows' processes: the second compiles little."""
  return str(tmp_path_factory.mktemp("jit"))


def _fetched_from_the_row_and_exact(result: dict, tier: str) -> int:
  """Fetching took every cached block of both conversations from the row's tier; every
  policy's answers equal recomputing's. Returns the blocks of a cached prefix."""
  blocks = result["prefix_tokens"] // fabric_bench.PAGE
  (point,) = result["points"]
  assert result["tier"] == tier
  assert point["fetch_hits"] == 2 * blocks, point
  assert point["outputs_equal"] is True and result["fabric_outputs_equal"] is True, point
  return blocks


def test_the_pool_row_fetches_from_the_lent_segment_and_misses_once_the_lender_is_lost(compiled):
  """Hits from the pool at 3200 Mbit/s; then the same engine, its blocks' lender killed:
  no hit, its prefixes recomputed, answers those of recomputing, none near the deadline."""
  result = fabric_bench.run(tier="pool", adapt="lost", compile_cache_dir=compiled, **RUN)
  blocks = _fetched_from_the_row_and_exact(result, "pool")
  (before,) = result["adaptation"]  # the same engine, before the loss, fetched
  assert sum(r["blocks_fetched"] for r in before["requests"]) > 0, before
  lost = result["lender_lost"]
  assert lost["processes_killed"] >= 1, lost
  assert lost["hits"] == 0, lost  # (read and failed, or no longer listed by the master)
  assert lost["blocks_recomputed"] >= len(lost["ttft_s"]) * blocks, lost
  assert lost["outputs_equal"] is True, lost
  assert result["fabric_lost_within_deadline"] is True
  assert max(lost["wait_s"]) < lost["read_deadline_s"] / 3, lost  # a refused read: no wait


def test_the_s3_row_reads_the_first_turns_from_the_bucket_across_the_link(compiled):
  """Hits from the disk tier whose store is the bucket on the lender's node, at 3200 Mbit/s."""
  result = fabric_bench.run(tier="s3", adapt=False, compile_cache_dir=compiled, **RUN)
  _fetched_from_the_row_and_exact(result, "s3")
