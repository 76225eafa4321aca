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

Slots and records: the index owns the map. ``num_slots`` is this process's quota; the
``PrefixIndex`` pools those slots like any tier's (eviction by reuse count, aged, then LRU)
and is the one place that says which slot holds which block. This tier never sees a slot:
it stores, reads and deletes records by block key, the record's name. Whoever takes a
disk slot from the index deletes the records of the blocks evicted to make room, and
whoever drops a block from the index deletes its record (the mover's disk journal,
``jaxkv.journal``, and ``TierMover.drop_failed``). A record another process deleted is a
miss when read (``Failure.GONE``: its index entry is dropped), never an error. The store
therefore holds at most the sum of its users' quotas, plus records left by processes that
stopped (adopted by the next one that opens the store, up to its quota).

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
from jaxkv.tiers.base import Failure, Fetch, FetchOutcome
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


@dataclasses.dataclass(frozen=True)
class PendingRead:
  """A read in flight: the record of block ``key`` (``future``: its tensorstore read)."""

  key: bytes
  future: object
  started: float  # time.monotonic() when it was issued


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
    self._read_errors: dict[bytes, int] = {}  # block key -> reads in a row that raised
    self._deletes: dict[str, object] = {}  # name -> deletion in flight (kept: a dropped
    # TensorStore future may cancel its operation)

  # ---- names -------------------------------------------------------------------------------
  @property
  def prefix(self) -> str:
    """Where this fingerprint's records are (relative to ``<kvstore>/records/``)."""
    return self.fingerprint[:16].hex() + "/"

  def name(self, key: bytes) -> str:
    """The record of block ``key`` (relative to ``<kvstore>/records/``)."""
    return self.prefix + key.hex()

  @property
  def prefix_path(self) -> str:
    """The directory of this fingerprint's records (file driver)."""
    return os.path.join(self.kvstore["path"], RECORDS_PATH, self.prefix)

  def path_of(self, key: bytes) -> str:
    """The file of block ``key``'s record (file driver)."""
    return os.path.join(self.kvstore["path"], RECORDS_PATH, self.name(key))

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
    """Verifies the stored records of this fingerprint and offers up to ``num_slots`` of
    the verified ones for this process's quota, in name order (so every process of a job
    offers the same). Returns ``([(slot, key, parent), ...], deleted)``: slots numbered
    from 0 in that order, for the caller to publish in the index (which then owns them).

    Records that do not verify are deleted; verified ones beyond the quota are left to the
    processes that hold them.
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
        good.append((len(good), key, parent))
    return good, deleted

  # ---- I/O ---------------------------------------------------------------------------------
  def write(self, key: bytes, payload: np.ndarray, parent: bytes | None):
    """Starts writing block ``key``'s record; returns the commit's future. Publish the
    block only once that future has succeeded and ``sync`` has run."""
    record = blocks.encode(payload, key, self.fingerprint, parent)
    name = self.name(key)
    deleting = self._deletes.pop(name, None)
    if deleting is not None:  # a deletion of this very record in flight: let it land first
      _wait(deleting, 30.0)
    self._read_errors.pop(key, None)  # a new record
    try:
      return self.kv.write(name, record.tobytes())
    except Exception as e:  # pylint: disable=broad-except  (surface as a failed future)
      return _failed(e)

  def sync(self) -> None:
    """Makes every committed write durable (local files: one ``syncfs``; an object store's
    writes are durable when they commit)."""
    if self.local:
      _syncfs(os.path.join(self.kvstore["path"], RECORDS_PATH))

  def read(self, key: bytes) -> PendingRead:
    """Starts reading block ``key``'s record."""
    try:
      fut = self.kv.read(self.name(key))
    except Exception as e:  # pylint: disable=broad-except
      fut = _failed(e)
    return PendingRead(key, fut, time.monotonic())

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
  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, list[tuple[Fetch, PendingRead]]]:
    """Puts every read in flight at once."""
    return None, [(f, self.read(f.key)) for f in fetches]

  def finish_fetch(self, pending: list[tuple[Fetch, PendingRead]], t_end: float,
                   stage) -> FetchOutcome:
    """Waits for each read until ``t_end`` at the latest and verifies its record."""
    staged, failures = [], []
    for f, r in pending:
      failure = None
      try:
        staged.append((f.shard, f.page, self.verify(self._record(r, t_end), r.key)))
        self._read_errors.pop(r.key, None)
      except TimeoutError:
        failure = Failure.DEADLINE
        r.future.cancel()
      except Exception as e:  # pylint: disable=broad-except  (any failed read is a miss)
        failure = Failure.of(e, self._read_error(r.key, e))
      failures.append(failure)
    return FetchOutcome(stage(staged) if staged else None, tuple(failures))

  def _read_error(self, key: bytes, error: BaseException) -> Failure:
    """The store raised reading ``key``'s record. When it says the bytes are wrong
    (TensorStore's DATA_LOSS and kin), that is a corrupt record. Anything else (I/O,
    unavailable) is taken as transient the first time: the record is kept and read again
    next time; given up on when the next read raises too."""
    if str(error).startswith(_DAMAGE):
      self._read_errors.pop(key, None)
      return Failure.READ_ERROR
    n = self._read_errors[key] = self._read_errors.get(key, 0) + 1
    if n < READ_ATTEMPTS:
      return Failure.READ_RETRY
    del self._read_errors[key]
    return Failure.READ_ERROR

  def read_verified(self, keys: list[bytes], t_end: float) -> list[np.ndarray]:
    """Reads and verifies records (all in flight at once) until ``t_end`` at the latest;
    raises the first failure (``TimeoutError``, ``Gone`` or ``blocks.BlockError``)."""
    reads = [self.read(k) for k in keys]
    return [self.verify(self._record(r, t_end), r.key) for r in reads]

  def delete(self, key: bytes) -> None:
    """Removes block ``key``'s record (best effort: absent already, or unreachable, is
    fine). The index forgot the block, or never published it."""
    self._read_errors.pop(key, None)
    self._delete_name(self.name(key))

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
