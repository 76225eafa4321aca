"""Executing plans: every split point gives the tokens of recompute-from-scratch."""


import numpy as np
import pytest

import jaxkv
from jaxkv.manager.index import Tier

import helpers


def engines(mesh, tmp_path, decision, **sched_kw):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=16, max_pages_per_seq=16)
  tiers = jaxkv.TierConfig(host_pages_per_shard=4, disk_kvstore=str(tmp_path / "disk"),
                           disk_pages=64, write_policy="write_through")
  engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=2,
                               scheduler=jaxkv.SchedulerConfig(decision=decision, **sched_kw))
  fresh = helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=False, max_seqs_per_shard=2)
  return engine, fresh


PROMPTS = [list(range(1, 35)), list(range(40, 60)) + list(range(3, 16))]  # 8 and 8 full blocks


@pytest.mark.parametrize("k", range(0, 9))
def test_forced_split_at_every_point_is_exact(mesh, tmp_path, k):
  engine, fresh = engines(mesh, tmp_path, "split", force_split=k)
  want = fresh.generate(PROMPTS, 4)
  assert engine.generate(PROMPTS, 4) == want  # nothing cached yet
  engine.flush(30)
  engine.offload()  # every block now lives on host (a few) and disk (all)
  got, logits = engine.generate(PROMPTS, 4, return_logits=True)
  _, want_logits = fresh.generate(PROMPTS, 4, return_logits=True)
  assert got == want
  for a, b in zip(logits, want_logits):
    np.testing.assert_array_equal(a, b)  # prefill_chunk_pages=4 is not 1, but no decode reuse
  s = engine.stats()
  usable = [(len(p) - 1) // 4 for p in PROMPTS]  # 8 blocks each can be reused
  recomputed = sum(min(k, u) for u in usable)
  assert s["blocks_fetched"] == sum(u - min(k, u) for u in usable)
  assert s["plans_split"] == (2 if 0 < k < 8 else 0)
  assert s["plans_fetch"] == (2 if k == 0 else 0)
  assert s["plans_recompute"] == (2 if k >= 8 else 0)
  assert s["blocks_split"] == (recomputed if 0 < k < 8 else 0)
  engine.cache.index.check_invariants()
  engine.flush(30)
  for sh in range(4):
    assert not engine.cache.index.held_slots(sh, Tier.HOST)
  assert not engine.cache.index.held_slots(0, Tier.DISK)


def test_failed_fetch_after_the_split_point_recomputes_from_there(mesh, tmp_path):
  engine, fresh = engines(mesh, tmp_path, "split", force_split=3)
  want = fresh.generate(PROMPTS[:1], 4)
  engine.generate(PROMPTS[:1], 4)
  engine.flush(30)
  engine.offload()
  for s in range(4):  # keep the host out of it: every block must come from disk
    engine.cache.index.evict_all_unreferenced(s, Tier.HOST)
  keys = engine.cache.index.block_keys(PROMPTS[0], "default")
  assert engine.cache.index.slot_of(0, keys[5], Tier.DISK) is not None
  data = bytearray(open(engine.cache.worker.disk.path_of(keys[5]), "rb").read())
  data[-1] ^= 1
  open(engine.cache.worker.disk.path_of(keys[5]), "wb").write(bytes(data))
  assert engine.generate(PROMPTS[:1], 4) == want
  s = engine.stats()
  assert s["blocks_split"] == 3 and s["verify_failures"] == 1
  assert s["hits"]["disk"] == 2  # blocks 3 and 4; block 5 failed, 6 and 7 recomputed


def test_cost_decision_calibrates_and_stays_exact(mesh, tmp_path):
  engine, fresh = engines(mesh, tmp_path, "cost")
  want = fresh.generate(PROMPTS, 4)
  assert engine.generate(PROMPTS, 4) == want
  engine.flush(30)
  engine.offload()
  assert engine.generate(PROMPTS, 4) == want
  s = engine.stats()
  assert engine.costs is not None and engine.costs.source == "calibrated"
  assert s["calibration_s"] > 0
  assert s["plans_fetch"] + s["plans_split"] + s["plans_recompute"] + s["plans_probe"] == 2
  links = engine.costs.links
  assert links["host_to_device"].bytes_per_s > 0 and links["disk_to_host"].bytes_per_s > 0
  assert engine.costs.prefill.seconds(64, 0) > 0
  # The saved model is what a later engine loads instead of calibrating again.
  path = str(tmp_path / "costs.json")
  engine.costs.save(path)
  again = helpers.make_engine(
      mesh, helpers.tiny_model_config(),
      scheduler=jaxkv.SchedulerConfig(decision="cost", cost_model_path=path))
  assert again.costs.links == engine.costs.links
