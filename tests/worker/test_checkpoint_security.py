"""Checkpoints under a deployment key: tagged metadata, rows tagged or sealed (encrypted),
forged ones refused, no plaintext KV in a sealed checkpoint."""

import json
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxkv
from jaxkv.worker.checkpoint import Checkpointer

import helpers
from test_checkpoint import PROMPTS

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))


def keyed(mesh, key=KEY, reuse=True, encryption="auto"):
  """``test_checkpoint``'s engine, under deployment key ``key`` (None: no key)."""
  mc = helpers.tiny_model_config(num_heads=8, num_kv_heads=4)
  cc = helpers.cache_config_for(mc, pages_per_shard=32, max_pages_per_seq=16)
  return helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=reuse,
                             deployment_key=key, tiers=jaxkv.TierConfig(encryption=encryption))


def _saved(directory: str, step: int | None = None) -> tuple[dict, dict]:
  """What a reader of the files gets: the metadata and the arrays as saved (numpy)."""
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step() if step is None else step
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  target = {}
  for k, v in meta["arrays"].items():
    shape, dtype = tuple(v["shape"]), np.dtype(v["dtype"])
    if meta.get("sealed"):  # a row of sealed bits per saved row
      shape, dtype = (shape[2], np.prod(shape) // shape[2] * dtype.itemsize + 28), np.uint8
    target[k] = np.empty(shape, dtype)
  state = manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))["state"]
  manager.close()
  return meta, state


def _forge(directory: str, row: int) -> None:
  """An attacker with write access: a new step whose device row ``row`` holds other bits,
  the metadata (with its tag) copied unchanged."""
  meta, state = _saved(directory)
  forged = {k: np.array(v) for k, v in state.items()}
  if meta["sealed"]:
    forged["device"][row] ^= 1  # one bit of every byte of the sealed row
  else:
    forged["device"][:, :, row] ^= 1  # one bit of every element of the row
  manager = ocp.CheckpointManager(directory)
  manager.save(manager.latest_step() + 1, args=ocp.args.Composite(
      state=ocp.args.StandardSave(forged), meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


@pytest.mark.parametrize("encryption", ["auto", "off"])
def test_keyed_checkpoint_restores_exactly_and_a_forged_row_is_left_out(
    mesh, tmp_path, encryption):
  a = keyed(mesh, encryption=encryption)
  want = a.generate(PROMPTS, 4)
  directory = str(tmp_path / "ckpt")
  Checkpointer(a.cache, directory).save()
  with open(os.path.join(directory, "0", "meta", "metadata")) as f:
    meta = json.load(f)
  rows = [i for i, r in enumerate(meta["device_rows"]) if r is not None]
  assert meta["key_id"] == a.cache.key_id and len(meta["mac"]) > 0
  assert meta["sealed"] == (encryption == "auto")
  # Each row carries its tag, or is sealed (its tag inside the sealed bits, and no checksum
  # of its plain bits beside it: that would let a guessed prompt be tested offline).
  assert all(len(meta["device_rows"][i]) == (4 if meta["sealed"] else 5) for i in rows)
  assert all((meta["device_rows"][i][3] is None) == meta["sealed"] for i in rows)

  b = keyed(mesh, encryption=encryption)
  counts = Checkpointer(b.cache, directory).restore()
  assert counts["placed"] == len(rows) and counts["failed_mac"] == 0

  _forge(directory, rows[0])
  c = keyed(mesh, encryption=encryption)
  counts = Checkpointer(c.cache, directory).restore()
  assert counts["step"] == 1 and counts["failed_mac"] == 1
  assert counts["placed"] == len(rows) - 1 and counts["failed_checksum"] == 0
  fresh = keyed(mesh, reuse=False, encryption=encryption)
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


def _live_kv_pieces(engine) -> set[bytes]:
  """32-byte runs of the KV the engine holds in its device pools, read from the pools
  themselves (not from any checkpoint): every cached page's first 256 bytes of each
  layer's K and V, each kv head. Runs with few distinct bytes (zeros, padding) are left
  out: they could turn up anywhere."""
  cache, pieces = engine.cache, set()
  shards, per = cache.num_shards, cache.config.pages_per_shard
  pages = [s * per + p for s in range(shards) for p in range(per)
           if cache.index.key_of(s, p) is not None]
  assert pages  # the engine cached its prompts' blocks
  for pool in cache.worker.pools:
    # [kv_heads, pages, page_size, head_dim], or a stack of layers' [layers, kv_heads, ...]
    host = np.asarray(jax.device_get(pool)).reshape(-1, *pool.shape[-3:])
    for page in pages:
      for head in range(host.shape[0]):
        row = np.ascontiguousarray(host[head, page]).tobytes()
        pieces |= {row[j:j + 32] for j in range(0, min(len(row), 256), 32)}
  return {p for p in pieces if len(set(p)) > 4}


def test_a_sealed_checkpoint_holds_no_plaintext_kv(mesh, tmp_path):
  """The KV an engine holds in its pools, searched for in the checkpoint it saves sealed:
  no 32-byte run of it is there. The control is independent of the sealed file: the same
  search over another engine's checkpoint of the same prompts, saved tagged (plaintext
  rows), finds every run, so the search does find KV as it lies in a checkpoint's arrays
  and the negative result means the sealed one hides it. Both restore the same tokens."""
  runs = {}
  for encryption in ("off", "auto"):
    e = keyed(mesh, encryption=encryption)
    want = e.generate(PROMPTS, 4)
    pieces = _live_kv_pieces(e)
    Checkpointer(e.cache, str(tmp_path / encryption)).save()
    runs[encryption] = (_saved(str(tmp_path / encryption)), want, pieces)
  (meta, plain), want, plain_pieces = runs["off"]
  (sealed_meta, sealed), want_sealed, pieces = runs["auto"]
  assert want == want_sealed
  assert sealed_meta["sealed"] is True and meta["sealed"] is False
  assert os.stat(tmp_path / "auto").st_mode & 0o777 == 0o700  # made private
  rows = [i for i, r in enumerate(meta["device_rows"]) if r is not None]
  assert len(pieces) >= len(rows)
  # The same prompts on the same weights: the two engines hold the same KV bits.
  assert pieces == plain_pieces
  plain_blob = plain["device"].tobytes()
  assert [p for p in pieces if p not in plain_blob] == []  # the search finds plaintext KV
  blob = sealed["device"].tobytes()
  assert [p for p in pieces if p in blob] == []


def _drop(field):
  def edit(meta):
    del meta[field]
  return edit


def _set(field, value):
  def edit(meta):
    meta[field] = value
  return edit


def _first_row(value):
  def edit(meta):
    i = next(i for i, r in enumerate(meta["device_rows"]) if r is not None)
    meta["device_rows"][i][1] = value
  return edit


def _array_shape(meta):
  meta["arrays"]["device"]["shape"] = meta["arrays"]["device"]["shape"][:4]


@pytest.mark.parametrize("edit,needle", [
    (_drop("fingerprint"), "has no 'fingerprint'"),
    (_set("format", "1"), "has format '1', not 1: it was written by another jaxkv version"),
    (_drop("arrays"), "has no 'arrays'"),
    (_set("fingerprint", 5), "has fingerprint=5, which must be a hex string"),
    (_set("config", [1]), "has config=[1], which must be an object of config fields"),
    (_set("device_rows", None), "has device_rows=None, which must be a list of rows"),
    (_set("device_rows", []), "has device_rows=[], which must be a list of the 32 rows"),
    (_first_row("not hex"), "has device_rows[0]=[0, 'not hex'"),
    (_array_shape, "has arrays.device.shape=[4, 4, 32, 4], which must be 5 non-negative"),
    (_set("sealed", "yes"), "has sealed='yes', which must be true or false"),
])
def test_metadata_missing_or_mistyping_a_field_is_refused_in_one_line(mesh, tmp_path, edit,
                                                                      needle):
  a = keyed(mesh, None)
  a.generate(PROMPTS[:2], 2)
  directory = str(tmp_path / "ckpt")
  Checkpointer(a.cache, directory).save()
  path = os.path.join(directory, "0", "meta", "metadata")
  with open(path) as f:
    meta = json.load(f)
  edit(meta)
  with open(path, "w") as f:
    json.dump(meta, f)
  with pytest.raises(jaxkv.errors.InputError) as e:
    Checkpointer(keyed(mesh, None).cache, directory).restore()
  message = str(e.value)
  assert f"the metadata of checkpoint {directory!r} step 0 " in message and needle in message
  assert "restore another step or start cold" in message and "\n" not in message, message


@pytest.mark.parametrize("content", ["[" * 100_000, "{", "[1, 2]"])
def test_metadata_that_is_not_a_json_object_is_refused_in_one_line(mesh, tmp_path, content):
  a = keyed(mesh, None)
  a.generate(PROMPTS[:1], 2)
  directory = str(tmp_path / "ckpt")
  Checkpointer(a.cache, directory).save()
  with open(os.path.join(directory, "0", "meta", "metadata"), "w") as f:
    f.write(content)
  with pytest.raises(jaxkv.errors.InputError, match="the metadata of checkpoint") as e:
    Checkpointer(keyed(mesh, None).cache, directory).restore()
  assert "\n" not in str(e.value)
