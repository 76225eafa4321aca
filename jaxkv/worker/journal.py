"""DiskJournal: the disk writes in flight of one cache, and when each block is published.

A block goes to disk in three moves, and the journal is where it waits between them:
1. ``write``: the record's write is issued into the disk slot the manager chose for it
   (``CacheManager.resolve``, which also ordered the records evicted from that slot
   deleted), and the slot stays referenced, so no eviction can take it while the bytes are
   on their way. Unless the writes in flight are at their bound (below): then it is not
   issued; its slot goes back empty and it is counted (``disk_writes_dropped``).
2. ``pump`` (called often, never blocking): writes whose futures finished are settled.
   The committed ones are made durable together (one ``DiskTier.sync`` for the batch),
   then reported to the manager (``copied``: published in its index); a failed one is
   counted, its slot given back (``copy_failed``) and its record (if any) deleted. It is
   never published.
3. ``flush``: waits (with a deadline) for every write in flight, then pumps.

Bounded, never waited for: each write in flight holds its block's bytes until it commits,
so a store slower than the evictions (a far object store, a slow link) would pile them up.
The journal holds at most ``queue_bytes`` (``TierConfig.disk_queue_mb``) of writes: a write
that would pass it is dropped (the block stays wherever else it is, or is recomputed when
next asked for), and nothing in a step ever waits for the store. When a batch would pass
it, the writes that finished are settled first (``pump``), so only what is still on its
way counts. One write is let through when none is in flight, so a bound smaller than a
block slows the tier to one write at a time instead of closing it.

Invariants: a block is published in the DISK pool only after its record committed and
was synced; every slot the journal was given is reported exactly once (published or
failed); a key is written at most once at a time (the manager gives a key being written no
second slot), so two shards' copies of one block take one slot.

A multi-process job shares one store: its processes take turns writing blocks (each
written once, by one process), and every process journals every write, the others' too,
so that their indexes stay identical. Each process reports the outcome of its own writes
and all take the writer's word (``distributed.agree_writes``: a collective, at the same
``pump`` calls everywhere, only when writes are in flight). The bound counts the job's
writes, a list every process holds alike: each drops the same writes, whatever its own
store calls are doing (a process holds the bytes of its own turns only).

The disk store's health: a store that keeps failing (three batches of reads or writes in
a row raising: it is down or unreachable) is detached for a cool-down (``available`` is
False): no reads are planned from it and no writes issued. A batch of reads none of which
the store answered by the read deadline detaches it at once (a store that hangs would
otherwise cost three requests their whole deadline each). Writes report to the breaker
here, reads through ``record``. Not in a job: a wall-clock cool-down would differ between
its processes.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from absl import logging

from jaxkv import distributed
from jaxkv.config import TierConfig
from jaxkv.manager.index import Tier
from jaxkv.stats import Stats
from jaxkv.worker.tiers.base import Breaker

# A write's outcome as its writer reports it (0: not finished, or another process's).
WRITE_OK, WRITE_FAILED = 1, 2
DEFAULT_QUEUE_BYTES = TierConfig.disk_queue_mb << 20  # the field's default


@dataclasses.dataclass(frozen=True)
class _Write:
  """One block on its way to disk: the slot it took, and the commit to wait for (None when
  another process of the job writes it)."""

  slot: int
  key: bytes
  parent: bytes | None
  future: object


class DiskJournal:
  """The disk writes in flight of one cache (its disk tier and stats; their slots and
  outcomes are the manager's), at most ``queue_bytes`` of them (``TierConfig.disk_queue_mb``)."""

  def __init__(self, *, manager, disk, stats: Stats, page_bytes: int, dtype,
               queue_bytes: int = DEFAULT_QUEUE_BYTES):
    # The manager's index is read here; it changes through the manager's reports only.
    self.manager, self.index, self.disk, self.stats = manager, manager.index, disk, stats
    self.page_bytes, self.dtype = page_bytes, dtype
    self.queue_bytes = int(queue_bytes)
    self.processes, self.process = jax.process_count(), jax.process_index()
    self._writes: list[_Write] = []
    self._next_writer = 0  # a job's processes take turns, in issue order
    self.breaker = Breaker() if self.processes == 1 else None

  # ---- the store's health ------------------------------------------------------------------
  @property
  def available(self) -> bool:
    """Whether the disk tier is attached (not cooling down after repeated failures)."""
    return self.breaker is None or self.breaker.available

  def record(self, ok: bool, *, hung: bool = False) -> None:
    """One batch of reads or writes: the store answered (``ok``) or raised; ``hung``: it
    answered none of them by the deadline (detached at once)."""
    if self.breaker is None:
      return
    was = self.breaker.available
    if hung:
      self.breaker.trip()
    else:
      self.breaker.record(ok)
    if was and not self.breaker.available:
      self.stats.add("disk_detached")
      logging.warning("disk tier %s keeps failing: detached for %.0f s (requests recompute "
                      "what it holds meanwhile)", self.disk.kvstore, self.breaker.cool_down_s)

  # ---- writes ------------------------------------------------------------------------------
  @property
  def writes_in_flight(self) -> int:
    return len(self._writes)

  @property
  def bytes_in_flight(self) -> int:
    """The bytes of the writes in flight, which ``queue_bytes`` bounds (in a job: the
    job's, the same on every process)."""
    return len(self._writes) * self.page_bytes

  def _room(self, writes: int) -> bool:
    """Whether ``writes`` more fit under the bound (one always does when none is in flight).
    Decided on the journal alone, which every process of a job holds alike."""
    return not self._writes or (
        self.bytes_in_flight + writes * self.page_bytes <= self.queue_bytes)

  def write(self, stack: np.ndarray, per: list[list], n: int, slots: dict) -> None:
    """Writes the blocks ``slots`` names (key -> the disk slot the manager took for it) and
    takes those entries out of ``slots``. ``stack``: raw bits ``[arrays, kv_heads,
    data_shards * n, page_size, head_dim]``; ``per[s][i]``: the block ``(shard, _, key)`` at
    row ``s * n + i``. A detached store writes nothing, and a write past the bound
    (``queue_bytes``) is not issued: their slots go back empty, counted."""
    wanted = len({b[2] for items in per for b in items} & slots.keys())
    if wanted and not self._room(wanted):
      self.pump()  # what finished leaves room (in a job: a collective every process makes)
    for s, items in enumerate(per):
      for i, b in enumerate(items):
        key = b[2]
        slot = slots.pop(key, None)
        if slot is None:
          continue
        if not self.available:
          self.stats.add("disk_detached_drops")
          self.manager.copy_failed(0, slot, key, Tier.DISK)
          continue
        if not self._room(1):  # the store is not keeping up: never waited for
          self.stats.add("disk_writes_dropped")
          self.manager.copy_failed(0, slot, key, Tier.DISK)
          continue
        parent = self.index.parent_of(key)
        writer = self._next_writer % self.processes
        self._next_writer += 1
        future = None
        if writer == self.process:
          payload = np.ascontiguousarray(stack[:, :, s * n + i]).view(self.dtype)
          future = self.disk.write(key, payload, parent)
          self.stats.add("disk_writes")
        self._writes.append(_Write(slot, key, parent, future))
        self.stats.add("bytes_moved", self.page_bytes)
    self.pump()

  def pump(self) -> None:
    """Reports the writes that committed to the manager (after one sync of the batch:
    published) and releases the slots of failed ones. In a job every process settles the
    same writes at the same call."""
    if not self._writes:
      return
    codes = distributed.agree_writes(self._own_codes())
    still, published, failed = [], 0, 0
    for w, code in zip(self._writes, codes):
      if code == 0:  # not finished yet
        still.append(w)
        continue
      if code == WRITE_OK:
        self.manager.copied(0, w.slot, w.key, Tier.DISK, parent=w.parent)
        published += 1
        continue
      failed += 1
      self.stats.add("disk_write_failures")
      self.disk.delete(w.key)  # whatever reached the store is never read: remove it
      self.manager.copy_failed(0, w.slot, w.key, Tier.DISK)
    self._writes = still
    self.stats.add("demoted_disk", published)
    if published or failed:
      self.record(published > 0)  # one outcome per batch that finished

  def _own_codes(self) -> np.ndarray:
    """The outcome of each write in flight as this process knows it: its own writes that
    finished are ``WRITE_OK`` (committed, and synced with one flush for all of them) or
    ``WRITE_FAILED``; 0 for the rest."""
    codes = np.zeros(len(self._writes), np.int32)
    committed = []
    for i, w in enumerate(self._writes):
      if w.future is None or not w.future.done():
        continue
      try:
        w.future.result(timeout=0)
        committed.append(i)
      except Exception:  # pylint: disable=broad-except  (a failed write: never published)
        codes[i] = WRITE_FAILED
    if committed:
      try:
        self.disk.sync()
        self.stats.add("disk_syncs")
        codes[committed] = WRITE_OK
      except OSError:
        codes[committed] = WRITE_FAILED
    return codes

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits (up to ``timeout_s``) for every write in flight; returns how many are left."""
    t_end = time.monotonic() + timeout_s
    for w in self._writes:
      try:
        if w.future is not None:
          w.future.result(timeout=max(0.0, t_end - time.monotonic()))
      except Exception:  # pylint: disable=broad-except  (a failed write: settled in pump)
        pass
    self.pump()
    return len(self._writes)
