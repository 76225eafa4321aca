"""DISK tier: blocks as records in a TensorStore zarr3 array, one record per chunk.

The store is ``uint8[num_slots, record_bytes]`` with chunks of one record (one block),
the ``crc32c`` codec, and flat chunk keys (``c.<slot>.0``), under ``<kvstore>/blocks/``.
Any TensorStore kvstore works unchanged: ``file`` (the default for a path), ``memory``
(tests), ``gcs``/``s3`` (a cluster's shared storage).

Why this layout (measured in ``launch/bench.py --suite=tiers``): one block per chunk makes
every write a single independent object — the file driver writes it to a temporary,
fsyncs and renames, so a record is either wholly old or wholly new, and a random set of
blocks is gathered with many reads in flight. A multi-block (sharded) chunk would turn
each random block write into a read-modify-write of its whole shard.

Every record carries jaxkv's own header and SHA-256 (``blocks``), since a missing chunk
reads back as zeros and a flipped bit can slip past a store without ``crc32c``.
A slot is published in the index only after its write *committed*; a slot being written
or read is pinned (referenced) so eviction cannot hand it to another block meanwhile.

On open, the store is checked against this cache (record size and model/layout
fingerprint, kept in the array's attributes) and repaired: temporaries left by a killed
writer are deleted, every record is read and verified, verified ones are offered back to
the index (``scan``), and unverifiable ones are deleted. Disk use is bounded by
``num_slots * record_bytes``.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import time

import numpy as np
import tensorstore as ts

from jaxkv.index import Tier
from jaxkv.tiers import blocks
from jaxkv.tiers.base import Failure, Fetch, Landing
from jaxkv.errors import InputError

ARRAY_PATH = "blocks/"
READ_ATTEMPTS = 2  # reads of one record that raise before it is given up (deleted)
# TensorStore error codes that mean the stored bytes are wrong, not that reading failed.
_DAMAGE = ("DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")


def _remove_if_unlocked(path: str) -> bool:
  """Removes ``path`` if no process holds a lock on it (a POSIX record lock conflicts with
  a writer's open-file-description lock too). Returns whether it was removed."""
  try:
    fd = os.open(path, os.O_RDWR)
  except FileNotFoundError:
    return False
  try:
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      return False  # held: a live writer's
    try:
      os.remove(path)  # while holding the lock, as the writers' protocol expects
    except FileNotFoundError:
      return False
    return True
  finally:
    os.close(fd)


def kvstore_spec(location) -> dict:
  """A TensorStore kvstore spec from a directory path or a spec dict (copied)."""
  if isinstance(location, str):
    spec = {"driver": "file", "path": location}
  elif isinstance(location, dict) and "driver" in location:
    spec = dict(location)
  else:
    raise InputError(f"disk_kvstore={location!r} must be a directory path or a TensorStore "
                     "kvstore spec such as {'driver': 'file', 'path': '/data/kv'}.")
  path = spec.get("path", "")
  if path and not path.endswith("/"):
    spec["path"] = path + "/"  # a path without '/' would glue keys onto it
  return spec


@dataclasses.dataclass
class PendingRead:
  slot: int
  future: object  # tensorstore.Future of the record
  started: float


@dataclasses.dataclass
class PendingWrite:
  slot: int
  key: bytes
  parent: bytes | None
  future: object  # the commit future


class DiskTier:
  """One process's disk block store (a ``FetchSource``)."""

  tier = Tier.DISK

  def __init__(self, location, *, num_slots: int, payload_shape: tuple, dtype,
               fingerprint: bytes):
    self.kvstore = kvstore_spec(location)
    self.num_slots = int(num_slots)
    self.payload_shape = tuple(payload_shape)
    self.dtype = dtype
    self.fingerprint = fingerprint
    self.record_bytes = blocks.record_bytes(payload_shape, dtype)
    self._check_writable()
    self.removed_temporaries = self._remove_temporaries()
    self.array = self._open()
    self._read_errors: dict[int, int] = {}  # slot -> reads in a row that raised

  # ---- opening ---------------------------------------------------------------------------
  def _array_kvstore(self) -> dict:
    spec = dict(self.kvstore)
    spec["path"] = spec.get("path", "") + ARRAY_PATH
    return spec

  def _check_writable(self) -> None:
    if self.kvstore["driver"] != "file":
      return
    path = self.kvstore["path"]
    try:
      os.makedirs(path, exist_ok=True)
    except OSError as e:
      raise InputError(f"disk tier directory {path!r} cannot be created ({e.strerror}); "
                       "point disk_kvstore at a writable directory.") from None
    if not os.access(path, os.W_OK | os.X_OK):
      raise InputError(f"disk tier directory {path!r} is not writable; point disk_kvstore at "
                       "a writable directory.")

  def _remove_temporaries(self) -> int:
    """Deletes ``*.__lock`` files a killed writer left (file driver only). TensorStore's
    file driver holds a lock on that file while it writes (an open-file-description lock
    on Linux); if we can take a lock on it, no writer is alive and the file is stale. A
    live writer's (another process sharing the store) is left alone, and one that vanishes
    meanwhile was finished by its writer."""
    if self.kvstore["driver"] != "file":
      return 0
    root = os.path.join(self.kvstore["path"], ARRAY_PATH)
    n = 0
    if os.path.isdir(root):
      for name in os.listdir(root):
        if name.endswith(".__lock") and _remove_if_unlocked(os.path.join(root, name)):
          n += 1
    return n

  def _open(self):
    attrs = {"jaxkv_fingerprint": self.fingerprint.hex(), "jaxkv_format": blocks.FORMAT_VERSION}
    spec = {
        "driver": "zarr3",
        "kvstore": self._array_kvstore(),
        "metadata": {
            "shape": [self.num_slots, self.record_bytes],
            "data_type": "uint8",
            "chunk_grid": {"name": "regular",
                           "configuration": {"chunk_shape": [1, self.record_bytes]}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "."}},
            "codecs": [{"name": "bytes"}, {"name": "crc32c"}],
            "fill_value": 0,
            "attributes": attrs,
        },
        "open": True,
        "create": True,
    }
    try:
      return ts.open(spec).result()
    except ValueError as e:
      existing = self._existing_metadata()
      raise InputError(
          f"the disk tier at {self.kvstore} holds a store this cache cannot use (it has shape "
          f"{existing.get('shape')} and fingerprint "
          f"{existing.get('attributes', {}).get('jaxkv_fingerprint', '?')[:16]}..., this cache "
          f"needs [{self.num_slots}, {self.record_bytes}] and {self.fingerprint.hex()[:16]}...):"
          f" another model, layout or capacity wrote it. Point disk_kvstore at a new location "
          f"or delete the old store. ({e})") from None

  def _existing_metadata(self) -> dict:
    try:
      return ts.open({"driver": "zarr3", "kvstore": self._array_kvstore(), "open": True}
                     ).result().spec().to_json().get("metadata", {})
    except Exception:  # pylint: disable=broad-except
      return {}

  def scan(self, deadline_s: float = 600.0) -> tuple[list[tuple[int, bytes, bytes | None]], int]:
    """Verifies every stored record. Returns ``([(slot, key, parent), ...], deleted)``.

    Records that do not verify are deleted, so what remains is usable and bounded.
    """
    kv = ts.KvStore.open(self._array_kvstore()).result()
    slots = []
    for k in kv.list().result():
      parts = k.decode("utf-8", "replace").split(".")
      if len(parts) == 3 and parts[0] == "c" and parts[1].isdigit():
        slot = int(parts[1])
        if slot < self.num_slots:
          slots.append(slot)
    slots.sort()
    futures = [(s, self.array[s].read()) for s in slots]
    good, deleted = [], 0
    t_end = time.monotonic() + deadline_s
    for s, fut in futures:
      try:
        rec = fut.result(timeout=max(0.0, t_end - time.monotonic()))
        key, parent = blocks.header_keys(rec)
        blocks.decode(rec, key=key, fingerprint=self.fingerprint, dtype=self.dtype,
                      shape=self.payload_shape)
        good.append((s, key, parent))
      except Exception:  # pylint: disable=broad-except  (unreadable = unverifiable)
        self.delete(s)
        deleted += 1
    return good, deleted

  # ---- I/O ---------------------------------------------------------------------------------
  def write(self, slot: int, payload: np.ndarray, key: bytes, parent: bytes | None
            ) -> PendingWrite:
    """Starts writing one block; publish it only once ``future`` has succeeded."""
    record = blocks.encode(payload, key, self.fingerprint, parent)
    self._read_errors.pop(slot, None)  # a new record in the slot
    try:
      fut = self.array[slot].write(record).commit
    except Exception as e:  # pylint: disable=broad-except  (surface as a failed future)
      fut = _failed(e)
    return PendingWrite(slot, key, parent, fut)

  def read(self, slot: int) -> PendingRead:
    try:
      fut = self.array[slot].read()
    except Exception as e:  # pylint: disable=broad-except
      fut = _failed(e)
    return PendingRead(slot, fut, time.monotonic())

  def verify(self, record, key: bytes) -> np.ndarray:
    """Payload of a record read for block ``key`` (raises ``blocks.BlockError``)."""
    return blocks.decode(record, key=key, fingerprint=self.fingerprint, dtype=self.dtype,
                         shape=self.payload_shape)

  # ---- FetchSource -------------------------------------------------------------------------
  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, list]:
    """Puts every read in flight at once."""
    return None, [(f, self.read(f.slot)) for f in fetches]

  def finish_fetch(self, pending: list, t_end: float, stage) -> Landing | None:
    """Waits for each read until ``t_end`` at the latest and verifies its record."""
    staged = []
    for f, r in pending:
      try:
        record = r.future.result(timeout=max(0.0, t_end - time.monotonic()))
        staged.append((f.shard, f.page, self.verify(record, f.key)))
        f.ok = True
      except TimeoutError:
        f.reason = Failure.DEADLINE
        r.future.cancel()
      except Exception as e:  # pylint: disable=broad-except  (any failed read is a miss)
        f.reason = Failure.of(e, self._read_error(f.slot, e))
      if f.ok:
        self._read_errors.pop(f.slot, None)
    return stage(staged) if staged else None

  def _read_error(self, slot: int, error: BaseException) -> Failure:
    """The store raised reading ``slot``. When it says the bytes are wrong (TensorStore's
    DATA_LOSS: the chunk's crc32c failed; a short or malformed chunk), that is a corrupt
    record. Anything else (I/O, unavailable) is taken as transient the first time: the
    record is kept and read again next time; given up on when the next read raises too."""
    if str(error).startswith(_DAMAGE):
      self._read_errors.pop(slot, None)
      return Failure.READ_ERROR
    n = self._read_errors[slot] = self._read_errors.get(slot, 0) + 1
    if n < READ_ATTEMPTS:
      return Failure.READ_RETRY
    del self._read_errors[slot]
    return Failure.READ_ERROR

  def read_verified(self, slots: list[int], keys: list[bytes], t_end: float) -> list[np.ndarray]:
    """Reads and verifies records (all in flight at once) until ``t_end`` at the latest;
    raises the first failure (``TimeoutError`` or ``blocks.BlockError``)."""
    reads = [self.read(s) for s in slots]
    return [self.verify(r.future.result(timeout=max(0.0, t_end - time.monotonic())), k)
            for r, k in zip(reads, keys)]

  def delete(self, slot: int) -> None:
    """Removes a slot's record (best effort; an absent record reads as zeros anyway)."""
    try:
      kv = ts.KvStore.open(self._array_kvstore()).result()
      kv.delete_range(ts.KvStore.KeyRange(f"c.{slot}.0", f"c.{slot}.0\x00")).result()
    except Exception:  # pylint: disable=broad-except
      pass

  def bytes_on_disk(self) -> int:
    """Bytes the store's files use (file driver; 0 otherwise)."""
    if self.kvstore["driver"] != "file":
      return 0
    total = 0
    for root, _, files in os.walk(self.kvstore["path"]):
      total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


class _FailedFuture:
  """A future that already failed (an error raised while issuing I/O)."""

  def __init__(self, error: BaseException):
    self._error = error

  def done(self) -> bool:
    return True

  def result(self, timeout=None):
    del timeout
    raise self._error

  def cancel(self) -> bool:
    return False


def _failed(error: BaseException) -> _FailedFuture:
  return _FailedFuture(error)
