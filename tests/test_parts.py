"""The engine's parts, one at a time: buckets, failure reasons, plan inputs, admission and
the configs. (The rules the layout keeps: tests/test_layout.py.)"""

import collections
import dataclasses
import os
import pathlib
import types

import numpy as np
import pytest

import helpers
import jaxkv
from jaxkv import buckets
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
from jaxkv.manager.index import Tier
from jaxkv.planning.plan import build_inputs, plan
from jaxkv.planning.planner import Planner
from jaxkv.stats import Stats
from jaxkv.worker.tiers import blocks
from jaxkv.worker.tiers.base import Failure

ROOT = pathlib.Path(__file__).resolve().parent.parent


# ---- buckets -------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,pow2,transfer,plan", [
    (0, 1, 4, 8), (1, 1, 4, 8), (3, 4, 4, 8), (5, 8, 8, 8), (9, 16, 16, 16), (64, 64, 64, 64)])
def test_bucket_sizes(n, pow2, transfer, plan):
  assert buckets.pow2_at_least(n) == pow2
  assert buckets.transfer_pages(n) == transfer
  assert buckets.plan_rows(n) == plan


def test_table_widths_are_powers_of_two_within_the_config():
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, page_size=4, max_pages_per_seq=32, attention_chunk_pages=4)
  assert buckets.table_widths(128, cc) == [4, 8, 16, 32]
  assert buckets.table_widths(9, cc) == [4]  # 3 pages: never narrower than one chunk
  assert buckets.table_width(33, cc) == 32  # capped at max_pages_per_seq
  assert buckets.row_buckets(5) == [1, 2, 4, 8]


def test_shard_grid_groups_by_shard_in_order_and_pads():
  items = [(2, "a"), (0, "b"), (2, "c"), (2, "d"), (2, "e"), (2, "f")]
  grid, per = buckets.shard_ids(items, 3, -1, lambda it: ord(it[1]))
  assert grid.shape == (3, 8) and grid.dtype == np.int32  # 5 on shard 2 -> bucket 8
  assert per == [[(0, "b")], [], [(2, "a"), (2, "c"), (2, "d"), (2, "e"), (2, "f")]]
  assert grid[0, :2].tolist() == [ord("b"), -1] and (grid[1] == -1).all()
  assert grid[2, :6].tolist() == [ord(c) for c in "acdef"] + [-1]


# ---- failure reasons -----------------------------------------------------------------------------
def test_failures_separate_corrupt_copies_from_unavailable_ones():
  corrupt = {f for f in Failure if f.corrupt}
  assert {Failure.CHECKSUM, Failure.KEY, Failure.MAGIC, Failure.SHAPE, Failure.READ_ERROR,
          Failure.TOKEN} <= corrupt
  assert not corrupt & {Failure.DEADLINE, Failure.BREAKER, Failure.IO, Failure.REFUSED,
                        Failure.CLOSED, Failure.PULL, Failure.READ_RETRY}
  assert Failure.of(blocks.BlockError("key", "x"), Failure.READ_ERROR) is Failure.KEY
  assert Failure.of(OSError("disk"), Failure.READ_ERROR) is Failure.READ_ERROR
  assert Failure.CHECKSUM == "checksum"  # stats report the plain name


def test_a_record_of_every_kind_of_damage_names_a_known_failure():
  payload = np.arange(2 * 2 * 4 * 8, dtype=np.float32).reshape(2, 2, 4, 8)
  key, fp = b"k" * 32, b"f" * 32
  good = blocks.encode(payload, key, fp, None)
  ok = dict(key=key, fingerprint=fp, dtype="float32", shape=(2, 2, 4, 8))
  damaged = {"checksum": lambda r: r.__setitem__(-1, r[-1] ^ 1),
             "magic": lambda r: r.__setitem__(slice(0, 8), 0)}
  for want, damage in damaged.items():
    rec = good.copy()
    damage(rec)
    with pytest.raises(blocks.BlockError) as e:
      blocks.decode(rec, **ok)
    assert isinstance(e.value.reason, Failure) and e.value.reason == want
    assert e.value.reason.corrupt


# ---- plan inputs ---------------------------------------------------------------------------------
def test_plan_inputs_for_a_step_and_for_placement():
  D, H, K, S, A = Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.SHARD, Tier.ABSENT
  step = build_inputs([([[D, D, H, K]], 70), ([[H]], 20)], num_shards=1, page_size=16,
                      page_bytes=1000, chunk_tokens=32, inflight_blocks=3)
  assert step.tiers.shape == (8, 1, 8)  # padded to the plan's buckets
  assert step.tiers[0, 0, :5].tolist() == [D, D, H, K, A] and step.tiers[1, 0, 0] == H
  assert step.hot[:2, 0].tolist() == [2, 0] and step.cached_end[:2, 0].tolist() == [4, 1]
  assert step.tail_tokens[:2].tolist() == [70 - 64, 20 - 16]
  assert step.valid.tolist() == [True, True] + [False] * 6
  assert (step.inflight_blocks == 3).all() and (step.free_pages == 8).all()
  assert (step.block_bytes == 1000).all() and step.chunk_tokens == 32
  # Placement: one request on every shard; the chain ends where the longest list ends, so
  # blocks a shard lacks are ABSENT there (they can only be recomputed on that shard).
  place = build_inputs([([[D, D], [S, S, S], []], 60)], num_shards=3, page_size=16,
                       page_bytes=1000)
  assert place.cached_end[0].tolist() == [3, 3, 3] and place.hot[0].tolist() == [2, 0, 0]
  assert place.tiers[0, 0, 2] == A and place.tiers[0, 2, 0] == A
  out = plan(place, CostModel(
      links={"host_to_device": LinkCost(0.0, 1e9), "cross_shard": LinkCost(0.0, 1e12)},
      prefill=PrefillCurve(1e-3, 1e-4, 0.0)).arrays())
  t = np.asarray(out.t_pred_s)[0]
  assert t[1] < t[2]  # copying three blocks across beats recomputing them
  assert int(np.asarray(out.best_shard)[0]) == 1


def test_planner_decisions_choose_split_points():
  D, H = Tier.DEVICE, Tier.HOST
  reqs = [([D, H, H, H, H], 100, 0), ([D, D], 40, 1), ([H] * 20, 400, 0)]

  def splits(**kw):
    stats = Stats()
    planner = Planner(jaxkv.SchedulerConfig(**kw), None, num_shards=1, page_size=16,
                      page_bytes=1000, chunk_tokens=16, stats=stats)
    return planner.splits(reqs), stats

  assert splits(decision="fetch")[0] == [1, 2, 0]
  assert splits(decision="recompute")[0] == [5, 2, 20]
  assert splits(decision="threshold", threshold_tokens=256)[0] == [5, 2, 0]
  got, stats = splits(decision="split", force_split=2)
  assert got == [3, 2, 2]
  assert stats["plans_split"] == 2 and stats["plans_fetch"] == 0  # [D, D] has nothing cold


def test_planner_plans_from_the_costs_the_engine_sets_and_learns_from_fetch_reports():
  D, H, K = Tier.DEVICE, Tier.HOST, Tier.DISK
  planner = Planner(jaxkv.SchedulerConfig(decision="cost"), None, num_shards=1, page_size=16,
                    page_bytes=1000, chunk_tokens=16, stats=Stats())
  assert planner.splits([([D, D], 40, 0)]) == [2]  # nothing cold: no costs needed
  with pytest.raises(RuntimeError, match="must set planner.costs"):  # the engine's bug
    planner.splits([([D, H, H], 60, 0)])
  planner.set_costs(CostModel(links={"host_to_device": LinkCost(0.0, 1e12)},
                              prefill=PrefillCurve(0.0, 1e-3, 0.0)))
  assert planner.ensure_costs() is planner.costs
  assert planner.splits([([D, H, H], 60, 0)]) == [1]  # a fast link: fetch both
  # A report is a value with plain attributes; the deepest tier read names the link.
  report = types.SimpleNamespace(blocks=4, bytes=4000, seconds=1e-6, tiers=(int(H), int(K)),
                                 latency_s=0.0)
  planner.observe_fetch(report)
  assert planner.costs.links["disk_to_host"].bytes_per_s == pytest.approx(4e9)
  planner.observe_fetch(types.SimpleNamespace(blocks=0, bytes=0, seconds=0.0, tiers=(),
                                              latency_s=0.0))
  assert set(planner.costs.links) == {"host_to_device", "disk_to_host"}  # nothing moved
  # A peer's round trip, measured by its lookups, is the link's latency: the bytes took
  # the rest of the time.
  planner.observe_fetch(types.SimpleNamespace(blocks=4, bytes=4000, seconds=2e-3,
                                              tiers=(int(Tier.REMOTE),), latency_s=1e-3))
  link = planner.costs.links["remote_to_host"]
  assert link.latency_s == 1e-3 and link.bytes_per_s == pytest.approx(4e6)


# ---- admission -----------------------------------------------------------------------------------
@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_admission_looks_each_request_up_once_per_shard_not_every_wave(mesh, batching):
  engine = helpers.make_engine(mesh, max_seqs_per_shard=1, batching=batching)
  index = engine.cache.index
  calls = collections.Counter()
  real_locate = index.locate

  def counting_locate(shard, keys, *tiers):
    calls[shard] += 1
    return real_locate(shard, keys, *tiers)

  index.locate = counting_locate  # a spy around the real index
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 100, 10).tolist() for _ in range(24)]  # 2 full blocks usable
  fresh = helpers.make_engine(mesh, max_seqs_per_shard=1, prefix_reuse=False)
  assert engine.generate(prompts, 2) == fresh.generate(prompts, 2)
  if batching == "static":
    assert engine.stats()["waves"] == 6  # 24 requests, 4 shards x 1 row
  assert dict(calls) == {s: 24 for s in range(4)}  # not 24 + 20 + 16 + ... per shard


def test_placements_and_requests_are_frozen(mesh):
  engine = helpers.make_engine(mesh)
  requests = engine.admission.validate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], 3, "t")
  wave = engine.admission.admit(collections.deque(requests))
  with pytest.raises(dataclasses.FrozenInstanceError):
    wave[0].shard = 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    requests[0].max_new_tokens = 1
  assert len(wave[0].pages) == requests[0].num_pages_needed == 3
  engine.cache.index.release(wave[0].shard, wave[0].pages)
  engine.cache.index.check_invariants()


def test_every_config_overrides_the_default():
  import runpy
  base = runpy.run_path(os.fspath(ROOT / "configs" / "default.py"))["get_config"]()
  for name in ("cpu_tiny", "llama3_8b_h200", "llama3_70b_8gpu", "tpu_v5e_8"):
    cfg = runpy.run_path(os.fspath(ROOT / "configs" / f"{name}.py"))["get_config"]()
    assert set(base.keys()) <= set(cfg.keys()), name
    assert cfg.workload.rag.to_dict() == base.workload.rag.to_dict()  # shared, not copied
