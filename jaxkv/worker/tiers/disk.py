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
``jaxkv.worker.journal``, and ``TierMover.drop_failed``). A record another process deleted is a
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
``localdir``), and ``scan`` streams over this prefix's records with a bounded
window of reads (``SCAN_WINDOW``, ``SCAN_WINDOW_BYTES``), so memory stays bounded whatever
the store holds: a record whose size is wrong is judged without reading it whole (a local
file's size is known before it is read; an object store's reads are cut at the record's
size). Verified records are offered back to the index up to the quota (the first in name
order, kept in a heap of the quota's size); ones that do not verify are deleted; ones of
another format version (and ones unreadable right now) are left alone. Every record not
adopted is counted by reason (``discarded``, ``Engine.stats()``
``disk_discarded_at_open_by_reason``). A local directory is listed as it is read
(``os.scandir``: no listing is held); an object store's is listed in 16 ranges, by the first
hex digit of the name (TensorStore's ``list`` returns a range whole: memory is bounded by
the largest range, which for block keys is a sixteenth of the prefix).

Local stores are private: the directories jaxkv creates (the store's root, ``records/``,
each prefix) are made mode 0700. TensorStore's file driver creates record files per the
umask (0644 under the usual 022), so jaxkv writes local records itself, mode 0600
(``LocalDir.write_file``); directories that already exist keep their modes (a store shared
by several users is the operator's to set up). A keyless tier that is an
object store, or a local one whose directories give group or others access, says so once
(``security.warn_insecure``).

Nothing under a local store's root is followed (threat model: BUILD.md; whoever can write
the store can plant links, FIFOs, sockets): jaxkv reads and deletes local records itself,
not through TensorStore (whose file driver follows links and opens a FIFO blocking), through
``jaxkv.worker.tiers.localdir.LocalDir``, whose docstring says what it refuses and what remains. A
link, FIFO, socket, device or directory under a record's name is left in place and counted
(``not_a_file``, at open and when read). Object stores have no links.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import heapq
import os
import stat
import time

import numpy as np
import tensorstore as ts
from absl import logging

from jaxkv import security
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers import blocks
from jaxkv.worker.tiers.base import Failure, Fetch, FetchOutcome
from jaxkv.worker.tiers.localdir import (RECORDS_PATH, LocalDir, NotAFile, file_pool, identity,
                                  pread, unlink_regular)
from jaxkv.errors import InputError

READ_ATTEMPTS = 2  # reads of one record that raise before it is given up (deleted)
SCAN_WINDOW = 32  # records in flight at once while a store is opened (``scan``) ...
SCAN_WINDOW_BYTES = 64 << 20  # ... and at most this many of their bytes
LIST_RANGES = "0123456789abcdef"  # an object store's prefix is listed one range per digit
NOT_A_FILE = "not_a_file"  # ``scan``'s reason for a name that is no regular file (kept)
# Why ``scan`` may pass a record over and leave it in place: another format's (a newer or
# older jaxkv sharing the store), or not readable now.
_KEPT_AT_OPEN = frozenset({Failure.VERSION, Failure.READ_RETRY, Failure.DEADLINE})
# TensorStore error codes that mean the stored bytes are wrong, not that reading failed.
_DAMAGE = ("DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")
# An object store's retries of one request, unless the spec's context sets its own.
# TensorStore's defaults (32 retries, backing off to 32 s) outlast any read deadline: a
# store that is gone (a refused connection) cost every request its whole deadline, and
# the reads ended as timeouts rather than as the store's errors, which the disk tier's
# breaker counts. Bounded, a refused read fails in well under a second; a store that
# answers slowly still gets three more tries.
OBJECT_STORE_RETRIES = {"max_retries": 3, "initial_delay": "50ms", "max_delay": "500ms"}


class Gone(Exception):
  """The record is not in the store (another process evicted it)."""

  reason = Failure.GONE


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


def with_bounded_retries(spec: dict) -> dict:
  """``spec`` with ``OBJECT_STORE_RETRIES`` in its context for an object store's driver
  (``s3``, ``gcs``) whose spec sets no retries of its own (copied; other drivers as given)."""
  resource = {"s3": "s3_request_retries", "gcs": "gcs_request_retries"}.get(spec["driver"])
  context = spec.get("context") or {}
  if resource is None or resource in context:
    return spec
  return dict(spec, context={**context, resource: dict(OBJECT_STORE_RETRIES)})


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
class _Got:
  """A local read's result, shaped as TensorStore's (``state`` "value" or "missing")."""

  state: str
  value: bytes = b""


class _Adoption:
  """What ``scan`` found so far: the ``num_slots`` verified records first in name order (a
  heap of that size: memory is the quota's, not the store's), the records deleted and the
  reasons others were not adopted."""

  def __init__(self, num_slots: int):
    self.num_slots = num_slots
    self.heap: list[tuple[int, bytes, bytes | None]] = []  # (-key as a number, key, parent)
    self.deleted = 0
    self.discarded: collections.Counter = collections.Counter()

  def offer(self, key: bytes, parent: bytes | None) -> None:
    # A verified record's name is its key in hex, so key order is name order.
    item = (-int.from_bytes(key, "big"), key, parent)
    if len(self.heap) < self.num_slots:
      heapq.heappush(self.heap, item)
    elif self.heap and item[0] > self.heap[0][0]:
      heapq.heapreplace(self.heap, item)

  def good(self) -> list[tuple[int, bytes, bytes | None]]:
    ordered = sorted(self.heap, key=lambda item: item[1])
    return [(slot, key, parent) for slot, (_, key, parent) in enumerate(ordered)]


@dataclasses.dataclass(frozen=True)
class PendingRead:
  """A read in flight: the record of block ``key`` (``future``: its tensorstore read)."""

  key: bytes
  future: object
  started: float  # time.monotonic() when it was issued
  # ``time.perf_counter()`` when the read ended, set by the future's done callback: a read
  # that ended while the caller computed (a split's front) is timed to then, not to the wait.
  ended: list = dataclasses.field(default_factory=list, compare=False)

  def __post_init__(self):
    callback = getattr(self.future, "add_done_callback", None)
    if callback is not None:
      callback(lambda _: self.ended.append(time.perf_counter()))


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
               fingerprint: bytes, key: bytes | None = None, encrypt: bool = False,
               clean: bool = True):
    """``key``: the deployment key (records carry a keyed tag; None: a CRC-32C only);
    ``encrypt``: records are sealed under it (the store holds no plaintext KV); ``clean``:
    delete the temporaries killed writers left (False: a tier on a store another tier of
    this process just opened, which did)."""
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
    self._root = (self.kvstore.get("path", "").rstrip("/") or "/") if self.local else None
    self._dirs = LocalDir(self._root) if self.local else None  # every local file access
    self.discarded: collections.Counter = collections.Counter()  # the last ``scan``'s
    self._check_writable()
    self._warn_if_exposed()
    self.removed_temporaries = self._dirs.remove_temporaries() if self.local and clean else 0
    spec = dict(self.kvstore)
    spec["path"] = spec.get("path", "") + RECORDS_PATH
    if self.local:
      spec["file_io_sync"] = False  # flushed once per batch (``sync``)
    spec = with_bounded_retries(spec)
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
    self._prune_at = 64

  def bind_fingerprint(self, fingerprint: bytes) -> None:
    """The fingerprint records are written, named and verified under (set once the model
    is known, before any record is read or written)."""
    self.fingerprint = fingerprint

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

  def scratch(self, fingerprint: bytes, num_slots: int,
              payload_shape: tuple | None = None) -> "DiskTier":
    """A tier on the same store with this one's key and protection under another
    ``fingerprint`` (records this tier never sees: calibration's, which then cost what
    this tier's records cost; a window group's, of ``payload_shape``). The store's
    temporaries are this tier's to clean: the scratch tier does not walk it again."""
    return DiskTier(self.kvstore, num_slots=num_slots,
                    payload_shape=payload_shape or self.payload_shape, dtype=self.dtype,
                    fingerprint=fingerprint, key=self._key, encrypt=self.encrypt, clean=False)

  # ---- opening ---------------------------------------------------------------------------
  def _check_writable(self) -> None:
    if not self.local:
      return
    path = self._root
    try:
      security.make_private_dir(path, fix=self._dirs.root_fix)
      os.close(self._dirs.open_dir(None, create=True))
    except OSError as e:
      raise InputError(f"disk tier directory {path!r} cannot be created ({e.strerror}); "
                       "point disk_kvstore at a writable directory.") from None
    if not os.access(path, os.W_OK | os.X_OK):
      raise InputError(f"disk tier directory {path!r} is not writable; point disk_kvstore at "
                       "a writable directory.")

  def _ensure_prefix(self) -> None:
    """Makes this prefix's directory (0700) at open; refuses one that is (or is reached
    through) a link (``LocalDir.ensure_prefix``)."""
    if self.local:
      self._dirs.ensure_prefix(self.prefix)

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
    for path in (self._root, os.path.join(self._root, RECORDS_PATH.rstrip("/"))):
      mode = stat.S_IMODE(os.lstat(path).st_mode)  # checked: directories, not links
      if mode & (stat.S_IRWXG | stat.S_IRWXO):
        path = path.rstrip("/")
        security.warn_insecure(
            f"disk tier directory {path} has mode {mode:04o} and there is no deployment key: "
            "other users can read its records (the prompts' KV) or plant forged ones",
            f"run `chmod 700 {path}` or set a deployment key")
        return

  def scan(self, deadline_s: float = 600.0) -> tuple[list[tuple[int, bytes, bytes | None]], int]:
    """Verifies the stored records of this prefix and offers up to ``num_slots`` of the
    verified ones for this process's quota: the first in name order (so every process of
    a job offers the same). Returns ``([(slot, key, parent), ...], deleted)``: slots
    numbered from 0 in that order, for the caller to publish in the index (which then owns
    them).

    Names and reads stream, at most ``SCAN_WINDOW`` records (``SCAN_WINDOW_BYTES``) in
    flight, each cut at the record size: memory is bounded by the window and the quota, not
    by what the store holds. Records that do not verify are deleted; records of another
    format version, and ones unreadable now, are left in place; verified ones beyond the
    quota are left to the processes that hold them; a local name that is no regular file
    is left and counted (``NOT_A_FILE``). ``discarded`` counts, by reason (``Failure``
    values), every record not adopted but those beyond the quota. What is not judged by
    ``deadline_s`` is left for a later open.
    """
    self._ensure_prefix()
    self._note_older_format()
    t_end = time.monotonic() + deadline_s
    window = max(1, min(SCAN_WINDOW, SCAN_WINDOW_BYTES // self.record_bytes))
    found = _Adoption(self.num_slots)
    opening = _Opening(self, found, window, t_end)
    if self.local:
      opening.local(self._dirs)
    else:
      opening.listed()
    self.discarded = found.discarded
    if found.discarded:
      logging.info("disk tier %s: %d records not adopted at open (%s); %d deleted, the others "
                   "(another format version, unreadable now, not a file) left in place",
                   _where(self.kvstore), sum(found.discarded.values()),
                   ", ".join(f"{r}: {n}" for r, n in sorted(found.discarded.items())),
                   found.deleted)
    return found.good(), found.deleted

  def _verdict(self, name: str, whole: bool, data: bytes):
    """Record ``name``'s verdict from its bytes: ``(key, parent)`` verified, or a
    ``Failure``. ``whole``: ``data`` is a record's worth; else its size is wrong and
    ``data`` is its header (a record of another format may have another size)."""
    if not whole:
      version = blocks.peek_version(data) if len(data) >= blocks.PEEK_BYTES else None
      return (Failure.VERSION if version is not None and version != blocks.FORMAT_VERSION
              else Failure.SIZE)
    record = np.frombuffer(data, np.uint8)
    try:
      self._decode(record, None)
      key, parent = blocks.header_keys(record)
      if name != self.name(key):
        raise blocks.BlockError("key", f"record {name} holds block {key.hex()}")
    except blocks.BlockError as e:
      return e.reason
    return key, parent

  def _note_older_format(self) -> None:
    """Says once if format-2 records of this fingerprint are still in the store (not read,
    never deleted: their jaxkv may still be running)."""
    if not self.local:
      return
    old = os.path.join(self._root, RECORDS_PATH, self.fingerprint[:16].hex())
    try:
      older = stat.S_ISDIR(os.lstat(old).st_mode)
    except OSError:
      older = False
    if older:
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
    if self.local:  # jaxkv's own writer: mode 0600, nothing followed (``LocalDir.write_file``)
      return file_pool().submit(self._dirs.write_file, self.prefix, key.hex(), record.tobytes())
    try:
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
    """Starts reading block ``key``'s record (a local one in jaxkv's own threads, opened
    only if it is a regular file: ``_read_record``)."""
    if self.local:
      fut = file_pool().submit(self._read_record, self.prefix, key)
      return PendingRead(key, fut, time.monotonic())
    try:
      # Cut at a record's size: a longer object is never read whole (what follows a record
      # is not looked at; a shorter one is refused by the store: ``_record``).
      fut = self.kv.read(self.name(key), byte_range=slice(0, self.record_bytes))
    except Exception as e:  # pylint: disable=broad-except
      fut = _failed(e)
    return PendingRead(key, fut, time.monotonic())

  def _read_record(self, prefix: str, key: bytes) -> _Got:
    """Block ``key``'s local record, cut at a record's size (raises ``NotAFile``, or
    ``blocks.BlockError`` for a file shorter than a record)."""
    fd = self._dirs.open_record(prefix, key.hex())
    if fd is None:
      return _Got("missing")
    try:
      data = pread(fd, self.record_bytes)
    finally:
      os.close(fd)
    if len(data) < self.record_bytes:
      raise blocks.BlockError("size", f"record of block {key.hex()[:16]} is shorter than "
                              f"{self.record_bytes} bytes")
    return _Got("value", data)

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
    """Waits for each read until ``t_end`` at the latest and verifies its record; says when
    the last verified record's read ended (``FetchOutcome.arrived``)."""
    staged, failures = [], []
    arrived = None
    for f, r in pending:
      failure = None
      try:
        staged.append((f.shard, f.page, self.verify(self._record(r, t_end), r.key)))
        self._read_errors.pop(r.key, None)
        # (a callback not yet run when the result was: the bytes count from now)
        ended = r.ended[0] if r.ended else time.perf_counter()
        arrived = ended if arrived is None else max(arrived, ended)
      except TimeoutError:
        failure = Failure.DEADLINE
        r.future.cancel()
      except Exception as e:  # pylint: disable=broad-except  (any failed read is a miss)
        failure = Failure.of(e, self._read_error(r.key, e))
      failures.append(failure)
    return FetchOutcome(stage(staged) if staged else None, tuple(failures), arrived=arrived)

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
    """Starts deleting a record (best effort: absent already, or unreachable, is fine). A
    local one is removed only if it is a regular file (``LocalDir.delete``)."""
    if len(self._deletes) >= self._prune_at:  # forget finished ones (amortized: a scan
      self._deletes = {n: d for n, d in self._deletes.items() if not d.done()}  # deletes many)
      self._prune_at = max(64, 2 * len(self._deletes))
    if self.local:
      self._deletes[name] = self._dirs.delete(name)
      return
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
    """Bytes the store's regular files hold (file driver; 0 otherwise). No link is
    followed."""
    return self._dirs.bytes_on_disk() if self.local else 0


class _Opening:
  """One ``DiskTier.scan``: the records judged so far (``found``), at most ``window`` reads
  in flight, until ``t_end`` (``time.monotonic``)."""

  def __init__(self, tier: "DiskTier", found: _Adoption, window: int, t_end: float):
    self.tier, self.found, self.window, self.t_end = tier, found, window, t_end

  def out_of_time(self, what: str) -> bool:
    if time.monotonic() < self.t_end:
      return False
    logging.warning("disk tier %s: %s did not finish before the deadline; the records not "
                    "judged yet are left for a later open", _where(self.tier.kvstore), what)
    return True

  def local(self, dirs: LocalDir) -> None:
    """``scan`` of a local directory: listed as it is read (``os.scandir``), each name
    judged by its ``lstat`` first (a link, FIFO, socket, device or directory is counted
    and left; a file too small for a header is junk), then read in a pool thread with
    ``LocalDir.read_file``, and deleted (if junk) only if it still is the very file judged."""
    tier, found = self.tier, self.found
    prefix = tier.prefix
    reads: collections.deque = collections.deque()  # (name, future of a FileRead)
    with dirs.dir(prefix) as dir_fd, os.scandir(dir_fd) as entries:
      for entry in entries:
        if self.out_of_time("listing the records"):
          break
        name = entry.name
        if name.endswith(".__lock"):
          continue
        try:
          if not entry.is_file(follow_symlinks=False):
            found.discarded[NOT_A_FILE] += 1
            continue
          st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
          continue  # its owner removed it meanwhile
        if st.st_size < blocks.PEEK_BYTES:
          self._discard_file(dir_fd, name, Failure.SIZE, identity(st))
          continue
        reads.append((name, file_pool().submit(dirs.read_file, prefix, name,
                                               tier.record_bytes)))
        while len(reads) >= self.window:
          self._judge_file(dir_fd, prefix, *reads.popleft())
      while reads:
        self._judge_file(dir_fd, prefix, *reads.popleft())

  def _judge_file(self, dir_fd: int, prefix: str, name: str, future) -> None:
    found, size = self.found, self.tier.record_bytes
    try:
      got = future.result(timeout=max(0.0, self.t_end - time.monotonic()))
    except TimeoutError:
      future.cancel()
      found.discarded[Failure.DEADLINE.value] += 1
      return
    except NotAFile:
      found.discarded[NOT_A_FILE] += 1
      return
    except OSError:
      found.discarded[Failure.READ_RETRY.value] += 1  # unreadable now: left for a later open
      return
    if got is None:
      return  # removed meanwhile by its owner
    whole = got.size == size and len(got.data) == size
    verdict = self.tier._verdict(prefix + name, whole, got.data)
    if isinstance(verdict, Failure):
      self._discard_file(dir_fd, name, verdict, got.identity)
    else:
      found.offer(*verdict)

  def _discard_file(self, dir_fd: int, name: str, reason: Failure,
                    identity: tuple[int, int]) -> None:
    """Counts a local record ``scan`` refused and deletes it unless ``reason`` says to
    leave it, and only if the name still is the file judged."""
    found = self.found
    found.discarded[reason.value] += 1
    if reason not in _KEPT_AT_OPEN:
      try:
        found.deleted += unlink_regular(dir_fd, name, identity)
      except OSError:  # not ours to delete (permissions): left, as an unreachable store's
        pass

  def listed(self) -> None:
    """``scan`` of an object store (any kvstore but a local directory): listed in ranges
    (``_names``), read through TensorStore, each read cut at the record size."""
    tier, found = self.tier, self.found
    reads: collections.deque[_ScanRead] = collections.deque()
    names = self._names()
    while True:
      while len(reads) < self.window:
        name = next(names, None)
        if name is None:
          break
        reads.append(_ScanRead(name, True, self._read_range(name, tier.record_bytes)))
      if not reads:
        return
      read = reads.popleft()
      verdict = self._judge_scan_read(read)
      if isinstance(verdict, _ScanRead):  # cut short: read its header
        reads.append(verdict)
      elif isinstance(verdict, Failure):
        found.discarded[verdict.value] += 1
        if verdict not in _KEPT_AT_OPEN:
          tier._delete_name(read.name)
          found.deleted += 1
      elif verdict is not None:
        found.offer(*verdict)

  def _names(self):
    """This prefix's names in an object store, in order, listed one range at a time (by
    the name's first hex digit; names that are not hex fall in the first or last range):
    TensorStore's ``list`` returns a range whole, so only one range is held at once."""
    prefix = self.tier.prefix
    bounds = [prefix] + [prefix + d for d in LIST_RANGES[1:]] + [prefix[:-1] + "0"]
    for lo, hi in zip(bounds, bounds[1:]):
      listing = self.tier.kv.list(ts.KvStore.KeyRange(lo, hi), strip_prefix_length=len(prefix))
      try:
        batch = listing.result(timeout=max(0.0, self.t_end - time.monotonic()))
      except TimeoutError:
        listing.cancel()
        self.out_of_time("listing the records")
        return
      batch.sort()
      for key in batch:
        name = key.decode("ascii", "replace")
        if not name.endswith(".__lock"):
          yield prefix + name
      del batch

  def _read_range(self, name: str, nbytes: int):
    try:
      return self.tier.kv.read(name, byte_range=slice(0, nbytes))
    except Exception as e:  # pylint: disable=broad-except
      return _failed(e)

  def _judge_scan_read(self, read: _ScanRead):
    """A scan read's verdict: ``(key, parent)`` verified, a ``Failure``, None (vanished), or
    a header read to issue (a ``_ScanRead``: the store had fewer bytes than a record)."""
    try:
      got = read.future.result(timeout=max(0.0, self.t_end - time.monotonic()))
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
    return self.tier._verdict(read.name, read.whole, got.value)


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
