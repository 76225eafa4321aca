"""The POOL tier's puts, written behind: a bounded queue and the one thread that empties it.

The mover hands the blocks it sends to the pool to ``PutQueue.put`` between steps and never
waits for them: the queue holds their payloads (copied) up to ``TierConfig.pool_queue_mb``,
and one thread (``jaxkv-pool-put``) takes them in batches of up to 64, asks the pool once
per batch which it holds already (those are not put again), and puts the rest, each value
named and sealed on that thread (``name``, ``value``: the tier's), never on the mover's.

Invariants:

- Bounded, never blocking: a put the queue has no room for, or one arriving while the
  queue is closed or the breaker is open, is dropped and counted (``pool_put_dropped``) at
  once. The queued bytes are those of the payloads queued and not yet tried.
- Every key queued ends with an outcome (``Outcomes``: placed or missed), whatever stops
  its write, so a hand-off waiting for its own keys never waits for a key nobody writes.
- ``settle`` returns True only once every queued put was tried (nothing queued, nothing
  being written).
- The breaker is the tier's: a failed or given-up put call counts toward it like a failed
  read, and while it is open the writer drops what it takes (counted) without a call. Every
  client call runs through ``PutCalls`` (``jaxkv.worker.tiers.pool.calls``), waited for the
  put deadline at most, so a lender that stopped serving trips the breaker within two
  deadlines.
- A key whose put missed may be offered again (it leaves the recently-put keys), except in
  a multi-process job: there every process notes the same keys at the same point, and only
  the one that put a key saw its failure.
"""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable

import numpy as np
from absl import logging

from jaxkv.worker.tiers.pool.calls import MISSED, PLACED, QUEUED, Calls, Outcomes, PutCalls

BATCH = 64  # puts taken off the queue together (one ``batch_is_exist`` for them)
UNAVAILABLE = -900  # Mooncake's RPC failure (the master unreachable): the batch stops


class _Put:
  __slots__ = ("key", "parent", "payload", "pin")

  def __init__(self, key, parent, payload, pin):
    self.key, self.parent, self.payload, self.pin = key, parent, payload, pin


def _next_batch(puts: queue.Queue) -> list | None:
  """The next puts to write (up to ``BATCH``; waits for the first), or None when closing."""
  first = puts.get()
  if first is None:
    return None
  batch = [first]
  while len(batch) < BATCH:
    try:
      nxt = puts.get_nowait()
    except queue.Empty:
      break
    if nxt is None:
      puts.put(None)  # seen again by the next call
      break
    batch.append(nxt)
  return batch


def _replicate_config(store, tiers, pin: bool):
  config = store.ReplicateConfig()
  config.replica_num = tiers.pool_replicas
  if pin and tiers.pool_pin_s > 0:
    config.soft_pin_action = store.SoftPinAction.ENABLE
    config.soft_pin_ttl_ms = int(tiers.pool_pin_s * 1000)
  return config


class PutQueue:
  """The write-behind puts of one pool tier (``tiers``: its ``TierConfig``), their outcomes
  (``outcomes``) and the keys sent lately (not offered again). ``breaker`` and ``stats`` are
  the tier's. Puts queue from construction; ``start`` begins writing them."""

  def __init__(self, tiers, *, breaker, stats, recent_keys: int):
    self.tiers = tiers
    self.limit_bytes = tiers.pool_queue_mb << 20
    self.breaker, self.stats = breaker, stats
    self.outcomes = Outcomes(recent_keys)
    self.in_job = False  # a multi-process job's: a missed key is not offered again
    self.closed = False
    self._keep = recent_keys
    self._puts: queue.Queue = queue.Queue()
    self._queued_bytes = 0
    self._lock = threading.Lock()
    self._idle = threading.Event()
    self._idle.set()
    self._recent: collections.OrderedDict = collections.OrderedDict()  # keys sent lately
    self._writer: threading.Thread | None = None
    self._call: PutCalls | None = None
    self._client = self._store = None
    self._name: Callable | None = None
    self._value: Callable | None = None

  def start(self, client, store, calls: Calls, *, threads: int, deadline_s: float,
            name: Callable[[bytes], str], value: Callable) -> None:
    """Starts the writer: puts go into ``client`` (``store``: its module) on ``threads``
    call threads, each call waited for ``deadline_s`` (and tracked in ``calls``); a block's
    pool name is ``name(key)`` and its value ``value(key, payload, parent)``."""
    self._client, self._store, self._name, self._value = client, store, name, value
    self._call = PutCalls(calls, threads, deadline_s)
    self._writer = threading.Thread(target=self._write_loop, name="jaxkv-pool-put", daemon=True)
    self._writer.start()

  def stop(self, timeout_s: float) -> bool:
    """Takes no more puts and ends the writer after the batch it is writing (waiting up to
    ``timeout_s``); returns whether it ended (a call may still be inside the client)."""
    self.closed = True
    self._puts.put(None)
    if self._writer is None:
      return True
    self._writer.join(timeout_s)
    self._call.shutdown()
    return not self._writer.is_alive()

  # ---- the keys sent lately --------------------------------------------------------------------
  def recently_put(self, key: bytes) -> bool:
    """Whether ``key`` was sent to the pool lately (not put again)."""
    with self._lock:
      if key in self._recent:
        self._recent.move_to_end(key)
        return True
    return False

  def note(self, keys) -> None:
    """Marks ``keys`` as sent to the pool (the last ``recent_keys`` are kept)."""
    with self._lock:
      for key in keys:
        self._recent[key] = None
        self._recent.move_to_end(key)
      while len(self._recent) > self._keep:
        self._recent.popitem(last=False)

  # ---- the queue -------------------------------------------------------------------------------
  def put(self, items: list[tuple[bytes, bytes | None, np.ndarray, bool]]) -> None:
    """Queues ``(key, parent, payload, pin)`` puts (the payload copied); those the queue has
    no room for, or that arrive while it is closed or the breaker is open, are dropped and
    counted, never waited for."""
    for key, parent, payload, pin in items:
      if self.closed or not self.breaker.available:
        self.stats.add("pool_put_dropped")
        self.outcomes.set([key], MISSED)
        continue
      with self._lock:
        if self._queued_bytes + payload.nbytes > self.limit_bytes:
          self.stats.add("pool_put_dropped")
          self.outcomes.set([key], MISSED)
          continue
        self._queued_bytes += payload.nbytes
        self.outcomes.set([key], QUEUED)
        self._idle.clear()
      self._puts.put(_Put(key, parent, np.array(payload, copy=True), pin))

  @property
  def queued(self) -> int:
    """Puts queued and not yet tried."""
    return self._puts.qsize()

  @property
  def queued_bytes(self) -> int:
    """The payload bytes of the puts queued or being written (at most ``limit_bytes``)."""
    with self._lock:
      return self._queued_bytes

  def settle(self, timeout_s: float = 30.0) -> bool:
    """Waits (up to ``timeout_s``) until every queued put was tried; True when none is left."""
    return self._idle.wait(timeout_s)

  # ---- the writer ------------------------------------------------------------------------------
  def _write_loop(self) -> None:
    while (batch := _next_batch(self._puts)) is not None:
      try:
        self._write(batch)
      except Exception:  # pylint: disable=broad-except  (a put that fails is counted, not fatal)
        logging.exception("pool puts failed")
        self.breaker.record(False)
        self.stats.add("pool_put_errors", len(batch))
      finally:
        # every put ends with an outcome, whatever stopped it
        self.outcomes.set([p.key for p in batch], MISSED, where=QUEUED)
        with self._lock:
          self._queued_bytes -= sum(p.payload.nbytes for p in batch)
          if self._queued_bytes == 0 and self._puts.empty():
            self._idle.set()

  def _timed_out(self, keys) -> None:
    """A put call given up: a failure toward the breaker, the keys missed (offered again)."""
    self.breaker.record(False)
    self.stats.add("pool_put_timeouts")
    self._miss(keys)

  def _miss(self, keys) -> None:
    for key in keys:
      self._forget(key)
    self.outcomes.set(keys, MISSED)

  def _write(self, batch: list[_Put]) -> None:
    """Puts a batch; when the master is unreachable (each call then blocks ~4 s), a call is
    given up at its deadline, or the breaker is open, the rest of the batch is dropped and
    counted, not tried one by one."""
    if not self.breaker.available:
      self.stats.add("pool_put_dropped", len(batch))
      self._miss([p.key for p in batch])
      return
    names = [self._name(p.key) for p in batch]
    try:
      there = self._call(self._client.batch_is_exist, names)
    except TimeoutError:
      self.stats.add("pool_put_dropped", len(batch))
      self._timed_out([p.key for p in batch])
      return
    if any(c == UNAVAILABLE for c in there):
      self.breaker.record(False)
      self.stats.add("pool_put_dropped", len(batch))
      self._miss([p.key for p in batch])
      return
    for n, (p, name, code) in enumerate(zip(batch, names, there)):
      if not self.breaker.available:
        self.stats.add("pool_put_dropped", len(batch) - n)
        self._miss([q.key for q in batch[n:]])
        return
      if code > 0:
        self.stats.add("pool_put_present")
        self.outcomes.set([p.key], PLACED)
        continue
      if code < 0:
        self.breaker.record(False)
        self.stats.add("pool_put_errors")
        self._miss([p.key])
        continue
      try:
        rc = self._call(self._client.put, name, self._value(p.key, p.payload, p.parent),
                        _replicate_config(self._store, self.tiers, p.pin))
      except TimeoutError:  # a lender that stopped serving: the call stays in the client
        self._timed_out([p.key])
        continue
      if rc == 0:
        self.breaker.record(True)
        self.stats.add("pool_puts")
        self.stats.add("pool_pinned", p.pin)
        self.outcomes.set([p.key], PLACED)
      else:
        if rc == UNAVAILABLE:
          self.breaker.record(False)
        self.stats.add("pool_put_refused")
        self._miss([p.key])  # may be put again later

  def _forget(self, key: bytes) -> None:
    """A put that failed may be offered again (not in a job: its processes' notes must
    stay the same, and only one of them saw the failure)."""
    if not self.in_job:
      with self._lock:
        self._recent.pop(key, None)
