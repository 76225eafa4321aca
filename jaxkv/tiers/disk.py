"""DISK tier: every block is one record, named by its key, in any TensorStore kvstore.

A record lives at ``<kvstore>/records/<fingerprint>/<block key>`` (hex; the fingerprint's
first 16 bytes). Any kvstore works unchanged: ``file`` (the default for a path),
``memory`` (tests), ``s3`` (tested against an S3-compatible server on loopback) and
``gcs`` through the same calls.

Why content-addressed (BUILD.md, "Sharing a store"): a record's name says which block it
holds, so any number of caches, processes and jobs can share one store. Two writers of one
block write the same bytes under the same name (an idempotent overwrite; the file driver
writes a temporary and renames it, an object store replaces the object whole), so nothing
ever clashes, and a reader verifies what it reads as before. Records of another model or
layout sit under another fingerprint and are never touched.

Capacity on a shared store is per process: ``num_slots`` is this process's quota, the index
pools it like any tier (eviction by reuse count, aged, then LRU), and the record of a block
this process evicts is deleted when its slot is taken. A record another process deleted
is a miss when read (``Failure.GONE``: its index entry is dropped), never an error. The
store therefore holds at most the sum of its users' quotas, plus records left by processes
that stopped (adopted by the next one that opens the store, up to its quota).

Every record carries jaxkv's own header and CRC-32C (``blocks``), so a record that does not
verify (damaged, foreign, of another key) is deleted and counted. A slot being written or
read is pinned so eviction cannot take it meanwhile; a block is published in the index
only after its write committed and, on a local file system, after the batch it was part of
was flushed to the device (one ``syncfs`` per batch, not an fsync per record: each record
is a complete file or absent after a crash, and adoption verifies it anyway).

On open, temporaries a killed writer left are deleted (never a live writer's: see
``_remove_if_unlocked``), every record of this fingerprint is read and verified, verified
ones are offered back to the index up to the quota (``scan``), and ones that do not verify
are deleted.
"""

from __future__ import annotations

import ctypes
import dataclasses
import fcntl
import functools
import os
import time

import numpy as np
import tensorstore as ts
from absl import logging

from jaxkv.index import Tier
from jaxkv.tiers import blocks
from jaxkv.tiers.base import Failure, Fetch, Landing
from jaxkv.errors import InputError

RECORDS_PATH = "records/"
READ_ATTEMPTS = 2  # reads of one record that raise before it is given up (deleted)
# TensorStore error codes that mean the stored bytes are wrong, not that reading failed.
_DAMAGE = ("DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")


class Gone(Exception):
  """The record is not in the store (another process evicted it)."""

  reason = Failure.GONE


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
  key: bytes
  future: object  # tensorstore.Future of the record
  started: float


@dataclasses.dataclass
class PendingWrite:
  slot: int
  key: bytes
  parent: bytes | None
  future: object  # the commit future; None for a write another process of the job does
  code: int = 0  # base.WRITE_* once this process knows the outcome of its own write


@functools.lru_cache(maxsize=1)
def _libc():
  return ctypes.CDLL(None, use_errno=True)


def _syncfs(path: str) -> None:
  """Flushes the file system holding ``path`` to its device (one call for a batch)."""
  fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
  try:
    if _libc().syncfs(fd) != 0:
      raise OSError(ctypes.get_errno(), "syncfs failed", path)
  except AttributeError:  # no syncfs in this libc
    os.sync()
  finally:
    os.close(fd)


class DiskTier:
  """This process's view of a (possibly shared) block store (a ``FetchSource``)."""

  tier = Tier.DISK

  def __init__(self, location, *, num_slots: int, payload_shape: tuple, dtype,
               fingerprint: bytes):
    self.kvstore = kvstore_spec(location)
    self.num_slots = int(num_slots)
    self.payload_shape = tuple(payload_shape)
    self.dtype = dtype
    self.fingerprint = fingerprint
    self.record_bytes = blocks.record_bytes(payload_shape, dtype)
    self.local = self.kvstore["driver"] == "file"
    self._check_writable()
    self.removed_temporaries = self._remove_temporaries()
    spec = dict(self.kvstore)
    spec["path"] = spec.get("path", "") + RECORDS_PATH
    if self.local:
      spec["file_io_sync"] = False  # flushed once per batch (``sync``)
    try:
      self.kv = ts.KvStore.open(spec).result()
    except Exception as e:  # pylint: disable=broad-except  (bad spec, unreachable store)
      raise InputError(f"the disk tier at {self.kvstore} cannot be opened ({e}); check the "
                       "kvstore spec and that the store is reachable.") from None
    if self.local and os.path.exists(os.path.join(self.kvstore["path"], "blocks", "zarr.json")):
      logging.warning("disk tier %s holds a store of an older jaxkv (format 1, one zarr array "
                      "under blocks/): it is not read; delete %s to free its space.",
                      self.kvstore["path"], os.path.join(self.kvstore["path"], "blocks"))
    self._key_of_slot: dict[int, bytes] = {}  # what each slot of this process's quota holds
    self._slot_of_key: dict[bytes, int] = {}
    self._read_errors: dict[int, int] = {}  # slot -> reads in a row that raised
    self._deletes: dict[str, object] = {}  # name -> deletion in flight (kept: a dropped
    # TensorStore future may cancel its operation)

  # ---- names -------------------------------------------------------------------------------
  @property
  def prefix(self) -> str:
    """Where this fingerprint's records are (relative to ``<kvstore>/records/``)."""
    return self.fingerprint[:16].hex() + "/"

  def name(self, key: bytes) -> str:
    return self.prefix + key.hex()

  def key_of(self, slot: int) -> bytes | None:
    return self._key_of_slot.get(slot)

  @property
  def prefix_path(self) -> str:
    """The directory of this fingerprint's records (file driver)."""
    return os.path.join(self.kvstore["path"], RECORDS_PATH, self.prefix)

  def path_of(self, slot: int) -> str:
    """The file of the record ``slot`` holds (file driver)."""
    return os.path.join(self.kvstore["path"], RECORDS_PATH, self.name(self._key_of_slot[slot]))

  # ---- opening ---------------------------------------------------------------------------
  def _check_writable(self) -> None:
    if not self.local:
      return
    path = self.kvstore["path"]
    try:
      os.makedirs(os.path.join(path, RECORDS_PATH), exist_ok=True)
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
    if not self.local:
      return 0
    n = 0
    for root, _, files in os.walk(os.path.join(self.kvstore["path"], RECORDS_PATH)):
      for name in files:
        if name.endswith(".__lock") and _remove_if_unlocked(os.path.join(root, name)):
          n += 1
    return n

  def scan(self, deadline_s: float = 600.0) -> tuple[list[tuple[int, bytes, bytes | None]], int]:
    """Verifies the stored records of this fingerprint and takes up to ``num_slots`` of the
    verified ones into this process's quota, in name order (so every process of a job
    takes the same). Returns ``([(slot, key, parent), ...], deleted)``.

    Records that do not verify are deleted; verified ones beyond the quota are left to the
    processes that hold them. Slots are numbered from 0 in the order returned.
    """
    names = sorted(k.decode("ascii", "replace")
                   for k in self.kv.list(ts.KvStore.KeyRange(self.prefix, self.prefix[:-1] + "0"))
                   .result())
    futures = [(n, self.kv.read(n)) for n in names if not n.endswith(".__lock")]
    good, deleted = [], 0
    t_end = time.monotonic() + deadline_s
    for name, fut in futures:
      try:
        got = fut.result(timeout=max(0.0, t_end - time.monotonic()))
      except Exception:  # pylint: disable=broad-except  (unreadable now: leave it)
        continue
      if got.state != "value":
        continue  # removed meanwhile by its owner
      try:
        record = np.frombuffer(got.value, np.uint8)
        key, parent = blocks.header_keys(record)
        if name != self.name(key):
          raise blocks.BlockError("key", f"record {name} holds block {key.hex()}")
        self.verify(record, key)
      except Exception:  # pylint: disable=broad-except  (unverifiable: delete it)
        self._delete_name(name)
        deleted += 1
        continue
      if len(good) < self.num_slots:
        slot = len(good)
        self._key_of_slot[slot] = key
        self._slot_of_key[key] = slot
        good.append((slot, key, parent))
    return good, deleted

  # ---- I/O ---------------------------------------------------------------------------------
  def write(self, slot: int, payload: np.ndarray, key: bytes, parent: bytes | None
            ) -> PendingWrite:
    """Starts writing block ``key`` into ``slot`` of this process's quota; publish it only
    once ``future`` has succeeded and ``sync`` has run. The record the slot held before (a
    block evicted from it) is deleted."""
    record = blocks.encode(payload, key, self.fingerprint, parent)
    name = self._assign(slot, key)
    deleting = self._deletes.pop(name, None)
    if deleting is not None:  # a deletion of this very record in flight: let it land first
      _wait(deleting, 30.0)
    try:
      fut = self.kv.write(name, record.tobytes())
    except Exception as e:  # pylint: disable=broad-except  (surface as a failed future)
      fut = _failed(e)
    return PendingWrite(slot, key, parent, fut)

  def claim(self, slot: int, key: bytes, parent: bytes | None) -> PendingWrite:
    """``slot`` will hold block ``key``, written by another process of the job."""
    self._assign(slot, key)
    return PendingWrite(slot, key, parent, None)

  def adopt(self, entries: list[tuple[int, bytes]]) -> None:
    """Takes ``(slot, key)`` records another process of the job verified (its ``scan``)."""
    for slot, key in entries:
      self._assign(slot, key)

  def _assign(self, slot: int, key: bytes) -> str:
    """Points ``slot`` at block ``key`` (deleting the record of the block it held before)."""
    old = self._unmap(slot)
    if old is not None and old != key:
      self._delete_name(self.name(old))  # the block evicted from this slot
    stale = self._slot_of_key.get(key)
    if stale is not None:  # an earlier slot named this block: not any more
      self._unmap(stale)
    self._key_of_slot[slot] = key
    self._slot_of_key[key] = slot
    self._read_errors.pop(slot, None)  # a new record in the slot
    return self.name(key)

  def sync(self) -> None:
    """Makes every committed write durable (local files: one ``syncfs``; an object store's
    writes are durable when they commit)."""
    if self.local:
      _syncfs(os.path.join(self.kvstore["path"], RECORDS_PATH))

  def read(self, slot: int, key: bytes | None = None) -> PendingRead:
    key = self._key_of_slot.get(slot) if key is None else key
    try:
      if key is None:
        raise Gone(f"slot {slot} holds no record")
      fut = self.kv.read(self.name(key))
    except Exception as e:  # pylint: disable=broad-except
      fut = _failed(e)
    return PendingRead(slot, key, fut, time.monotonic())

  def _record(self, pending: PendingRead, t_end: float) -> np.ndarray:
    """The bytes of a read (raises ``TimeoutError``, ``Gone`` or the store's error)."""
    got = pending.future.result(timeout=max(0.0, t_end - time.monotonic()))
    if got.state != "value":
      raise Gone(f"no record for block {pending.key.hex()[:16]}")
    return np.frombuffer(got.value, np.uint8)

  def verify(self, record, key: bytes) -> np.ndarray:
    """Payload of a record read for block ``key`` (raises ``blocks.BlockError``)."""
    return blocks.decode(record, key=key, fingerprint=self.fingerprint, dtype=self.dtype,
                         shape=self.payload_shape)

  # ---- FetchSource -------------------------------------------------------------------------
  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, list]:
    """Puts every read in flight at once."""
    return None, [(f, self.read(f.slot, f.key)) for f in fetches]

  def finish_fetch(self, pending: list, t_end: float, stage) -> Landing | None:
    """Waits for each read until ``t_end`` at the latest and verifies its record."""
    staged = []
    for f, r in pending:
      try:
        staged.append((f.shard, f.page, self.verify(self._record(r, t_end), f.key)))
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
    DATA_LOSS and kin), that is a corrupt record. Anything else (I/O, unavailable) is taken
    as transient the first time: the record is kept and read again next time; given up on
    when the next read raises too."""
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
    raises the first failure (``TimeoutError``, ``Gone`` or ``blocks.BlockError``)."""
    reads = [self.read(s, k) for s, k in zip(slots, keys)]
    return [self.verify(self._record(r, t_end), r.key) for r in reads]

  def delete(self, slot: int) -> None:
    """Removes the record a slot holds (best effort) and frees the slot's name."""
    key = self._unmap(slot)
    if key is not None:
      self._delete_name(self.name(key))

  def forget(self, slot: int) -> None:
    """The slot's record is gone from the store (another process removed it): the slot
    no longer names it, so reusing the slot deletes nothing."""
    self._unmap(slot)

  def _unmap(self, slot: int) -> bytes | None:
    key = self._key_of_slot.pop(slot, None)
    if key is not None:
      self._slot_of_key.pop(key, None)
    return key

  def _delete_name(self, name: str) -> None:
    """Starts deleting a record (best effort: absent already, or unreachable, is fine)."""
    self._deletes = {n: d for n, d in self._deletes.items() if not d.done()}
    try:
      self._deletes[name] = self.kv.write(name, None)
    except Exception:  # pylint: disable=broad-except
      pass

  def settle(self, timeout_s: float = 30.0) -> None:
    """Waits (up to ``timeout_s``) for the deletions in flight."""
    t_end = time.monotonic() + timeout_s
    for d in self._deletes.values():
      _wait(d, max(0.0, t_end - time.monotonic()))
    self._deletes.clear()

  def bytes_on_disk(self) -> int:
    """Bytes the store's files use (file driver; 0 otherwise)."""
    if not self.local:
      return 0
    total = 0
    for root, _, files in os.walk(self.kvstore["path"]):
      for f in files:
        try:
          total += os.path.getsize(os.path.join(root, f))
        except FileNotFoundError:  # removed meanwhile by another process
          pass
    return total


def _wait(future, timeout_s: float) -> None:
  try:
    future.result(timeout=timeout_s)
  except Exception:  # pylint: disable=broad-except  (best effort)
    pass


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
