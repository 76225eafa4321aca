"""The disk tier against whoever can read or write its store: keyed records refuse forgeries
(even with a valid CRC-32C), encrypted records hold no plaintext KV, opening a store of junk
stays bounded in memory and counts what it drops, records of another format survive, local
stores are private (or jaxkv says they are not), and no link, FIFO or socket planted under a
store's names is followed, opened blocking or deleted."""

import json
import logging
import os
import stat
import subprocess
import sys
import time
import tracemalloc

import google_crc32c
import numpy as np
import pytest

import jaxkv
from jaxkv import metrics
from jaxkv.errors import InputError
from jaxkv.worker.tiers import blocks
from jaxkv.worker.tiers.disk import DiskTier

import faults
import helpers

KEY = bytes(range(7, 39))  # 32 distinct bytes
PAGE = 4  # helpers.cache_config_for's page_size
FP = b"f" * 32
SHAPE = (2, 2, 4, 8)




def disk_engine(mesh, store, *, key=None, encryption="auto"):
  tiers = jaxkv.TierConfig(disk_kvstore=store, disk_pages=64, write_policy="write_through",
                           encryption=encryption)
  return helpers.make_engine(mesh, tiers=tiers, deployment_key=key)


def read_object(engine, key: bytes) -> bytes:
  disk = engine.cache.worker.disk
  return disk.kv.read(disk.name(key)).result().value


def write_object(engine, key: bytes, data: bytes) -> None:
  """Writes a record's bytes as whoever can write the store would (a file, an object)."""
  disk = engine.cache.worker.disk
  disk.kv.write(disk.name(key), data).result()


def flip(data: bytes, at: int) -> bytes:
  out = bytearray(data)
  out[at] ^= 0x10
  return bytes(out)


# ---- keyed records refuse forgeries ---------------------------------------------------------
@pytest.mark.parametrize("encryption, forgery, reason", [
    ("auto", "valid_crc", "mode"), ("off", "valid_crc", "mode"),
    ("auto", "tag_kept", "mac"), ("off", "tag_kept", "mac")])
def test_a_forged_record_is_refused_by_a_keyed_cache_even_with_a_valid_crc(
    mesh, tmp_path, fresh, encryption, forgery, reason):
  engine = disk_engine(mesh, str(tmp_path / "d"), key=KEY, encryption=encryption)
  prompt = list(range(1, 6 * PAGE + 2))  # 6 full blocks
  want = fresh.generate([prompt], 3)
  assert engine.generate([prompt], 3) == want
  assert engine.flush(30) == 0
  keys = engine.cache.index.block_keys(prompt, "default")
  original = read_object(engine, keys[2])
  cache = engine.cache
  if forgery == "valid_crc":
    # The record a keyless writer would make for other KV: its CRC-32C is right, so a
    # keyless reader takes it (checked), but it carries no tag made with the key.
    parent = blocks.header_keys(np.frombuffer(original, np.uint8))[1]
    other = np.full(cache.payload_shape, 0.5, cache.config.jnp_dtype)
    forged = blocks.encode(other, keys[2], cache.config.fingerprint(), parent)
    expect = dict(key=keys[2], fingerprint=cache.config.fingerprint(),
                  dtype=cache.config.jnp_dtype, shape=cache.payload_shape)
    np.testing.assert_array_equal(blocks.decode(forged, **expect), other)
    crc = google_crc32c.value(forged[blocks.HEADER_BYTES:]).to_bytes(4, "little")
    assert forged[136:144].tobytes() == bytes(4) + crc  # protection 0 (CRC), the CRC-32C
    forged = forged.tobytes()
  else:  # the payload changed, the header (and its tag) kept
    forged = flip(original, blocks.HEADER_BYTES + 40)
  assert len(forged) == len(original)
  write_object(engine, keys[2], forged)
  helpers.forget_device_copies(engine)
  engine.reset_stats()
  assert engine.generate([prompt], 3) == want
  s = engine.stats()
  assert s["verify_failures_by_reason"] == {reason: 1} and s["verify_failures"] == 1
  assert s["hits"]["disk"] == 2  # blocks 0 and 1; 2 refused, the rest recomputed
  assert engine.cache.index.counters.dropped == 4


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_a_tampered_record_is_refused_when_read_and_when_the_store_is_opened(
    mesh, tmp_path, fresh, request, where):
  store = (str(tmp_path / "d") if where == "dir"
           else request.getfixturevalue("s3").kvstore("tampered", "kv/"))
  engine = disk_engine(mesh, store, key=KEY)
  prompt = list(range(3, 5 * PAGE + 3))
  want = fresh.generate([prompt], 2)
  engine.generate([prompt], 2)
  assert engine.flush(30) == 0
  keys = engine.cache.index.block_keys(prompt, "default")
  write_object(engine, keys[1], flip(read_object(engine, keys[1]), 150))  # its tag
  helpers.forget_device_copies(engine)
  assert engine.generate([prompt], 2) == want
  assert engine.stats()["verify_failures_by_reason"] == {"mac": 1}  # the rest never read
  assert engine.flush(30) == 0  # the recomputed blocks written again
  # Another cache opening the store refuses a tampered payload, counts and deletes it.
  write_object(engine, keys[2], flip(read_object(engine, keys[2]), blocks.HEADER_BYTES + 9))
  other = disk_engine(mesh, store, key=KEY)
  s = other.stats()
  assert s["disk_discarded_at_open_by_reason"] == {"mac": 1} and s["disk_discarded_at_open"] == 1
  assert other.cache.disk_recovered["deleted"] == 1
  other.cache.worker.disk.settle()
  assert other.cache.worker.disk.kv.read(other.cache.worker.disk.name(keys[2])).result().state == "missing"
  samples = {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
             for family in metrics.EngineCollector({"jaxkv": other}).collect()
             for smp in family.samples}
  assert samples[("jaxkv_disk_discarded_at_open_total",
                  (("policy", "jaxkv"), ("reason", "mac")))] == 1
  assert other.generate([prompt], 2) == want


# ---- encrypted records hold no plaintext KV -------------------------------------------------
def layer0_values(record: bytes, cache) -> np.ndarray:
  """What an attacker reads from a plaintext record: layer 0's V rows, [page_size, kv_heads,
  head_dim] (the payload is [2 * layers, kv_heads, page_size, head_dim], K then V)."""
  payload = np.frombuffer(record[blocks.HEADER_BYTES:], cache.config.jnp_dtype)
  return payload.reshape(cache.payload_shape)[1].transpose(1, 0, 2)


def test_an_encrypted_store_holds_no_plaintext_kv_a_vocabulary_table_could_read(
    mesh, tmp_path):
  plain = disk_engine(mesh, str(tmp_path / "plain"))
  sealed = disk_engine(mesh, str(tmp_path / "sealed"), key=KEY)
  assert sealed.cache.encrypt and not plain.cache.encrypt
  vocab = list(range(1, 128))
  enumerating = [vocab[:64], vocab[64:] + [1]]  # every token id, in full blocks
  secret = [int(t) for t in np.random.default_rng(5).integers(1, 128, 10 * PAGE)]
  plain.generate(enumerating + [secret], 1)
  sealed.generate([secret], 1)
  for e in (plain, sealed):
    assert e.flush(30) == 0
  # The attack: layer-0 V is a function of the token id alone (no position in V), so the
  # records of a prompt that enumerates the vocabulary make a table id -> V.
  table = {}
  for prompt in enumerating:
    for b, key in enumerate(plain.cache.index.block_keys(prompt, "default")):
      rows = layer0_values(read_object(plain, key), plain.cache)
      for j in range(PAGE):
        table[prompt[b * PAGE + j]] = rows[j]
  assert len(table) == 127
  ids = np.array(sorted(table))
  vectors = np.stack([table[i] for i in ids]).reshape(len(ids), -1).astype(np.float32)

  def recovered(engine, prompt):
    got = []
    for key in engine.cache.index.block_keys(prompt, "default"):
      rows = layer0_values(read_object(engine, key), engine.cache)
      rows = rows.reshape(PAGE, -1).astype(np.float32)
      got += ids[np.argmin(((rows[:, None] - vectors[None]) ** 2).sum(-1), axis=1)].tolist()
    return np.mean(np.array(got) == np.array(prompt[:len(got)]))

  assert recovered(plain, secret) >= 0.95  # plaintext KV reads back into the prompt
  # The files, byte for byte: any table vector's bytes (one head's row of one token).
  rows = {table[i][h].tobytes() for i in table for h in range(table[i].shape[0])}

  def found(root):
    hits = 0
    for d, _, files in os.walk(root):
      for f in files:
        data = open(os.path.join(d, f), "rb").read()
        hits += sum(row in data for row in rows)
    return hits

  assert found(str(tmp_path / "plain")) >= len(set(secret))  # the test finds what is there
  assert found(str(tmp_path / "sealed")) == 0
  assert len(os.listdir(sealed.cache.worker.disk.prefix_path)) >= 10
  # And the encrypted records are the cache's KV all the same: read back, bit-exact output.
  want = plain.generate([secret], 3)
  helpers.forget_device_copies(sealed)
  sealed.reset_stats()
  assert sealed.generate([secret], 3) == want
  hits = (len(secret) - 1) // PAGE  # the block of the last prompt token is computed again
  assert sealed.stats()["hits"]["disk"] == hits and sealed.stats()["verify_failures"] == 0


# ---- opening a store ------------------------------------------------------------------------
SCAN_IN_A_CHILD = r"""
import json, resource, sys
from jaxkv.worker.tiers.disk import DiskTier
disk = DiskTier(sys.argv[1], num_slots=8, payload_shape=(2, 2, 4, 8), dtype="float32",
                fingerprint=b"f" * 32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
good, deleted = disk.scan()
disk.settle()
grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"good": len(good), "deleted": deleted, "discarded": disk.discarded,
                  "grew_kib": grew}))
"""


def test_opening_a_store_of_ten_thousand_junk_records_stays_bounded_and_counts_them(tmp_path):
  path = str(tmp_path / "d")
  disk = DiskTier(path, num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP)
  rng = np.random.default_rng(0)
  for i in range(3):
    disk.write(bytes([i]) * 32, rng.standard_normal(SHAPE).astype(np.float32), None).result()
  good_record = open(disk.path_of(bytes([0]) * 32), "rb").read()
  junk = lambda i: os.path.join(disk.prefix_path, f"ff{i:062x}")
  for i in range(10_000):  # a few bytes each: judged by their size, never read
    with open(junk(i), "wb") as f:
      f.write(b"junk")
  for i in range(10_000, 10_004):  # huge (sparse): reading them would take 256 MiB
    with open(junk(i), "wb") as f:
      f.truncate(64 << 20)
  for i in range(10_004, 10_050):  # the right size, not a record
    open(junk(i), "wb").write(rng.bytes(disk.record_bytes))
  for i in range(10_050, 10_070):  # a valid record under another block's name
    open(junk(i), "wb").write(good_record)
  open(junk(10_070), "wb").write(flip(good_record, -1))
  proc = subprocess.run([sys.executable, "-c", SCAN_IN_A_CHILD, path], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["good"] == 3
  assert r["discarded"] == {"size": 10_004, "magic": 46, "key": 20, "checksum": 1}
  assert r["deleted"] == 10_071
  assert r["grew_kib"] < 64 * 1024, r  # well below the 256 MiB of the huge files alone
  assert sorted(os.listdir(disk.prefix_path)) == sorted(
      os.path.basename(disk.path_of(bytes([i]) * 32)) for i in range(3))


READ_IN_A_CHILD = r"""
import json, resource, sys, time
from jaxkv.worker.tiers import blocks
from jaxkv.worker.tiers.disk import DiskTier
disk = DiskTier(sys.argv[1], num_slots=8, payload_shape=(2, 2, 4, 8), dtype="float32",
                fingerprint=b"f" * 32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
for name, key in (("long", bytes(32)), ("short", bytes([1]) * 32)):
  try:
    payload, = disk.read_verified([key], time.monotonic() + 60)
    out[name] = float(payload.sum())
  except blocks.BlockError as e:
    out[name] = e.reason.value
out["grew_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps(out))
"""


def test_a_huge_file_under_a_records_name_is_never_read_whole(tmp_path):
  """Write access to the store can grow a record to 1 GiB (sparse): a read stops at a
  record's size (the record verifies; what follows it is not read), and a record cut short
  is refused by its size."""
  path = str(tmp_path / "d")
  disk = DiskTier(path, num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP)
  for key in (bytes(32), bytes([1]) * 32):
    disk.write(key, np.ones(SHAPE, np.float32), None).result()
  with open(disk.path_of(bytes(32)), "r+b") as f:
    f.truncate(1 << 30)
  with open(disk.path_of(bytes([1]) * 32), "r+b") as f:
    f.truncate(disk.record_bytes - 1)
  proc = subprocess.run([sys.executable, "-c", READ_IN_A_CHILD, path], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["long"] == np.prod(SHAPE) and r["short"] == "size", r
  assert r["grew_kib"] < 256 * 1024, r  # a quarter of the file at most


@pytest.mark.parametrize("where", ["dir", "s3"])
def test_records_of_another_format_survive_an_open_and_are_counted(tmp_path, request, where):
  store = (str(tmp_path / "d") if where == "dir"
           else request.getfixturevalue("s3").kvstore("formats", "kv/"))
  disk = DiskTier(store, num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP,
                  key=KEY, encrypt=True)
  rng = np.random.default_rng(1)
  disk.write(b"a" * 32, rng.standard_normal(SHAPE).astype(np.float32), None).result()
  record = disk.kv.read(disk.name(b"a" * 32)).result().value
  newer = record[:8] + (4).to_bytes(4, "little") + record[12:]  # a format this jaxkv lacks
  others = {
      FP[:16].hex() + "/" + (b"b" * 32).hex(): record[:8] + (2).to_bytes(4, "little") + record[12:],
      disk.name(b"c" * 32): newer,  # this prefix, another version, same size
      disk.name(b"d" * 32): newer + b"longer",  # and another size
  }
  for name, data in others.items():
    disk.kv.write(name, data).result()
  disk.kv.write(disk.name(b"e" * 32), b"short").result()  # junk: deleted
  disk.kv.write(disk.name(b"g" * 32), b"\x00" * (4 << 20)).result()  # read up to a record
  again = DiskTier(store, num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP,
                   key=KEY, encrypt=True)
  good, deleted = again.scan()
  again.settle()
  assert [k for _, k, _ in good] == [b"a" * 32] and deleted == 2
  # A file's size is known before reading (the big one: "size"); an object's read is cut at
  # a record's size and then judged as one (zeros: "magic").
  assert again.discarded == ({"version": 2, "size": 2} if where == "dir"
                             else {"version": 2, "size": 1, "magic": 1})
  for name, data in others.items():
    assert again.kv.read(name).result().value == data  # still there, untouched
  for gone in (b"e", b"g"):
    assert again.kv.read(again.name(gone * 32)).result().state == "missing"
  assert again.scan()[1] == 0 and again.discarded == {"version": 2}
  scratch = again.scratch(b"s" * 32, 2)  # calibration's: this tier's key and protection
  assert scratch.key_id == again.key_id != "none" and scratch.encrypt
  assert scratch.prefix != again.prefix and scratch.scan() == ([], 0)


# ---- who can reach a local store ------------------------------------------------------------
def insecure_lines(caplog, needle):
  return [r.getMessage() for r in caplog.records
          if "INSECURE" in r.getMessage() and needle in r.getMessage()]


def test_local_stores_are_private_and_an_exposed_keyless_one_says_so(tmp_path, caplog, s3):
  private = str(tmp_path / "new" / "store")
  exposed = tmp_path / "exposed"
  exposed.mkdir()
  exposed.chmod(0o755)
  umask = os.umask(0o022)  # the usual one, which would leave a new file 0644
  try:
    with caplog.at_level(logging.WARNING):
      disk = DiskTier(private, num_slots=8, payload_shape=SHAPE, dtype="float32",
                      fingerprint=FP)
      disk.write(b"a" * 32, np.zeros(SHAPE, np.float32), None).result()
  finally:
    os.umask(umask)
  with caplog.at_level(logging.WARNING):
    DiskTier(str(exposed), num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP,
             key=KEY)  # keyed: its records prove themselves
    assert not insecure_lines(caplog, "disk tier")
    DiskTier(str(exposed), num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP)
    DiskTier(str(exposed), num_slots=8, payload_shape=SHAPE, dtype="float32", fingerprint=FP)
    DiskTier(s3.kvstore("exposed", "kv/"), num_slots=8, payload_shape=SHAPE, dtype="float32",
             fingerprint=FP)
  for d in (private, os.path.join(private, "records"), disk.prefix_path):
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700, d
  [record] = os.listdir(disk.prefix_path)  # the record alone: its temporary was renamed
  assert stat.S_IMODE(os.stat(os.path.join(disk.prefix_path, record)).st_mode) == 0o600
  assert disk.read_verified([b"a" * 32], time.monotonic() + 30)[0].shape == SHAPE
  assert stat.S_IMODE(os.stat(exposed).st_mode) == 0o755  # an existing directory is the user's
  [line] = insecure_lines(caplog, str(exposed))
  assert "mode 0755" in line and f"chmod 700 {exposed}" in line and "deployment key" in line
  [line] = insecure_lines(caplog, "s3://exposed/kv/")
  assert "object store" in line and "set a deployment key" in line
  assert not insecure_lines(caplog, private)


# ---- links, FIFOs and junk names under a store's root ---------------------------------------
# Whoever can write a local store's directories, but lacks the key, plants real links, FIFOs
# and sockets under the names a keyed reader uses. Nothing outside the store is read or
# deleted, nothing is opened blocking, and what is not a regular file is counted and left.
def keyed(store, num_slots=8) -> DiskTier:
  return DiskTier(store, num_slots=num_slots, payload_shape=SHAPE, dtype="float32",
                  fingerprint=FP, key=KEY, encrypt=True)


def write_records(disk, keys) -> None:
  rng = np.random.default_rng(3)
  for w in [disk.write(k, rng.standard_normal(SHAPE).astype(np.float32), None) for k in keys]:
    w.result(timeout=60)
  disk.sync()


def files_under(root) -> dict:
  """Every regular file under ``root`` (no link followed): relative path -> bytes."""
  out = {}
  for d, _, names in os.walk(root):
    for n in names:
      p = os.path.join(d, n)
      if not os.path.islink(p):
        out[os.path.relpath(p, root)] = open(p, "rb").read()
  return out


@pytest.mark.parametrize("link", ["root", "records", "prefix"])
def test_a_linked_store_directory_is_refused_and_what_it_points_to_is_untouched(tmp_path, link):
  """Before: the link was followed, and every file below it that did not verify was
  deleted: the owner's files in the directory the link points to."""
  store = str(tmp_path / "store")
  disk = keyed(store)
  write_records(disk, [b"a" * 32])
  where = {"root": store, "records": os.path.join(store, "records"),
           "prefix": disk.prefix_path.rstrip("/")}[link]
  victim = tmp_path / "owner"  # laid out as the store is below the link
  inner = victim / {"root": os.path.join("records", disk.prefix), "records": disk.prefix,
                    "prefix": ""}[link]
  inner.mkdir(parents=True)
  (inner / "notes.txt").write_bytes(b"the owner's notes")
  (inner / ("ab" * 32)).write_bytes(b"named like a record, not one")
  (inner / ("cd" * 32)).write_bytes(bytes(disk.record_bytes))
  before = files_under(victim)
  faults.link_in_place(where, str(victim))
  with pytest.raises(InputError) as e:
    keyed(store).scan()
  message = str(e.value)
  assert f"{where!r} is a symbolic link" in message and "\n" not in message, message
  assert files_under(victim) == before and len(before) == 3


def test_a_keyed_cache_refuses_a_store_whose_prefix_directory_is_a_link(mesh, tmp_path):
  store = str(tmp_path / "d")
  engine = disk_engine(mesh, store, key=KEY)
  prompt = list(range(1, 4 * PAGE + 2))
  engine.generate([prompt], 2)
  assert engine.flush(30) == 0
  prefix = engine.cache.worker.disk.prefix_path.rstrip("/")
  owner = tmp_path / "owner"
  owner.mkdir()
  (owner / "thesis.tex").write_bytes(b"years of work")
  faults.link_in_place(prefix, str(owner))
  with pytest.raises(InputError, match="is a symbolic link"):
    disk_engine(mesh, store, key=KEY)
  assert files_under(owner) == {"thesis.tex": b"years of work"}


def test_links_and_directories_under_record_names_are_counted_and_never_followed_or_deleted(
    tmp_path):
  """Before: each was followed (stat, read) and, not verifying, deleted (a link itself, or
  the files of a directory under a record's name)."""
  store = str(tmp_path / "d")
  disk = keyed(store)
  write_records(disk, [b"a" * 32, b"b" * 32])
  owner = tmp_path / "owner"
  (owner / "dir").mkdir(parents=True)
  (owner / "record-sized").write_bytes(open(disk.path_of(b"a" * 32), "rb").read())
  (owner / "dir" / "file").write_bytes(b"kept")
  links = {b"c": owner / "record-sized", b"d": owner / "dir", b"e": tmp_path / "nowhere"}
  for k, target in links.items():
    os.symlink(target, disk.path_of(k * 32))
  os.mkdir(disk.path_of(b"f" * 32))  # a directory under a record's name, a file in it
  open(os.path.join(disk.path_of(b"f" * 32), "ab" * 32), "wb").write(b"x" * 200)
  before = files_under(store), files_under(owner)
  again = keyed(store)
  good, deleted = again.scan()
  again.settle()
  assert sorted(k for _, k, _ in good) == [b"a" * 32, b"b" * 32]
  assert again.discarded == {"not_a_file": 4} and deleted == 0
  assert (files_under(store), files_under(owner)) == before
  assert all(os.path.islink(again.path_of(k * 32)) for k in links)
  for k in links:  # a delete by name leaves what the store did not write
    again.delete(k * 32)
  again.settle()
  assert all(os.path.islink(again.path_of(k * 32)) for k in links)


def test_a_record_or_prefix_swapped_for_a_link_after_opening_is_not_followed(tmp_path):
  """The checks at open do not protect what happens after: a record's name or the prefix
  directory replaced by a link later. Before: reads took the linked files (the prefix:
  valid records copied elsewhere were served) and deletes removed files the link led to."""
  store = str(tmp_path / "d")
  keys = [bytes([c]) * 32 for c in b"abcde"]
  write_records(keyed(store), keys)
  disk = keyed(store)
  assert len(disk.scan()[0]) == 5
  # A record's name swapped for a link to the owner's file.
  owner = tmp_path / "owner.bin"
  owner.write_bytes(open(disk.path_of(keys[0]), "rb").read())  # its very bytes
  faults.link_in_place(disk.path_of(keys[0]), str(owner))
  with pytest.raises(blocks.BlockError, match="not a regular file") as e:
    disk.read_verified([keys[0]], time.monotonic() + 30)
  assert e.value.reason == "not_a_file"  # dropped, counted as a verify failure
  disk.delete(keys[0])
  disk.settle()
  assert os.path.islink(disk.path_of(keys[0])) and owner.read_bytes() == open(
      disk.path_of(keys[0]) + ".aside", "rb").read()
  # The prefix directory swapped for a link to a directory of copies of its records.
  mirror = tmp_path / "mirror"
  mirror.mkdir()
  for k in keys[1:]:
    (mirror / k.hex()).write_bytes(open(disk.path_of(k), "rb").read())
  before = files_under(mirror)
  faults.link_in_place(disk.prefix_path, str(mirror))
  with pytest.raises(blocks.BlockError, match="symbolic link") as e:
    disk.read_verified([keys[1]], time.monotonic() + 30)
  assert e.value.reason == "not_a_file"
  disk.delete(keys[2])
  disk.settle()
  with pytest.raises(Exception, match="symbolic link"):
    disk.write(b"z" * 32, np.zeros(SHAPE, np.float32), None).result(timeout=30)
  assert files_under(mirror) == before  # nothing read through it, deleted or written


def test_a_link_planted_under_a_record_name_is_replaced_by_the_write_not_written_through(
    tmp_path):
  """A write lands in a new file renamed over the name: what a link planted there points to
  (here the owner's file outside the store) keeps its bytes and its mode."""
  disk = keyed(str(tmp_path / "d"))
  assert disk.scan() == ([], 0)  # makes the prefix directory
  key = b"k" * 32
  owner = tmp_path / "owner.txt"
  owner.write_bytes(b"the owner's own file")
  os.chmod(owner, 0o644)
  os.symlink(owner, disk.path_of(key))
  write_records(disk, [key])
  assert owner.read_bytes() == b"the owner's own file"
  assert stat.S_IMODE(os.stat(owner).st_mode) == 0o644
  st = os.lstat(disk.path_of(key))
  assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
  assert [n for n in os.listdir(disk.prefix_path) if n.endswith(".__lock")] == []
  assert disk.read_verified([key], time.monotonic() + 30)[0].shape == SHAPE


FIFOS_IN_A_CHILD = r"""
import json, os, stat, sys, time
sys.path.insert(0, sys.argv[2])
import numpy as np
import faults
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.base import Fetch
from jaxkv.worker.tiers.disk import DiskTier
n = int(sys.argv[3])
make = lambda: DiskTier(sys.argv[1], num_slots=64, payload_shape=(2, 2, 4, 8), dtype="float32",
                        fingerprint=b"f" * 32, key=bytes(range(7, 39)), encrypt=True)
disk = make()
keys = [i.to_bytes(32, "big") for i in range(1, n + 3)]
ones = np.ones((2, 2, 4, 8), np.float32)
for w in [disk.write(k, ones, None) for k in keys]:
  w.result(timeout=60)
disk.sync()
at_open = [bytes([0xee]) * 31 + bytes([i]) for i in range(3)]
for k in at_open:
  faults.fifo_in_place(disk.path_of(k))
faults.socket_in_place(disk.path_of(bytes([0xef]) * 32))
disk = make()
good, deleted = disk.scan(deadline_s=30)
out = {"adopted": len(good), "deleted": deleted, "discarded": dict(disk.discarded)}
for k in keys[:n]:  # adopted, then each swapped for a FIFO
  faults.fifo_in_place(disk.path_of(k))
fetches = [Fetch(request=0, block=i, shard=0, tier=Tier.DISK, slot=i, key=k, page=i)
           for i, k in enumerate(keys[:n])]
_, pending = disk.start_fetch(fetches)
outcome = disk.finish_fetch(pending, time.monotonic() + 5, lambda staged: staged)
out["failures"] = sorted({f.value if f else "ok" for f in outcome.failures})
for k in keys[:n]:  # dropped: deleted by name
  disk.delete(k)
disk.settle(10)
out["fifos_left"] = sum(os.path.lexists(disk.path_of(k)) and stat.S_ISFIFO(
    os.lstat(disk.path_of(k)).st_mode) for k in keys[:n] + at_open)
try:  # and the process's disk I/O goes on
  disk.write(b"n" * 32, 2 * ones, None).result(timeout=10)
  disk.sync()
  got = disk.read_verified([b"n" * 32] + keys[n:], time.monotonic() + 10)
  out["after"] = [float(g.sum()) for g in got]
except Exception as e:
  out["after"] = f"{type(e).__name__}: {e}"
print(json.dumps(out), flush=True)
os._exit(0)  # a reader stuck on a FIFO would keep the process from exiting
"""


def test_fifos_and_sockets_under_record_names_are_never_read_and_disk_io_goes_on(tmp_path):
  """Before: a FIFO under an adopted record's name blocked one of TensorStore's I/O threads
  for good on each read (``cancel`` frees none): after a handful every later disk read and
  write of the process timed out. At open, FIFOs and sockets were deleted as junk."""
  n = 2 * (os.cpu_count() or 4) + 8  # more FIFOs than a file I/O thread pool has threads
  proc = subprocess.run([sys.executable, "-c", FIFOS_IN_A_CHILD, str(tmp_path / "d"),
                         os.path.dirname(helpers.__file__), str(n)],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(proc.stdout.strip().splitlines()[-1])
  assert r["adopted"] == n + 2 and r["deleted"] == 0, r
  assert r["discarded"] == {"not_a_file": 4}, r  # 3 FIFOs and a socket, left in place
  assert r["failures"] == ["not_a_file"], r  # every swapped record: unread
  assert r["fifos_left"] == n + 3, r  # none deleted: jaxkv did not write them
  assert r["after"] == [2.0 * np.prod(SHAPE), np.prod(SHAPE), np.prod(SHAPE)], r


def test_opening_a_store_of_200k_junk_names_lists_them_in_bounded_memory(tmp_path):
  """Before: the whole listing was held (names sorted, every deletion's future kept),
  hundreds of bytes a name; now names stream and memory is the read window's."""
  store = str(tmp_path / "d")
  disk = keyed(store)
  write_records(disk, [b"a" * 32])
  n = 200_000
  empties = [tmp_path / f"empty{j}" for j in range(8)]  # ext4 takes 65000 links a file
  for e in empties:
    e.write_bytes(b"")
  dir_fd = os.open(disk.prefix_path, os.O_RDONLY | os.O_DIRECTORY)
  try:  # names of empty files (hard links: a name costs no inode, so they are quick)
    for i in range(n):
      os.link(empties[i % 8], f"{i:064x}", dst_dir_fd=dir_fd)
  finally:
    os.close(dir_fd)
  tracemalloc.start()
  try:
    again = keyed(store)
    good, deleted = again.scan()
    again.settle()
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert [k for _, k, _ in good] == [b"a" * 32]
  assert again.discarded == {"size": n} and deleted == n
  assert os.listdir(disk.prefix_path) == [os.path.basename(disk.path_of(b"a" * 32))]
  assert peak < 8 << 20, peak  # 42 bytes a name at most; a whole listing takes ~10x that
