"""Faults injected around real jaxkv parts. The product code has no test hooks: each fault
here wraps the real part and changes only what the fault is about.

- ``LyingBlockServer``: a real ``BlockServer`` whose ``ship`` damages, misdescribes or
  withholds the blocks it sends (what a broken or lying peer does on the wire).
- ``SlowReads`` / ``FailingReads``: a real ``DiskTier``'s reads arrive late, or raise.
- ``FailingWrites``: a real ``DiskTier``'s writes fail (after reaching the store, or not).
- ``link_in_place`` / ``fifo_in_place`` / ``socket_in_place``: what whoever can write a
  local store's directories (but lacks the key) plants under the names a ``DiskTier``
  uses: real symbolic links, FIFOs and sockets.
Install a disk fault by shadowing the method on the instance (``disk.read =
SlowReads(disk, 4.0)``); ``del disk.read`` puts the real one back.
"""

import dataclasses
import os
import secrets
import socket
import threading
import time

import jax
import numpy as np
import tensorstore as ts

from jaxkv.tiers.disk import PendingRead
from jaxkv.tiers.remote import BlockServer

SERVER_FAULTS = ("checksum", "dtype", "shape", "keys", "hang")


class LyingBlockServer(BlockServer):
  """A ``BlockServer`` that answers every fetch wrongly, one way:

  - ``checksum``: a bit of the blocks flipped after their CRC-32C was computed;
  - ``dtype``: the values sent widened, the right dtype claimed;
  - ``shape``: a wrong shape claimed;
  - ``keys``: other blocks named (the keys reversed);
  - ``hang``: no answer to the fetch ever comes (inline: only an answer to another
    request does); with the transfer transport, an offer whose pull is never served.
  Lookups are answered truthfully, so a client does ask for the blocks.
  """

  def __init__(self, cache, fault: str, **kw):
    if fault not in SERVER_FAULTS:
      raise ValueError(f"{fault=} must be one of {SERVER_FAULTS}.")
    super().__init__(cache, **kw)
    self.fault = fault
    self._unserved = None  # a transfer server that is never asked to serve anything

  def ship(self, offer, stack, transport):
    if self.fault == "checksum":
      stack = np.array(stack)
      stack.reshape(-1)[7] ^= 1
    elif self.fault == "dtype":
      stack = stack.astype(np.uint32 if stack.dtype == np.uint16 else np.uint16)
    elif self.fault == "shape":
      offer = dataclasses.replace(offer, shape=(offer.shape[0] + 1, *offer.shape[1:]))
    elif self.fault == "keys":
      offer = dataclasses.replace(offer, keys=offer.keys[::-1])
    elif self.fault == "hang":
      if transport == "inline":
        return dataclasses.replace(offer, nonce="never-asked"), []
      if self._unserved is None:
        import jax.experimental.transfer as transfer
        self._unserved = transfer.start_transfer_server(jax.local_devices()[0].client,
                                                        "127.0.0.1:0", ["127.0.0.1:0"])
      return dataclasses.replace(offer, transfer_id=secrets.randbits(63),
                                 transfer_address=self._unserved.address()), []
    return super().ship(offer, stack, transport)


class SlowReads:
  """A real ``DiskTier``'s reads, each result arriving ``delay_s`` late."""

  def __init__(self, disk, delay_s: float):
    self.real_read, self.delay_s = disk.read, delay_s

  def __call__(self, key: bytes) -> PendingRead:
    pending = self.real_read(key)
    promise, future = ts.Promise.new()

    def later():
      time.sleep(self.delay_s)
      try:
        promise.set_result(pending.future.result())
      except BaseException as e:  # pylint: disable=broad-except  (handed to the reader)
        promise.set_exception(e)

    threading.Thread(target=later, daemon=True).start()
    return dataclasses.replace(pending, future=future)


class FailingReads:
  """A real ``DiskTier``'s reads: the first ``times`` reads of each record raise (the
  store's error surfaces in the read's future, as TensorStore reports I/O errors).
  ``failed[key]`` counts the reads that failed."""

  def __init__(self, disk, times: int):
    self.real_read, self.times, self.failed = disk.read, times, {}

  def __call__(self, key: bytes) -> PendingRead:
    if self.failed.get(key, 0) < self.times:
      self.failed[key] = self.failed.get(key, 0) + 1
      promise, future = ts.Promise.new()
      promise.set_exception(OSError(f"transient I/O error reading block {key.hex()[:16]}"))
      return PendingRead(key, future, time.monotonic())
    return self.real_read(key)


class FailingWrites:
  """A real ``DiskTier``'s writes, each reported failed with ``error``: issued to the
  store and failed at once (``landed=False``: the store is down), or failed only after
  the bytes were written (``landed=True``: e.g. a permission error on the rename)."""

  def __init__(self, disk, error: BaseException, *, landed: bool = False):
    self.real_write, self.error, self.landed = disk.write, error, landed

  def __call__(self, key: bytes, payload, parent):
    written = self.real_write(key, payload, parent)
    if self.landed:
      written.result(timeout=30)
    promise, future = ts.Promise.new()
    promise.set_exception(self.error)
    return future


# ---- what whoever can write a local store's directories plants there ------------------------
def link_in_place(path: str, target: str) -> str | None:
  """Puts a symbolic link to ``target`` at ``path``; what was there (a file or a directory)
  is moved aside to ``path + '.aside'``, whose name is returned (None if nothing was)."""
  path = path.rstrip("/")
  aside = None
  if os.path.lexists(path):
    aside = path + ".aside"
    os.rename(path, aside)
  os.symlink(target, path)
  return aside


def fifo_in_place(path: str) -> None:
  """Puts a FIFO at ``path`` (what was there is removed): a read of it that opens it
  blocking waits forever for a writer."""
  if os.path.lexists(path):
    os.unlink(path)
  os.mkfifo(path, 0o600)


def socket_in_place(path: str) -> None:
  """Puts a Unix socket at ``path`` (bound, then closed: the name stays). Changes the
  working directory while it binds (a record's path is longer than a socket address may
  be): call it in a child process, not in the test process."""
  if os.path.lexists(path):
    os.unlink(path)
  here = os.getcwd()
  os.chdir(os.path.dirname(path))
  try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
      s.bind(os.path.basename(path))
  finally:
    os.chdir(here)
