"""Warm restart: Orbax checkpoints of the cache, onto other meshes, through crashes."""

import os
import signal
import subprocess
import sys

import jax
import pytest

import jaxkv
from jaxkv.worker.checkpoint import Checkpointer

import helpers

ROOT = helpers.ROOT
MC = dict(num_heads=8, num_kv_heads=4)  # kv heads split 4 ways or 2 ways
PROMPTS = [list(range(1, 30)), list(range(50, 70)) + list(range(5, 15)), list(range(90, 121))]


def engine_on(mesh, *, tiers=None, reuse=True, **cache_kw):
  mc = helpers.tiny_model_config(**MC)
  cc = helpers.cache_config_for(mc, **{"pages_per_shard": 32, "max_pages_per_seq": 16,
                                       **cache_kw})
  return helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, prefix_reuse=reuse,
                             max_seqs_per_shard=2)


@pytest.mark.parametrize("src,dst", [((2, 4), (4, 2)), ((4, 2), (2, 4)), ((4, 2), (2, 2))])
def test_restore_onto_another_mesh_gives_hits_and_exact_tokens(tmp_path, src, dst):
  devices = jax.devices()
  mesh_a = jaxkv.make_mesh(data=src[0], model=src[1])
  mesh_b = jaxkv.make_mesh(data=dst[0], model=dst[1], devices=devices[:dst[0] * dst[1]])
  a = engine_on(mesh_a)
  want = a.generate(PROMPTS, 4)
  step = Checkpointer(a.cache, str(tmp_path / "ckpt")).save()
  b = engine_on(mesh_b)
  counts = Checkpointer(b.cache, str(tmp_path / "ckpt")).restore()
  assert counts["step"] == step and counts["placed"] > 0 and counts["failed_checksum"] == 0
  fresh = engine_on(mesh_b, reuse=False)
  follow = [p + w + [7, 8, 9] for p, w in zip(PROMPTS, want)]
  assert b.generate(follow, 4) == fresh.generate(follow, 4)
  hits = b.stats()["hits"]["device"]
  assert hits >= sum((len(p) - 1) // 4 for p in PROMPTS)  # the prompts' blocks came back
  b.cache.index.check_invariants()


def test_restore_straight_into_host_memory(mesh, tmp_path):
  a = engine_on(mesh)
  want = a.generate(PROMPTS, 4)
  Checkpointer(a.cache, str(tmp_path / "ckpt")).save()
  b = engine_on(mesh, tiers=jaxkv.TierConfig(host_pages_per_shard=32))
  counts = Checkpointer(b.cache, str(tmp_path / "ckpt")).restore(into="host")
  assert counts["placed"] > 0
  assert all(b.cache.index.num_cached(s) == 0 for s in range(4))  # nothing on device yet
  assert b.generate(PROMPTS, 4) == want
  assert b.stats()["hits"]["host"] > 0 and b.stats()["hits"]["device"] == 0


@pytest.mark.parametrize("tiers,into", [
    ("host", "device"), ("host", "host"), ("host+disk", "device"), ("disk", "device")])
def test_checkpoint_of_a_cache_with_lower_tiers_restores_exactly(mesh, tmp_path, tiers, into):
  """Blocks in host memory are saved too (their checksums are those recorded when they were
  stored: no device computation reads host memory); disk blocks stay in the store."""
  def make(reuse=True):
    return engine_on(mesh, reuse=reuse, pages_per_shard=16, tiers=jaxkv.TierConfig(
        host_pages_per_shard=32 if "host" in tiers else 0,
        disk_kvstore=str(tmp_path / "disk") if "disk" in tiers else None,
        disk_pages=64 if "disk" in tiers else 0, write_policy="write_through"))
  a = make()
  want = a.generate(PROMPTS, 4)
  a.offload()  # every cached block leaves the device: the host (or disk) tier holds them
  a.flush(30)
  held = a.occupancy()["cached_blocks"]
  assert held["device"] == 0 and max(held["host"], held["disk"]) > 0
  step = Checkpointer(a.cache, str(tmp_path / "ckpt")).save(wait=True)
  b = make()
  counts = Checkpointer(b.cache, str(tmp_path / "ckpt")).restore(into=into)
  assert counts["step"] == step and counts["failed_checksum"] == 0
  # Host blocks come back from the checkpoint's arrays; disk blocks stay in the store
  # (nothing of them is in the arrays, so nothing is placed).
  assert (counts["placed"] > 0) == ("host" in tiers), counts
  follow = [p + w + [7, 8, 9] for p, w in zip(PROMPTS, want)]
  assert b.generate(follow, 4) == make(reuse=False).generate(follow, 4)
  hits = b.stats()["hits"]
  assert hits["device"] + hits["host"] + hits["disk"] >= sum((len(p) - 1) // 4 for p in PROMPTS)
  b.cache.index.check_invariants()


def test_mismatched_model_or_layout_is_refused_naming_the_difference(mesh, tmp_path):
  a = engine_on(mesh)
  a.generate(PROMPTS[:1], 2)
  Checkpointer(a.cache, str(tmp_path / "ckpt")).save()
  other = engine_on(mesh, page_size=8)
  with pytest.raises(ValueError, match="page_size: checkpoint 4 vs this cache 8"):
    Checkpointer(other.cache, str(tmp_path / "ckpt")).restore()
  renamed = engine_on(mesh, model_name="another-model")
  with pytest.raises(ValueError, match="model_name: checkpoint 'test-llama'"):
    Checkpointer(renamed.cache, str(tmp_path / "ckpt")).restore()
  with pytest.raises(FileNotFoundError, match="no finished checkpoint"):
    Checkpointer(a.cache, str(tmp_path / "empty")).restore()


SAVER = r"""
import asyncio, os, sys
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path[:0] = ["tests", "tests/worker"]
import numpy as np
from orbax.checkpoint._src.path import atomicity
import jaxkv, helpers
from jaxkv.worker.checkpoint import Checkpointer
from test_checkpoint import engine_on, PROMPTS
mesh = jaxkv.make_mesh(data=4, model=2)
e = engine_on(mesh, pages_per_shard=512, max_pages_per_seq=16)
out = e.generate(PROMPTS, 4)
ck = Checkpointer(e.cache, sys.argv[1])
ck.save(wait=True)
print("SAVED", out, flush=True)
if sys.argv[2] == "kill":
  # The fault, around Orbax's real commit: step 1's arrays and metadata are written in
  # full, and the rename that would finish the step is held (the process dies there).
  # Items inside the step commit as usual.
  commit = atomicity.AtomicRenameTemporaryPath.finalize

  async def held(self):
    if self.get_final().name != "1":
      return await commit(self)
    print("SAVING", self.get(), flush=True)
    await asyncio.Event().wait()  # never set: the kill comes first

  atomicity.AtomicRenameTemporaryPath.finalize = held
  rng = np.random.default_rng(0)
  e.generate([rng.integers(1, 128, 60).tolist() for _ in range(8)], 1)  # blocks step 0 lacks
  ck.save(wait=False)
  ck.wait()  # never returns: step 1 is never committed
"""


def test_restore_in_a_new_process_and_after_a_save_killed_midway(mesh, tmp_path):
  """A process killed while its second save is written but not yet committed: the next
  process restores the first save and removes what the second left."""
  ckpt = str(tmp_path / "ckpt")
  proc = subprocess.Popen([sys.executable, "-c", SAVER, ckpt, "kill"], cwd=ROOT,
                          stdout=subprocess.PIPE, text=True,
                          env=helpers.child_env())
  saved = proc.stdout.readline()
  assert saved.startswith("SAVED"), saved
  saving = proc.stdout.readline()
  assert saving.startswith("SAVING"), saving
  proc.send_signal(signal.SIGKILL)  # step 1 written, its commit held
  proc.wait(timeout=60)
  left = os.listdir(ckpt)
  partial = os.path.basename(saving.split()[1])
  assert "1" not in left and partial in left and "orbax-checkpoint-tmp" in partial, left
  assert {"state", "meta"} <= set(os.listdir(os.path.join(ckpt, partial)))  # written
  want = eval(saved[len("SAVED"):])  # the tokens the first process generated
  e = engine_on(mesh, pages_per_shard=512, max_pages_per_seq=16)
  ck = Checkpointer(e.cache, ckpt)
  counts = ck.restore()
  assert counts["step"] == 0  # the latest committed step
  assert counts["placed"] > 0 and counts["failed_checksum"] == 0
  assert e.generate(PROMPTS, 4) == want
  s = e.stats()
  assert s["hits"]["device"] == sum((len(p) - 1) // 4 for p in PROMPTS)
  assert not [n for n in os.listdir(ckpt) if "orbax-checkpoint-tmp" in n]  # cleaned


def test_serve_restarts_warm(tmp_path):
  """launch/serve.py --checkpoint_dir, then --restore: the second run reuses the first."""
  import json
  small = ["--config.workload.chat.users=4", "--config.workload.chat.turns=2",
           "--config.workload.chat.system_prompt_tokens=40", "--config.workload.chat.user_tokens=(8, 30)",
           "--config.workload.chat.max_new_tokens=6", *helpers.SERVE_SHAPES, "--nocompare",
           f"--checkpoint_dir={tmp_path / 'ckpt'}"]
  env = helpers.child_env()
  runs = []
  for extra in ([], ["--restore"]):
    out = tmp_path / f"run{len(runs)}.json"
    proc = subprocess.run([sys.executable, "launch/serve.py", *small, *extra,
                           f"--json_out={out}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs.append(json.loads(out.read_text()))
  cold, warm = runs
  assert warm["output_digest"] == cold["output_digest"]
  assert warm["stats"]["computed_tokens"] < cold["stats"]["computed_tokens"] / 3
  assert warm["hits"]["device"] > cold["hits"]["device"]
