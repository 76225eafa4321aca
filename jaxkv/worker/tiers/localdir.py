"""A local store's directory, read and changed with no link ever followed.

Whoever can write a store's directory can plant symbolic links, FIFOs, sockets and devices
in it (threat model: BUILD.md). ``LocalDir`` is the one place the disk tier touches a local
store's files, and it never follows what was planted:
- the root, ``records/`` and a prefix directory are opened one from the other with
  ``O_NOFOLLOW`` (``open_dir``), and a link at any of them is refused (``InputError``: it
  would send reads and deletes to whatever it points at);
- a record is read only if it is a regular file (``lstat``, then ``open(O_NOFOLLOW |
  O_NONBLOCK)`` and ``fstat``: a name swapped between the two checks is caught by the
  second, and a FIFO opened non-blocking never blocks a thread); anything else under a
  record's name raises ``NotAFile`` and is left in place;
- only regular files are deleted, relative to a checked directory descriptor (``unlink``
  removes a name, never what a link points to), in chunks by a few threads (``_Unlinker``);
- a record is written by jaxkv too (``write_file``), mode 0600: into a new temporary
  created ``O_EXCL | O_NOFOLLOW`` in the checked prefix directory, renamed over its name
  (a link planted there is replaced, never written through).
What remains: a name swapped for a device node between the ``lstat`` and the open is
opened (non-blocking, no controlling tty) before ``fstat`` refuses it (planting one takes
CAP_MKNOD); a delete of a dropped block's record removes whatever regular file has its name
then (a miss later, as any record another sharer evicted).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import errno
import fcntl
import functools
import itertools
import os
import stat
import threading
import time
import weakref

from jaxkv import security
from jaxkv.errors import InputError
from jaxkv.worker.tiers import blocks
from jaxkv.worker.tiers.base import Failure

RECORDS_PATH = "records/"

# A local record is opened so that neither a link (ELOOP) nor a FIFO (no wait for a writer)
# nor a terminal (no controlling tty) can make the open follow, block or do anything else.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
RECORD_MODE = 0o600  # a record holds KV, and KV is the prompt: its owner's alone
STALE_TEMPORARY_S = 60.0  # an unlocked temporary untouched this long was left by a crash
_TREE_DEPTH = 8  # ``bytes_on_disk`` looks no deeper (jaxkv's own tree is 3 deep)


class NotAFile(blocks.BlockError):
  """A record's name does not lead to a regular file in the store's own directory: a link,
  FIFO, socket, device or directory is there, or the prefix directory is a link. Never
  opened for reading, never deleted; read, it is a verification failure (``not_a_file``)."""

  def __init__(self, detail: str):
    super().__init__(Failure.NOT_A_FILE.value, detail)


def kind(mode: int) -> str:
  for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                     (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
                     (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
    if test(mode):
      return kind
  return f"of mode {mode:o}"


def identity(st: os.stat_result) -> tuple[int, int]:
  return st.st_dev, st.st_ino


def _remove_if_unlocked(dir_fd: int, name: str) -> bool:
  """Removes the temporary ``name`` in directory ``dir_fd`` if it is a regular file no
  process holds a lock on (a POSIX record lock conflicts with a writer's
  open-file-description lock too) and that was last written ``STALE_TEMPORARY_S`` ago or
  more: a writer creates its temporary before it can lock it, and one just created is not
  taken from under it. Returns whether it was removed."""
  try:
    fd = os.open(name, os.O_RDWR | (_FILE_FLAGS & ~os.O_ACCMODE), dir_fd=dir_fd)
  except OSError:
    return False  # gone (its writer finished it), a link, or not ours to open
  try:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < STALE_TEMPORARY_S:
      return False
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      return False  # held: a live writer's
    # While holding the lock, as the writers' protocol expects, and only if the name still
    # is this file (a writer that renamed it away may have made a new one under the name).
    return unlink_regular(dir_fd, name, identity(st))
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


def unlink_regular(dir_fd: int, name: str, same_as: tuple[int, int] | None = None) -> bool:
  """Removes ``name`` in directory ``dir_fd`` if it is a regular file (and, given
  ``same_as``, that very file): never what a link points to, never a FIFO, socket, device
  or directory. Returns whether it was removed."""
  try:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if not stat.S_ISREG(st.st_mode) or (same_as is not None and identity(st) != same_as):
      return False
    os.unlink(name, dir_fd=dir_fd)
    return True
  except FileNotFoundError:
    return False


def pread(fd: int, nbytes: int) -> bytes:
  """Up to ``nbytes`` from the start of ``fd`` (fewer at its end)."""
  chunks, got = [], 0
  while got < nbytes:
    chunk = os.pread(fd, nbytes - got, got)
    if not chunk:
      break
    chunks.append(chunk)
    got += len(chunk)
  return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def tree_bytes(dir_fd: int, depth: int) -> int:
  total = 0
  with os.scandir(dir_fd) as entries:
    for entry in entries:
      try:
        if entry.is_file(follow_symlinks=False):
          total += entry.stat(follow_symlinks=False).st_size
        elif entry.is_dir(follow_symlinks=False) and depth > 0:
          fd = os.open(entry.name, _DIR_FLAGS, dir_fd=dir_fd)
          try:
            total += tree_bytes(fd, depth - 1)
          finally:
            os.close(fd)
      except OSError:  # removed meanwhile by another process, or swapped for a link
        pass
  return total


def _close_quietly(fds: dict) -> None:
  for fd in fds.values():
    with contextlib.suppress(OSError):
      os.close(fd)


@functools.lru_cache(maxsize=1)
def file_pool() -> concurrent.futures.ThreadPoolExecutor:
  """Threads for local reads and deletes (jaxkv's, not TensorStore's: see the module
  docstring). A read here never blocks on what a record's name holds."""
  return concurrent.futures.ThreadPoolExecutor(thread_name_prefix="jaxkv-disk")


@dataclasses.dataclass(frozen=True)
class FileRead:
  """What a local scan read found: the file's ``size`` and identity, and its first bytes
  (a record's worth if its size is a record's, else ``blocks.PEEK_BYTES``)."""

  size: int
  identity: tuple[int, int]
  data: bytes


class LocalDir:
  """The directory ``root`` of a local store, its ``records/`` and prefix directories."""

  def __init__(self, root: str):
    self.root = root.rstrip("/") or "/"
    self.root_fix = f"point disk_kvstore at the directory itself ({os.path.realpath(self.root)!r})"
    self._unlinker = _Unlinker(self.open_dir)
    # Writes go into checked prefix directories held open (closed with this object).
    self._write_dirs: dict[str, int] = {}
    self._write_lock = threading.Lock()
    self._temporaries = itertools.count()
    weakref.finalize(self, _close_quietly, self._write_dirs)

  def open_dir(self, prefix: str | None, *, create: bool = False) -> int:
    """The descriptor of ``records/`` (``prefix`` None) or of ``records/<prefix>``, each
    component opened from the one above with ``O_NOFOLLOW`` (made 0700 if missing and
    ``create``): a link at the root, ``records/`` or the prefix raises ``InputError``, a
    missing one (not ``create``) ``FileNotFoundError``. The caller closes it."""
    root = security.open_private_dir(self.root, create=create, fix=self.root_fix)
    fd, where = root, self.root
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
  def dir(self, prefix: str | None):
    """``open_dir`` as a context (the descriptor closed on leaving)."""
    fd = self.open_dir(prefix)
    try:
      yield fd
    finally:
      os.close(fd)

  def ensure_prefix(self, prefix: str) -> None:
    """Makes the directory of ``prefix`` (0700) if it is missing and checks that none of
    the directories down to it is a link (``InputError``)."""
    os.close(self.open_dir(prefix, create=True))

  def remove_temporaries(self) -> int:
    """Deletes ``*.__lock`` files a killed writer left in ``records/`` and the directories
    right under it. A writer (jaxkv's, or TensorStore's file driver) holds a lock on that
    file while it writes (a record lock, or an open-file-description lock); if we can take
    a lock on it and it is older than ``STALE_TEMPORARY_S``, no writer is alive and the
    file is stale. A live writer's (another process sharing the
    store) is left alone, and one that vanishes meanwhile was finished by its writer.
    Directories are listed as they are read, and no link is followed."""
    with self.dir(None) as records:
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

  def read_file(self, prefix: str, name: str, record_bytes: int) -> FileRead | None:
    """Opens ``records/<prefix><name>`` if it is a regular file (never following a link,
    never waiting on a FIFO) and reads a record's worth of it if its size is a record's,
    else its first ``PEEK_BYTES``. None: it is gone. Raises ``NotAFile``."""
    fd = self.open_record(prefix, name)
    if fd is None:
      return None
    try:
      st = os.fstat(fd)
      if st.st_size == record_bytes:
        nbytes = record_bytes
      else:
        nbytes = blocks.PEEK_BYTES if st.st_size >= blocks.PEEK_BYTES else 0
      return FileRead(st.st_size, identity(st), pread(fd, nbytes))
    finally:
      os.close(fd)

  def open_record(self, prefix: str, name: str) -> int | None:
    """A read-only descriptor of the regular file ``records/<prefix><name>``; None if it
    (or its directory) is gone. Raises ``NotAFile`` for anything else under the name, or
    for a link on the way to it; it is looked at (``lstat``) before it is opened, opened
    with ``O_NOFOLLOW | O_NONBLOCK`` and looked at again (``fstat``): a name swapped
    between the two is refused by the second, and a FIFO never blocks the open."""
    where = os.path.join(self.root, RECORDS_PATH, prefix, name)
    try:
      dir_fd = self.open_dir(prefix)
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
    raise NotAFile(f"{where} is not a regular file but {kind(mode)}: left as it is")

  def write_file(self, prefix: str, name: str, data: bytes) -> None:
    """Writes the record ``records/<prefix><name>`` whole, mode 0600 (never more, whatever
    the umask): into a new temporary (``<name>.<n>.__lock``, created ``O_EXCL |
    O_NOFOLLOW`` and locked while written, as ``remove_temporaries`` expects of a live
    writer) in the checked prefix directory, then renamed over the name: a link planted
    under the name is replaced, never written through; a directory there fails the write.
    Not yet durable: ``sync`` the file system before publishing."""
    dir_fd = self._prefix_fd(prefix)
    tmp = f"{name}.{os.getpid()}-{next(self._temporaries)}.__lock"
    fd = os.open(tmp, _NEW_FILE_FLAGS, RECORD_MODE, dir_fd=dir_fd)
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX)
      view = memoryview(data)
      while view:
        view = view[os.write(fd, view):]
      os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
      with contextlib.suppress(OSError):
        os.unlink(tmp, dir_fd=dir_fd)
      raise
    finally:
      os.close(fd)

  def _prefix_fd(self, prefix: str) -> int:
    """The checked, open directory of ``prefix`` (made 0700 if missing; a link on the way
    refused with ``InputError``)."""
    with self._write_lock:
      fd = self._write_dirs.get(prefix)
      if fd is None:
        fd = self._write_dirs[prefix] = self.open_dir(prefix, create=True)
      return fd

  def delete(self, name: str) -> _Deletion:
    """Starts removing ``records/<name>`` if it is a regular file; returns its future."""
    return self._unlinker.add(name)

  def bytes_on_disk(self) -> int:
    """Bytes the store's regular files hold; no link is followed."""
    try:
      fd = os.open(self.root, _DIR_FLAGS)
    except OSError:
      return 0
    try:
      return tree_bytes(fd, _TREE_DEPTH)
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
  in chunks, each chunk opening a prefix directory once (checked, ``open_dir``) and
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
      file_pool().submit(self._drain)
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
                unlink_regular(dirs[prefix], base)
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
