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
umask (0644 under the usual 022) and takes no mode per file, so the 0700 prefix directory
is what keeps other users from them; directories that already exist keep their modes (a
store shared by several users is the operator's to set up). A keyless tier that is an
object store, or a local one whose directories give group or others access, says so once
(``security.warn_insecure``).

Nothing under a local store's root is followed (threat model: BUILD.md; whoever can write
the store can plant links, FIFOs, sockets). The root, ``records/`` and the prefix are opened
one from the other with ``O_NOFOLLOW`` before every read, delete and write, and a link at
any of them is refused (``InputError``: a link there would send reads and deletes to
whatever it points at). jaxkv reads and deletes local records itself, not through
TensorStore (whose file driver follows links and opens a FIFO blocking): a record is read
only if it is a regular file (``lstat``, then ``open(O_NOFOLLOW | O_NONBLOCK)`` and
``fstat``: a name swapped between the two checks is caught by the second, and a FIFO opened
non-blocking never blocks), and only a regular file is ever deleted (``unlink`` relative to
the checked directory, which removes a name, never what a link points to). A link, FIFO,
socket, device or directory under a record's name is left in place and counted
(``not_a_file`` at open; ``magic``, not a jaxkv record, when read). A hard link to someone's
file loses only its name here. What remains: writes go through TensorStore by path, so a
prefix swapped for a link between the check before a write and TensorStore's own open of
the name puts that one record in the linked directory (a file named by a block key; nothing
there is read or deleted); a name swapped for a device node between the ``lstat`` and the
open is opened (non-blocking, no controlling tty) before ``fstat`` refuses it (planting a
device node takes CAP_MKNOD); ``scan`` deletes a junk file only if the name still is the file
it judged, but a later delete of a dropped block's record removes whatever regular file has
its name then (a miss later, as any record another sharer evicted). Object stores have no
links.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import functools
import heapq
import os
import stat
import threading
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
LIST_RANGES = "0123456789abcdef"  # an object store's prefix is listed one range per digit
NOT_A_FILE = "not_a_file"  # ``scan``'s reason for a name that is no regular file (kept)
# Why ``scan`` may pass a record over and leave it in place: another format's (a newer or
# older jaxkv sharing the store), or not readable now.
_KEPT_AT_OPEN = frozenset({Failure.VERSION, Failure.READ_RETRY, Failure.DEADLINE})
# TensorStore error codes that mean the stored bytes are wrong, not that reading failed.
_DAMAGE = ("DATA_LOSS", "FAILED_PRECONDITION", "INVALID_ARGUMENT", "OUT_OF_RANGE")
# A local record is opened so that neither a link (ELOOP) nor a FIFO (no wait for a writer)
# nor a terminal (no controlling tty) can make the open follow, block or do anything else.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_TREE_DEPTH = 8  # ``bytes_on_disk`` looks no deeper (jaxkv's own tree is 3 deep)


class Gone(Exception):
  """The record is not in the store (another process evicted it)."""

  reason = Failure.GONE


class NotAFile(blocks.BlockError):
  """A record's name does not lead to a regular file in the store's own directory: a link,
  FIFO, socket, device or directory is there, or the prefix directory is a link. Never
  opened for reading, never deleted; read, it is a verification failure (``not_a_file``)."""

  def __init__(self, detail: str):
    super().__init__(Failure.NOT_A_FILE.value, detail)


def _kind(mode: int) -> str:
  for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                     (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                     (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
    if test(mode):
      return kind
  return f"of mode {mode:o}"


def _identity(st: os.stat_result) -> tuple[int, int]:
  return st.st_dev, st.st_ino


def _remove_if_unlocked(dir_fd: int, name: str) -> bool:
  """Removes the temporary ``name`` in directory ``dir_fd`` if it is a regular file no
  process holds a lock on (a POSIX record lock conflicts with a writer's
  open-file-description lock too). Returns whether it was removed."""
  try:
    fd = os.open(name, os.O_RDWR | (_FILE_FLAGS & ~os.O_ACCMODE), dir_fd=dir_fd)
  except OSError:
    return False  # gone (its writer finished it), a link, or not ours to open
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
      return False
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      return False  # held: a live writer's
    # While holding the lock, as the writers' protocol expects, and only if the name still
    # is this file (a writer that renamed it away may have made a new one under the name).
    return _unlink_regular(dir_fd, name, _identity(st))
  finally:
    os.close(fd)


def _remove_stale_temporaries(dir_fd: int) -> int:
  n = 0
  with os.scandir(dir_fd) as entries:
    for entry in entries:
      if (entry.name.endswith(".__lock") and entry.is_file(follow_symlinks=False)
          and _remove_if_unlocked(dir_fd, entry.name)):
        n += 1
  return n


def _unlink_regular(dir_fd: int, name: str, same_as: tuple[int, int] | None = None) -> bool:
  """Removes ``name`` in directory ``dir_fd`` if it is a regular file (and, given
  ``same_as``, that very file): never what a link points to, never a FIFO, socket, device
  or directory. Returns whether it was removed."""
  try:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode) or (same_as is not None and _identity(st) != same_as):
      return False
    os.unlink(name, dir_fd=dir_fd)
    return True
  except FileNotFoundError:
    return False


def _pread(fd: int, nbytes: int) -> bytes:
  """Up to ``nbytes`` from the start of ``fd`` (fewer at its end)."""
  chunks, got = [], 0
  while got < nbytes:
    chunk = os.pread(fd, nbytes - got, got)
    if not chunk:
      break
    chunks.append(chunk)
    got += len(chunk)
  return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _tree_bytes(dir_fd: int, depth: int) -> int:
  total = 0
  with os.scandir(dir_fd) as entries:
    for entry in entries:
      try:
        if entry.is_file(follow_symlinks=False):
          total += entry.stat(follow_symlinks=False).st_size
        elif entry.is_dir(follow_symlinks=False) and depth > 0:
          fd = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
          try:
            total += _tree_bytes(fd, depth - 1)
          finally:
            os.close(fd)
      except OSError:  # removed meanwhile by another process, or swapped for a link
        pass
  return total


@functools.lru_cache(maxsize=1)
def _file_pool() -> concurrent.futures.ThreadPoolExecutor:
  """Threads for local reads and deletes (jaxkv's, not TensorStore's: see the module
  docstring). A read here never blocks on what a record's name holds."""
  return concurrent.futures.ThreadPoolExecutor(thread_name_prefix="jaxkv-disk")


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
class _Got:
  """A local read's result, shaped as TensorStore's (``state`` "value" or "missing")."""

  state: str
  value: bytes = b""


@dataclasses.dataclass(frozen=True)
class _FileRead:
  """What a local scan read found: the file's ``size`` and identity, and its first bytes
  (a record's worth if its size is a record's, else ``blocks.PEEK_BYTES``)."""

  size: int
  identity: tuple[int, int]
  data: bytes


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
    self._root = (self.kvstore.get("path", "").rstrip("/") or "/") if self.local else None
    self._prefix_checked = None  # (prefix, st_dev, st_ino) of the directory last checked
    self._unlinker = _Unlinker(self._open_dir) if self.local else None
    self._root_fix = (f"point disk_kvstore at the directory itself "
                      f"({os.path.realpath(self._root)!r})" if self.local else "")
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
    path = self._root
    try:
      security.make_private_dir(path, fix=self._root_fix)
      os.close(self._open_dir(None, create=True))
    except OSError as e:
      raise InputError(f"disk tier directory {path!r} cannot be created ({e.strerror}); "
                       "point disk_kvstore at a writable directory.") from None
    if not os.access(path, os.W_OK | os.X_OK):
      raise InputError(f"disk tier directory {path!r} is not writable; point disk_kvstore at "
                       "a writable directory.")

  def _open_dir(self, prefix: str | None, *, create: bool = False) -> int:
    """The descriptor of ``records/`` (``prefix`` None) or of ``records/<prefix>``, each
    component opened from the one above with ``O_NOFOLLOW`` (made 0700 if missing and
    ``create``): a link at the root, ``records/`` or the prefix raises ``InputError``, a
    missing one (not ``create``) ``FileNotFoundError``. The caller closes it."""
    root = security.open_private_dir(self._root, create=create, fix=self._root_fix)
    fd, where = root, self._root
    for part in [RECORDS_PATH] + ([prefix] if prefix is not None else []):
      where = os.path.join(where, part.rstrip("/"))
      parent = fd
      try:
        fd = security.open_private_dir(
            part, dir_fd=parent, where=where, create=create,
            fix=f"remove it (`rm {where}`: whoever can write the store can plant one) and "
            "open the store again")
      finally:
        os.close(parent)
    return fd

  @contextlib.contextmanager
  def _dir(self, prefix: str | None):
    fd = self._open_dir(prefix)
    try:
      yield fd
    finally:
      os.close(fd)

  def _ensure_prefix(self) -> None:
    """Makes this prefix's directory (0700) before TensorStore would make it per the umask,
    and checks that none of the directories down to it is a link (``InputError``).

    Before every write: once a directory was checked that way, the path is only resolved
    (one ``stat``, following links as TensorStore's open will) and compared with the
    checked directory's identity; the same inode means the write lands in it, and anything
    else is checked again from the root (and refused if it is a link)."""
    if not self.local:
      return
    checked = self._prefix_checked
    if checked is not None and checked[0] == self.prefix:
      try:
        st = os.stat(self.prefix_path)
        if (st.st_dev, st.st_ino) == checked[1:]:
          return
      except OSError:
        pass  # gone or unreachable: checked (and made) again below
    fd = self._open_dir(self.prefix, create=True)
    try:
      st = os.fstat(fd)
    finally:
      os.close(fd)
    self._prefix_checked = (self.prefix, st.st_dev, st.st_ino)

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

  def _remove_temporaries(self) -> int:
    """Deletes ``*.__lock`` files a killed writer left in ``records/`` and the directories
    right under it (file driver only). TensorStore's file driver holds a lock on that file
    while it writes (an open-file-description lock on Linux); if we can take a lock on it,
    no writer is alive and the file is stale. A live writer's (another process sharing the
    store) is left alone, and one that vanishes meanwhile was finished by its writer.
    Directories are listed as they are read, and no link is followed."""
    if not self.local:
      return 0
    with self._dir(None) as records:
      n = _remove_stale_temporaries(records)
      with os.scandir(records) as entries:
        for entry in entries:
          if not entry.is_dir(follow_symlinks=False):
            continue
          try:
            fd = os.open(entry.name, _DIR_FLAGS, dir_fd=records)
          except OSError:  # removed or swapped for a link meanwhile, or not ours
            continue
          try:
            n += _remove_stale_temporaries(fd)
          finally:
            os.close(fd)
    return n

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
    if self.local:
      self._scan_local(found, window, t_end)
    else:
      self._scan_listed(found, window, t_end)
    self.discarded = found.discarded
    if found.discarded:
      logging.info("disk tier %s: %d records not adopted at open (%s); %d deleted, the others "
                   "(another format version, unreadable now, not a file) left in place",
                   _where(self.kvstore), sum(found.discarded.values()),
                   ", ".join(f"{r}: {n}" for r, n in sorted(found.discarded.items())),
                   found.deleted)
    return found.good(), found.deleted

  def _out_of_time(self, t_end: float, what: str) -> bool:
    if time.monotonic() < t_end:
      return False
    logging.warning("disk tier %s: %s did not finish before the deadline; the records not "
                    "judged yet are left for a later open", _where(self.kvstore), what)
    return True

  def _scan_local(self, found: _Adoption, window: int, t_end: float) -> None:
    """``scan`` of a local directory: listed as it is read (``os.scandir``), each name
    judged by its ``lstat`` first (a link, FIFO, socket, device or directory is counted
    and left; a file too small for a header is junk), then read in a pool thread with
    ``_read_file``, and deleted (if junk) only if it still is the very file judged."""
    prefix = self.prefix
    reads: collections.deque = collections.deque()  # (name, future of a _FileRead)
    with self._dir(prefix) as dir_fd, os.scandir(dir_fd) as entries:
      for entry in entries:
        if self._out_of_time(t_end, "listing the records"):
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
          self._discard_file(found, dir_fd, name, Failure.SIZE, _identity(st))
          continue
        reads.append((name, _file_pool().submit(self._read_file, prefix, name)))
        while len(reads) >= window:
          self._judge_file(found, dir_fd, prefix, *reads.popleft(), t_end)
      while reads:
        self._judge_file(found, dir_fd, prefix, *reads.popleft(), t_end)

  def _read_file(self, prefix: str, name: str) -> _FileRead | None:
    """Opens ``records/<prefix><name>`` if it is a regular file (never following a link,
    never waiting on a FIFO) and reads a record's worth of it if its size is a record's,
    else its first ``PEEK_BYTES``. None: it is gone. Raises ``NotAFile``."""
    fd = self._open_record(prefix, name)
    if fd is None:
      return None
    try:
      st = os.fstat(fd)
      if st.st_size == self.record_bytes:
        nbytes = self.record_bytes
      else:
        nbytes = blocks.PEEK_BYTES if st.st_size >= blocks.PEEK_BYTES else 0
      return _FileRead(st.st_size, _identity(st), _pread(fd, nbytes))
    finally:
      os.close(fd)

  def _open_record(self, prefix: str, name: str) -> int | None:
    """A read-only descriptor of the regular file ``records/<prefix><name>``; None if it
    (or its directory) is gone. Raises ``NotAFile`` for anything else under the name, or
    for a link on the way to it; it is looked at (``lstat``) before it is opened, opened
    with ``O_NOFOLLOW | O_NONBLOCK`` and looked at again (``fstat``): a name swapped
    between the two is refused by the second, and a FIFO never blocks the open."""
    where = os.path.join(self._root, RECORDS_PATH, prefix, name)
    try:
      dir_fd = self._open_dir(prefix)
    except FileNotFoundError:
      return None
    except InputError as e:
      raise NotAFile(str(e)) from None
    try:
      try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if stat.S_ISREG(mode):
          fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
      except FileNotFoundError:
        return None
      except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):  # swapped meanwhile
          raise NotAFile(f"{where} is not a regular file (it changed as it was opened)"
                         ) from None
        raise
    finally:
      os.close(dir_fd)
    if stat.S_ISREG(mode):
      mode = os.fstat(fd).st_mode
      if stat.S_ISREG(mode):
        return fd
      os.close(fd)
    raise NotAFile(f"{where} is not a regular file but {_kind(mode)}: left as it is")

  def _judge_file(self, found: _Adoption, dir_fd: int, prefix: str, name: str, future,
                  t_end: float) -> None:
    try:
      got = future.result(timeout=max(0.0, t_end - time.monotonic()))
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
    whole = got.size == self.record_bytes and len(got.data) == self.record_bytes
    verdict = self._verdict(prefix + name, whole, got.data)
    if isinstance(verdict, Failure):
      self._discard_file(found, dir_fd, name, verdict, got.identity)
    else:
      found.offer(*verdict)

  def _discard_file(self, found: _Adoption, dir_fd: int, name: str, reason: Failure,
                    identity: tuple[int, int]) -> None:
    """Counts a local record ``scan`` refused and deletes it unless ``reason`` says to
    leave it, and only if the name still is the file judged."""
    found.discarded[reason.value] += 1
    if reason not in _KEPT_AT_OPEN:
      try:
        found.deleted += _unlink_regular(dir_fd, name, identity)
      except OSError:  # not ours to delete (permissions): left, as an unreachable store's
        pass

  def _scan_listed(self, found: _Adoption, window: int, t_end: float) -> None:
    """``scan`` of an object store (any kvstore but a local directory): listed in ranges
    (``_names``), read through TensorStore, each read cut at the record size."""
    reads: collections.deque[_ScanRead] = collections.deque()
    names = self._names(t_end)
    while True:
      while len(reads) < window:
        name = next(names, None)
        if name is None:
          break
        reads.append(_ScanRead(name, True, self._read_range(name, self.record_bytes)))
      if not reads:
        return
      read = reads.popleft()
      verdict = self._judge_scan_read(read, t_end)
      if isinstance(verdict, _ScanRead):  # cut short: read its header
        reads.append(verdict)
      elif isinstance(verdict, Failure):
        found.discarded[verdict.value] += 1
        if verdict not in _KEPT_AT_OPEN:
          self._delete_name(read.name)
          found.deleted += 1
      elif verdict is not None:
        found.offer(*verdict)

  def _names(self, t_end: float):
    """This prefix's names in an object store, in order, listed one range at a time (by
    the name's first hex digit; names that are not hex fall in the first or last range):
    TensorStore's ``list`` returns a range whole, so only one range is held at once."""
    prefix = self.prefix
    bounds = [prefix] + [prefix + d for d in LIST_RANGES[1:]] + [prefix[:-1] + "0"]
    for lo, hi in zip(bounds, bounds[1:]):
      listing = self.kv.list(ts.KvStore.KeyRange(lo, hi), strip_prefix_length=len(prefix))
      try:
        batch = listing.result(timeout=max(0.0, t_end - time.monotonic()))
      except TimeoutError:
        listing.cancel()
        self._out_of_time(t_end, "listing the records")
        return
      batch.sort()
      for key in batch:
        name = key.decode("ascii", "replace")
        if not name.endswith(".__lock"):
          yield prefix + name
      del batch

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
    return self._verdict(read.name, read.whole, got.value)

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
    """Starts reading block ``key``'s record (a local one in jaxkv's own threads, opened
    only if it is a regular file: ``_read_record``)."""
    if self.local:
      fut = _file_pool().submit(self._read_record, self.prefix, key)
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
    fd = self._open_record(prefix, key.hex())
    if fd is None:
      return _Got("missing")
    try:
      data = _pread(fd, self.record_bytes)
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
    """Starts deleting a record (best effort: absent already, or unreachable, is fine). A
    local one is removed only if it is a regular file (``_Unlinker``)."""
    if len(self._deletes) >= self._prune_at:  # forget finished ones (amortized: a scan
      self._deletes = {n: d for n, d in self._deletes.items() if not d.done()}  # deletes many)
      self._prune_at = max(64, 2 * len(self._deletes))
    if self.local:
      self._deletes[name] = self._unlinker.add(name)
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
    if not self.local:
      return 0
    try:
      fd = os.open(self._root, _DIR_FLAGS)
    except OSError:
      return 0
    try:
      return _tree_bytes(fd, _TREE_DEPTH)
    finally:
      os.close(fd)


class _Deletion:
  """One queued deletion of a local record, as a future: ``done()``, ``result(timeout)``."""

  __slots__ = ("_unlinker", "_name")

  def __init__(self, unlinker: "_Unlinker", name: str):
    self._unlinker, self._name = unlinker, name

  def done(self) -> bool:
    return not self._unlinker.pending(self._name)

  def result(self, timeout=None):
    if not self._unlinker.wait(self._name, timeout):
      raise TimeoutError(f"the deletion of record {self._name} is still queued")

  def cancel(self) -> bool:
    return False


class _Unlinker:
  """Deletes a local store's records in jaxkv's file threads: a few tasks drain one queue
  in chunks, each chunk opening a prefix directory once (checked, ``_open_dir``) and
  removing from it only regular files. A store at capacity deletes a record for every one
  it writes, and the file system frees a just-synced file's blocks slowly (~140 us an
  unlink on the development machine, ~60 us each with 8 in parallel): so deletions run
  beside the writes, a few at a time, and cost one hand-off per chunk, not a thread
  wake-up per record. Nothing is removed through a link."""

  CHUNK = 32  # deletions one task takes at a time
  MAX_TASKS = 4

  def __init__(self, open_dir):
    self._open_dir = open_dir
    self._cond = threading.Condition()
    self._queue: collections.deque = collections.deque()  # names to delete
    self._pending: collections.Counter = collections.Counter()  # name -> queued or running
    self._tasks = 0

  def add(self, name: str) -> _Deletion:
    with self._cond:
      self._queue.append(name)
      self._pending[name] += 1
      start = self._tasks < self.MAX_TASKS and len(self._queue) > self.CHUNK * self._tasks
      self._tasks += start
    if start:
      _file_pool().submit(self._drain)
    return _Deletion(self, name)

  def pending(self, name: str) -> bool:
    with self._cond:
      return name in self._pending

  def wait(self, name: str, timeout: float | None) -> bool:
    with self._cond:
      return self._cond.wait_for(lambda: name not in self._pending, timeout)

  def _drain(self) -> None:
    dirs: dict = {}  # prefix -> checked descriptor (None: gone or a link)
    try:
      while True:
        with self._cond:
          if not self._queue:
            self._tasks -= 1
            return
          chunk = [self._queue.popleft() for _ in range(min(self.CHUNK, len(self._queue)))]
        try:
          for name in chunk:
            prefix, _, base = name.rpartition("/")
            if prefix not in dirs:
              try:
                dirs[prefix] = self._open_dir(prefix + "/")
              except (OSError, InputError):
                dirs[prefix] = None  # gone, or a link: nothing of this store's is behind it
            if dirs[prefix] is not None:
              try:
                _unlink_regular(dirs[prefix], base)
              except OSError:
                pass  # best effort, as a deletion through the store is
        finally:
          with self._cond:
            for name in chunk:
              self._pending[name] -= 1
              if not self._pending[name]:
                del self._pending[name]
            self._cond.notify_all()
    except BaseException:  # a bug: this task ends (the next ``add`` starts another)
      with self._cond:
        self._tasks -= 1
      raise
    finally:
      for fd in dirs.values():
        if fd is not None:
          os.close(fd)


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
