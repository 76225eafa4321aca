"""DISK tier: every block is one record, named by its key, in any TensorStore kvstore.

A record lives at ``<kvstore>/records/<fingerprint>.v<format>.<key id>/<block key>`` (hex;
the fingerprint's first 16 bytes, the record format ``blocks.FORMAT_VERSION``, and
``security.key_id`` of the deployment key, ``none`` without one). Any kvstore works
unchanged: ``file`` (the default for a path), ``memory`` (tests), ``s3`` (tested against
an S3-compatible server on loopback) and ``gcs`` through the same calls.

Why content-addressed (BUILD.md, "Sharing a store"): a record's name says which block it
holds, so any number of caches, processes and jobs can share one store. Two writers of one
block write the same bytes under the same name (an idempotent overwrite; the file driver
writes a temporary and renames it, an object store replaces the object whole), so nothing
ever clashes, and a reader verifies what it reads as before. Records of another model or
layout, of another record format, or written under another deployment key sit under
another prefix and are never read nor touched: a rollout that mixes jaxkv versions or keys
does not erase itself, and different keys share nothing.

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

Every record carries jaxkv's own header and proof (``blocks``): with a deployment key a
keyed tag, so a record planted by whoever can write the store does not verify, and with
``encrypt`` the payload sealed (AES-GCM) so the store holds no plaintext KV; without a key
a CRC-32C, which catches accidents only. A record that does not verify is deleted and
counted. A slot being written or read is pinned so eviction cannot take it meanwhile; a
block is published in the index only after its write committed and, on a local file
system, after the batch it was part of was flushed to the device (one ``syncfs`` per
batch, not an fsync per record: each record is a complete file or absent after a crash,
and adoption verifies it anyway).

On open, temporaries a killed writer left are deleted (never a live writer's: see
``_remove_if_unlocked``), and ``scan`` streams over this prefix's records with a bounded
window of reads (``SCAN_WINDOW``, ``SCAN_WINDOW_BYTES``), so memory stays bounded whatever
the store holds: a record whose size is wrong is judged without reading it whole (the file
driver's ``stat``; an object store's reads are cut at the record's size). Verified records
are offered back to the index up to the quota; ones that do not verify are deleted; ones
of another format version (and ones unreadable right now) are left alone. Every record not
adopted is counted by reason (``discarded``, ``Engine.stats()``
``disk_discarded_at_open_by_reason``).

Local stores are private: the directories jaxkv creates (the store's root, ``records/``,
each prefix) are made mode 0700. TensorStore's file driver creates record files per the
umask (0644 under the usual 022) and takes no mode per file, so the 0700 prefix directory
is what keeps other users from them; directories that already exist keep their modes (a
store shared by several users is the operator's to set up). A keyless tier that is an
object store, or a local one whose directories give group or others access, says so once
(``security.warn_insecure``).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import fcntl
import functools
import os
import stat
import time

import numpy as np
import tensorstore as ts
from absl import logging

from jaxkv import security
from jaxkv.index import Tier
from jaxkv.tiers import blocks
from jaxkv.tiers.base import Failure, Fetch, FetchOutcome
from jaxkv.errors import InputError

RECORDS_PATH = "records/"
READ_ATTEMPTS = 2  # reads of one record that raise before it is given up (deleted)
SCAN_WINDOW = 32  # records in flight at once while a store is opened (``scan``) ...
SCAN_WINDOW_BYTES = 64 << 20  # ... and at most this many of their bytes
# Why ``scan`` may pass a record over and leave it in place: another format's (a newer or
# older jaxkv sharing the store), or not readable now.
_KEPT_AT_OPEN = frozenset({Failure.VERSION, Failure.READ_RETRY, Failure.DEADLINE})
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


def _where(spec: dict) -> str:
  """A store's place for messages (driver, bucket, path: never credentials a spec holds)."""
  bucket = spec.get("bucket")
  return f"{spec['driver']}://{bucket + '/' if bucket else ''}{spec.get('path', '')}"


@dataclasses.dataclass(frozen=True)
class _ScanRead:
  """A read ``scan`` has in flight: the whole record ``name`` (cut at the record size), or
  only its first ``blocks.PEEK_BYTES`` (its size is wrong: is it another format's?)."""

  name: str
  whole: bool
  future: object


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
               fingerprint: bytes, key: bytes | None = None, encrypt: bool = False):
    """``key``: the deployment key (records carry a keyed tag; None: a CRC-32C only);
    ``encrypt``: records are sealed under it (the store holds no plaintext KV)."""
    if encrypt and key is None:
      raise InputError("DiskTier(encrypt=True) needs the deployment key (key=...): records "
                       "are encrypted under it.")
    self.kvstore = kvstore_spec(location)
    self.num_slots = int(num_slots)
    self.payload_shape = tuple(payload_shape)
    self.dtype = dtype
    self.fingerprint = fingerprint
    self.encrypt = bool(encrypt)
    self.key_id = security.key_id(key)
    self._key = key  # for ``scratch`` only: never shown
    self._seal = None if key is None else security.Seal(key, "disk-record")
    self.record_bytes = blocks.record_bytes(payload_shape, dtype)
    self.local = self.kvstore["driver"] == "file"
    self.discarded: collections.Counter = collections.Counter()  # the last ``scan``'s
    self._check_writable()
    self._warn_if_exposed()
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
    self._prefix_made = None  # the prefix whose directory exists (file driver)
    self._read_errors: dict[bytes, int] = {}  # block key -> reads in a row that raised
    self._deletes: dict[str, object] = {}  # name -> deletion in flight (kept: a dropped
    # TensorStore future may cancel its operation)
    self._prune_at = 64

  # ---- names -------------------------------------------------------------------------------
  @property
  def prefix(self) -> str:
    """Where this fingerprint's records of this format and key are (relative to
    ``<kvstore>/records/``). A property: the fingerprint is set once the model is known."""
    return f"{self.fingerprint[:16].hex()}.v{blocks.FORMAT_VERSION}.{self.key_id}/"

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

  def scratch(self, fingerprint: bytes, num_slots: int) -> "DiskTier":
    """A tier on the same store with this one's key and protection under another
    ``fingerprint`` (records this tier never sees: calibration's, which then cost what
    this tier's records cost)."""
    return DiskTier(self.kvstore, num_slots=num_slots, payload_shape=self.payload_shape,
                    dtype=self.dtype, fingerprint=fingerprint, key=self._key,
                    encrypt=self.encrypt)

  # ---- opening ---------------------------------------------------------------------------
  def _check_writable(self) -> None:
    if not self.local:
      return
    path = self.kvstore["path"]
    try:
      security.make_private_dir(path)
      security.make_private_dir(os.path.join(path, RECORDS_PATH))
    except OSError as e:
      raise InputError(f"disk tier directory {path!r} cannot be created ({e.strerror}); "
                       "point disk_kvstore at a writable directory.") from None
    if not os.access(path, os.W_OK | os.X_OK):
      raise InputError(f"disk tier directory {path!r} is not writable; point disk_kvstore at "
                       "a writable directory.")

  def _ensure_prefix(self) -> None:
    """Makes this prefix's directory (0700) before TensorStore would make it per the umask."""
    if self.local and self._prefix_made != self.prefix:
      security.make_private_dir(self.prefix_path)
      self._prefix_made = self.prefix

  def _warn_if_exposed(self) -> None:
    """Without a key a record proves nothing against whoever can write the store, and holds
    plaintext KV (the prompts) for whoever can read it: say so once if others can reach it."""
    if self._seal is not None or self.kvstore["driver"] == "memory":
      return  # keyed (a key without encryption is warned about by the cache), or in-process
    if not self.local:
      security.warn_insecure(
          f"the disk tier at {_where(self.kvstore)} is an object store and there is no "
          "deployment key: whoever can write the bucket can plant records served as KV, and "
          "whoever can read it reads the prompts' KV",
          "set a deployment key (--deployment_key_file or $JAXKV_DEPLOYMENT_KEY_FILE)")
      return
    for path in (self.kvstore["path"], os.path.join(self.kvstore["path"], RECORDS_PATH)):
      mode = stat.S_IMODE(os.stat(path).st_mode)
      if mode & (stat.S_IRWXG | stat.S_IRWXO):
        path = path.rstrip("/")
        security.warn_insecure(
            f"disk tier directory {path} has mode {mode:04o} and there is no deployment key: "
            "other users can read its records (the prompts' KV) or plant forged ones",
            f"run `chmod 700 {path}` or set a deployment key")
        return

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
    """Verifies the stored records of this prefix and offers up to ``num_slots`` of the
    verified ones for this process's quota, in name order (so every process of a job
    offers the same). Returns ``([(slot, key, parent), ...], deleted)``: slots numbered
    from 0 in that order, for the caller to publish in the index (which then owns them).

    Reads stream, at most ``SCAN_WINDOW`` records (``SCAN_WINDOW_BYTES``) in flight, each
    cut at the record size: memory is bounded by the window, not by what the store holds.
    Records that do not verify are deleted; records of another format version, and ones
    unreadable now, are left in place; verified ones beyond the quota are left to the
    processes that hold them. ``discarded`` counts, by reason (``Failure`` values), every
    record not adopted but those beyond the quota.
    """
    self._ensure_prefix()
    self._note_older_format()
    t_end = time.monotonic() + deadline_s
    listing = self.kv.list(ts.KvStore.KeyRange(self.prefix, self.prefix[:-1] + "0"))
    try:
      names = sorted(k.decode("ascii", "replace") for k in listing.result(timeout=deadline_s))
    except TimeoutError:
      logging.warning("disk tier %s: listing the records did not finish in %.0f s; none "
                      "adopted this time", _where(self.kvstore), deadline_s)
      listing.cancel()
      self.discarded = collections.Counter()
      return [], 0
    window = max(1, min(SCAN_WINDOW, SCAN_WINDOW_BYTES // self.record_bytes))
    todo = collections.deque(n for n in names if not n.endswith(".__lock"))
    reads: collections.deque[_ScanRead] = collections.deque()
    good, deleted, discarded = [], 0, collections.Counter()
    while todo or reads:
      while todo and len(reads) < window:
        name = todo.popleft()
        read = self._start_scan_read(name)
        if isinstance(read, Failure):
          discarded[read.value] += 1
          deleted += self._discard(name, read)
        elif read is not None:
          reads.append(read)
      if not reads:
        continue
      read = reads.popleft()
      verdict = self._judge_scan_read(read, t_end)
      if isinstance(verdict, _ScanRead):  # cut short: read its header
        reads.append(verdict)
      elif isinstance(verdict, Failure):
        discarded[verdict.value] += 1
        deleted += self._discard(read.name, verdict)
      elif verdict is not None and len(good) < self.num_slots:
        good.append((len(good), *verdict))
    self.discarded = discarded
    if discarded:
      logging.info("disk tier %s: %d records not adopted at open (%s); %d deleted, the others "
                   "(another format version, unreadable now) left in place", _where(self.kvstore),
                   sum(discarded.values()), ", ".join(f"{r}: {n}" for r, n in
                                                      sorted(discarded.items())), deleted)
    return good, deleted

  def _start_scan_read(self, name: str):
    """How ``scan`` reads record ``name`` (a ``_ScanRead``), or its verdict without a read
    (a ``Failure``; None: vanished meanwhile). A file whose size is wrong is judged by its
    first ``PEEK_BYTES`` (its format) alone; a whole read is cut at the record size, so a
    huge object costs no more than a record."""
    if self.local:
      try:
        size = os.stat(os.path.join(self.kvstore["path"], RECORDS_PATH, name)).st_size
      except FileNotFoundError:
        return None  # its owner removed it meanwhile
      except OSError:
        return Failure.READ_RETRY
      if size != self.record_bytes:
        if size < blocks.PEEK_BYTES:
          return Failure.SIZE
        return _ScanRead(name, False, self._read_range(name, blocks.PEEK_BYTES))
    return _ScanRead(name, True, self._read_range(name, self.record_bytes))

  def _read_range(self, name: str, nbytes: int):
    try:
      return self.kv.read(name, byte_range=slice(0, nbytes))
    except Exception as e:  # pylint: disable=broad-except
      return _failed(e)

  def _judge_scan_read(self, read: _ScanRead, t_end: float):
    """A scan read's verdict: ``(key, parent)`` verified, a ``Failure``, None (vanished), or
    a header read to issue (a ``_ScanRead``: the store had fewer bytes than a record)."""
    try:
      got = read.future.result(timeout=max(0.0, t_end - time.monotonic()))
    except TimeoutError:
      read.future.cancel()
      return Failure.DEADLINE
    except Exception as e:  # pylint: disable=broad-except
      if str(e).startswith("OUT_OF_RANGE"):  # shorter than asked for
        if read.whole:
          return _ScanRead(read.name, False, self._read_range(read.name, blocks.PEEK_BYTES))
        return Failure.SIZE
      return Failure.READ_RETRY  # unreadable now: left for a later open
    if got.state != "value":
      return None  # removed meanwhile by its owner
    if not read.whole:  # the size is wrong; a record of another format may have another size
      version = blocks.peek_version(got.value)
      return (Failure.VERSION if version is not None and version != blocks.FORMAT_VERSION
              else Failure.SIZE)
    record = np.frombuffer(got.value, np.uint8)
    try:
      self._decode(record, None)
      key, parent = blocks.header_keys(record)
      if read.name != self.name(key):
        raise blocks.BlockError("key", f"record {read.name} holds block {key.hex()}")
    except blocks.BlockError as e:
      return e.reason
    return key, parent

  def _discard(self, name: str, reason: Failure) -> int:
    """Deletes a record ``scan`` refused, unless ``reason`` says to leave it; returns 1 if
    it was deleted."""
    if reason in _KEPT_AT_OPEN:
      return 0
    self._delete_name(name)
    return 1

  def _note_older_format(self) -> None:
    """Says once if format-2 records of this fingerprint are still in the store (not read,
    never deleted: their jaxkv may still be running)."""
    if not self.local:
      return
    old = os.path.join(self.kvstore["path"], RECORDS_PATH, self.fingerprint[:16].hex())
    if os.path.isdir(old):
      logging.info("disk tier %s holds records of an older jaxkv (format 2) under %s: they "
                   "are not read; delete that directory once no older process uses the "
                   "store.", self.kvstore["path"], old)

  # ---- I/O ---------------------------------------------------------------------------------
  def write(self, key: bytes, payload: np.ndarray, parent: bytes | None):
    """Starts writing block ``key``'s record; returns the commit's future. Publish the
    block only once that future has succeeded and ``sync`` has run."""
    record = self.record(key, payload, parent)
    name = self.name(key)
    deleting = self._deletes.pop(name, None)
    if deleting is not None:  # a deletion of this very record in flight: let it land first
      _wait(deleting, 30.0)
    self._read_errors.pop(key, None)  # a new record
    try:
      self._ensure_prefix()
      return self.kv.write(name, record.tobytes())
    except Exception as e:  # pylint: disable=broad-except  (surface as a failed future)
      return _failed(e)

  def record(self, key: bytes, payload: np.ndarray, parent: bytes | None) -> np.ndarray:
    """The record this tier stores for block ``key`` (its protection: this tier's key and
    ``encrypt``)."""
    return blocks.encode(payload, key, self.fingerprint, parent, seal=self._seal,
                         encrypt=self.encrypt)

  def sync(self) -> None:
    """Makes every committed write durable (local files: one ``syncfs``; an object store's
    writes are durable when they commit)."""
    if self.local:
      _syncfs(os.path.join(self.kvstore["path"], RECORDS_PATH))

  def read(self, key: bytes) -> PendingRead:
    """Starts reading block ``key``'s record."""
    try:
      # Cut at a record's size: a longer object is never read whole (what follows a record
      # is not looked at; a shorter one is refused by the store: ``_record``).
      fut = self.kv.read(self.name(key), byte_range=slice(0, self.record_bytes))
    except Exception as e:  # pylint: disable=broad-except
      fut = _failed(e)
    return PendingRead(key, fut, time.monotonic())

  def _record(self, pending: PendingRead, t_end: float) -> np.ndarray:
    """The bytes of a read (raises ``TimeoutError``, ``Gone`` or the store's error)."""
    try:
      got = pending.future.result(timeout=max(0.0, t_end - time.monotonic()))
    except ValueError as e:
      if str(e).startswith("OUT_OF_RANGE"):  # fewer bytes than the range cut at a record
        raise blocks.BlockError("size", f"record of block {pending.key.hex()[:16]} is shorter "
                                f"than {self.record_bytes} bytes") from None
      raise
    if got.state != "value":
      raise Gone(f"no record for block {pending.key.hex()[:16]}")
    return np.frombuffer(got.value, np.uint8)

  def verify(self, record, key: bytes) -> np.ndarray:
    """Payload of a record read for block ``key`` (raises ``blocks.BlockError``)."""
    return self._decode(record, key)

  def _decode(self, record, key: bytes | None) -> np.ndarray:
    return blocks.decode(record, key=key, fingerprint=self.fingerprint, dtype=self.dtype,
                         shape=self.payload_shape, seal=self._seal)

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
    if len(self._deletes) >= self._prune_at:  # forget finished ones (amortized: a scan
      self._deletes = {n: d for n, d in self._deletes.items() if not d.done()}  # deletes many)
      self._prune_at = max(64, 2 * len(self._deletes))
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
