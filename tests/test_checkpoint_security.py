"""Checkpoints under a deployment key: tagged metadata and rows, forged ones refused."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxkv.checkpoint import Checkpointer

import helpers
from test_checkpoint import PROMPTS

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def keyed(mesh, key=KEY, reuse=True):
  """``test_checkpoint``'s engine, under deployment key ``key`` (None: no key)."""
  mc = helpers.tiny_model_config(num_heads=8, num_kv_heads=4)
  cc = helpers.cache_config_for(mc, pages_per_shard=32, max_pages_per_seq=16)
  return helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=reuse,
                             deployment_key=key)


def _forge(directory: str, row: int) -> None:
  """An attacker with write access: a new step whose device row ``row`` holds other bits,
  the metadata (with its tag) copied unchanged."""
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step()
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = {k: jax.ShapeDtypeStruct(tuple(v["shape"]), np.dtype(v["dtype"]), sharding=sharding)
            for k, v in meta["arrays"].items()}
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))["state"]
  forged = {k: np.array(v) for k, v in state.items()}
  forged["device"][:, :, row] ^= 1  # one bit of every element of the row
  manager.save(step + 1, args=ocp.args.Composite(state=ocp.args.StandardSave(forged),
                                                 meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


def test_keyed_checkpoint_restores_exactly_and_a_forged_row_is_left_out(mesh, tmp_path):
  a = keyed(mesh)
  want = a.generate(PROMPTS, 4)
  directory = str(tmp_path / "ckpt")
  Checkpointer(a.cache, directory).save()
  with open(os.path.join(directory, "0", "meta", "metadata")) as f:
    meta = json.load(f)
  rows = [i for i, r in enumerate(meta["device_rows"]) if r is not None]
  assert meta["key_id"] == a.cache.key_id and len(meta["mac"]) > 0
  assert all(len(meta["device_rows"][i]) == 5 for i in rows)  # each row carries its tag

  b = keyed(mesh)
  counts = Checkpointer(b.cache, directory).restore()
  assert counts["placed"] == len(rows) and counts["failed_mac"] == 0

  _forge(directory, rows[0])
  c = keyed(mesh)
  counts = Checkpointer(c.cache, directory).restore()
  assert counts["step"] == 1 and counts["failed_mac"] == 1
  assert counts["placed"] == len(rows) - 1 and counts["failed_checksum"] == 0
  fresh = keyed(mesh, reuse=False)
  follow = [p + w + [7, 8, 9] for p, w in zip(PROMPTS, want)]
  assert c.generate(follow, 4) == fresh.generate(follow, 4)
  c.cache.index.check_invariants()


def test_altered_metadata_and_mismatched_keys_are_refused(mesh, tmp_path):
  a = keyed(mesh)
  a.generate(PROMPTS[:2], 2)
  directory = str(tmp_path / "ckpt")
  Checkpointer(a.cache, directory).save()
  with pytest.raises(ValueError, match="does not verify under deployment key"):
    Checkpointer(keyed(mesh, OTHER_KEY).cache, directory).restore()
  with pytest.raises(ValueError, match="has none; give the same key"):
    Checkpointer(keyed(mesh, None).cache, directory).restore()

  path = os.path.join(directory, "0", "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  row = next(r for r in meta["device_rows"] if r is not None)
  row[0] = row[0] + 1  # the same bits claimed for another shard
  with open(path, "w") as f:
    json.dump(meta, f)
  with pytest.raises(ValueError, match="altered since it was written"):
    Checkpointer(keyed(mesh).cache, directory).restore()

  plain = keyed(mesh, None)
  plain.generate(PROMPTS[:1], 2)
  Checkpointer(plain.cache, str(tmp_path / "plain")).save()
  with pytest.raises(ValueError, match="written without a deployment key"):
    Checkpointer(keyed(mesh).cache, str(tmp_path / "plain")).restore()
