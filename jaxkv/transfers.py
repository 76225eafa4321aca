"""TierMover: moves blocks between device, host and disk, and verifies what comes back.

It is called from one thread, always in the same order for the same work, so every
transfer is issued deterministically (multi-host jobs need that). Device and host
transfers are asynchronous JAX dispatches ordered by data dependencies: a gather that
reads a device page is dispatched before any step that overwrites it. Disk I/O runs on
TensorStore futures. Every wait on a tier happens through this module, with a deadline.

Moves
- ``demote``: blocks evicted from the device pool are copied down before their pages are
  reused (write-back): to the first lower tier (host memory if there is one, else disk).
  Blocks the host pool evicts to make room go on to disk the same way.
- ``copy_down``: write-through of freshly published device blocks to every lower tier.
- ``start_promote`` / ``finish_promote``: lower-tier hits are copied into the device pages
  a request was given, through each tier's ``FetchSource`` (issue everything, let the
  caller compute, then wait, verify and land). Blocks that another data shard holds on
  device are copied with a collective. A block that fails, is missing or is late is marked
  on its fetch; ``drop_failed`` forgets the bad copy and every block chained after it.
- ``write_records`` / ``read_records``: the long-context path's private disk records.
Blocks are published in a lower tier only when their bytes are there: host slots when
the copy is dispatched (later reads are ordered after it), disk slots when the write has
committed. A slot in flight holds a reference, so eviction cannot reuse it meanwhile.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import buckets
from jaxkv import pages as pages_lib
from jaxkv.distributed import allgather_codes, local_data_shards, put_global, to_host
from jaxkv.index import LOCAL_TIERS, Tier
from jaxkv.stats import Stats
from jaxkv.tiers.base import (WRITE_FAILED, WRITE_OK, Breaker, Failure, Fetch, Landing,
                              Staged)

Block = tuple  # (shard, device page or host slot, key)
_FAILURES = list(Failure)


@dataclasses.dataclass
class _JobReads:
  """Disk fetches of a multi-process job: all of them, and the handle of this process's."""

  fetches: list
  handle: object


def _agree_reads(fetches: list[Fetch], local_shards: set[int]) -> list[Fetch]:
  """Sets one outcome on every fetch, the same on every process of a job (a collective): a
  block lands only if every process that read it verified it; a failure takes the first
  failing process's reason. Returns the fetches that landed (another process's shards'
  bytes are not needed here: zeros stand in for them)."""
  codes = [0 if f.shard not in local_shards else 1 if f.ok else 2 + _FAILURES.index(f.reason)
           for f in fetches]
  rows = allgather_codes(np.array(codes, np.int32))
  for f, column in zip(fetches, rows.T):
    failed = [c for c in column if c >= 2]
    f.ok = not failed and bool((column == 1).any())
    f.reason = None if f.ok else _FAILURES[failed[0] - 2] if failed else Failure.DEADLINE
  return [f for f in fetches if f.ok]


class TierMover:
  """Block movement and verification for one cache (its index, tiers and layout)."""

  def __init__(self, *, index, mesh, config, num_shards: int, payload_shape: tuple, host=None,
               disk=None, remote=None, stats: Stats | None = None):
    self.index, self.mesh, self.config = index, mesh, config
    self.num_shards, self.payload_shape = num_shards, tuple(payload_shape)
    self.host, self.disk, self.remote = host, disk, remote
    self.stats = stats if stats is not None else Stats()
    # Where fetches come from, in the order they are issued (disk reads first: in flight
    # longest) and waited for.
    self.sources = [t for t in (disk, host, remote) if t is not None]
    self._pending_writes: list = []
    self._writing: set[bytes] = set()  # keys of the disk writes in flight
    # A multi-process job shares one disk store: its processes take turns writing blocks
    # (each written once) and read the records their own devices need.
    self.processes, self.process = jax.process_count(), jax.process_index()
    self._next_writer = 0
    self._local_shards = local_data_shards(mesh, config.data_axis)
    # A disk store that keeps failing (3 batches of reads or writes in a row raising: it is
    # down or unreachable) is detached for a cool-down: no reads are planned from it and no
    # writes issued. Not in a job: a wall-clock cool-down would differ between its processes.
    self.disk_breaker = Breaker() if self.processes == 1 else None
    self.last_fetch: dict = {}
    self.ids_sharding = NamedSharding(mesh, P(config.data_axis, None))
    self.stack_sharding = NamedSharding(mesh, pages_lib.stacked_spec(config))

  # ---- helpers -----------------------------------------------------------------------------
  def _gather_device(self, pools, blocks: list) -> tuple[jax.Array, list[list]]:
    ids, per = buckets.shard_ids(blocks, self.num_shards, 0, lambda b: b[1])
    stack = pages_lib.gather_stacked(pools, jax.device_put(ids, self.ids_sharding),
                                     mesh=self.mesh, config=self.config)
    return stack, per

  def _bytes(self, n: int) -> int:
    return n * self.config.page_bytes

  def stage(self, items: list[Staged]) -> Landing:
    """Host bytes of blocks (``(shard, page, payload)``) as one device stack to land."""
    dest, per = buckets.shard_grid(items, self.num_shards, self.config.pages_per_shard)
    n = dest.shape[1]
    arrays, heads, page, dim = self.payload_shape
    bits = pages_lib.bits_dtype(self.config.jnp_dtype)
    stack = np.zeros((arrays, heads, self.num_shards * n, page, dim), bits)
    for s, its in enumerate(per):
      for i, (_, page_id, payload) in enumerate(its):
        stack[:, :, s * n + i] = payload.view(bits)
        dest[s, i] = page_id
    return Landing(dest, put_global(stack, self.stack_sharding))  # lands per shard

  def land(self, pools, landing: Landing):
    """Scatters a landing into the (donated) device pools; returns the new pools."""
    return pages_lib.scatter_stacked(pools, jax.device_put(landing.dest, self.ids_sharding),
                                     landing.stack, mesh=self.mesh, config=self.config)

  def warmup(self, pools, max_pages: int) -> list:
    """Compiles every transfer for each bucket up to ``max_pages`` pages per shard, with
    all-padding ids (nothing is read into or written over a page). Returns the pools."""
    shards = self.num_shards
    n = buckets.MIN_TRANSFER_PAGES
    while shards > 1:  # copies between shards (destinations all padding: dropped)
      src = np.zeros((n,), np.int32)
      dst = np.full((n,), shards * self.config.pages_per_shard, np.int32)
      pools = pages_lib.copy_across_shards(pools, src, dst, mesh=self.mesh, config=self.config)
      if n >= max_pages:
        break
      n *= 2
    if self.host is None and self.disk is None:
      return list(pools)
    n = buckets.MIN_TRANSFER_PAGES
    while True:
      pad_dev = jax.device_put(np.full((shards, n), self.config.pages_per_shard, np.int32),
                               self.ids_sharding)
      stack = pages_lib.gather_stacked(pools, jax.device_put(np.zeros((shards, n), np.int32),
                                                             self.ids_sharding),
                                       mesh=self.mesh, config=self.config)
      if self.host is not None:
        pad_host = np.full((shards, n), self.host.pages_per_shard, np.int32)
        self.host.store(stack, pad_host)
        stack, _ = self.host.load(np.zeros((shards, n), np.int32))
        self.host.read_numpy(np.zeros((shards, n), np.int32))
        self.host.expected_checksums(pad_host)
      pools = pages_lib.scatter_stacked(pools, pad_dev, stack, mesh=self.mesh,
                                        config=self.config)
      jax.block_until_ready(pools)
      if n >= max_pages:
        return list(pools)
      n *= 2

  # ---- downwards ---------------------------------------------------------------------------
  def _missing(self, blocks: list[Block], tier: Tier) -> list[Block]:
    """The blocks that have no copy in ``tier`` yet (disk slots are shared: shard 0)."""
    return [b for b in blocks
            if self.index.slot_of(0 if tier == Tier.DISK else b[0], b[2], tier) is None]

  def demote(self, pools, evicted: list[Block]) -> None:
    """Write-back of blocks just evicted from device pages (before the pages are reused):
    to the first lower tier."""
    if self.host is not None:
      self._device_to_host(pools, self._missing(evicted, Tier.HOST))
    elif self.disk is not None:
      self._device_to_disk(pools, self._missing(evicted, Tier.DISK))

  def copy_down(self, pools, published: list[Block]) -> None:
    """Write-through: copies freshly published device blocks to every lower tier."""
    if self.host is not None:
      self._device_to_host(pools, self._missing(published, Tier.HOST))
    if self.disk is not None:
      self._device_to_disk(pools, self._missing(published, Tier.DISK))

  def allocate_host(self, shard: int, n: int) -> list[int] | None:
    """``n`` host slots on ``shard`` (referenced); cached blocks evicted to make room go on
    to disk first. None when every slot is held."""
    evicted: list = []
    slots = self.index.allocate(shard, n, Tier.HOST, evicted=evicted)
    if evicted and self.disk is not None:  # read them out before they are overwritten
      self.host_to_disk(self._missing([(shard, p, k) for k, p in evicted], Tier.DISK))
    return slots

  def _device_to_host(self, pools, blocks: list[Block]) -> None:
    if not blocks:
      return
    placed, host_victims, overflow = [], [], []
    for b in blocks:
      evicted = []
      slot = self.index.allocate(b[0], 1, Tier.HOST, evicted=evicted)
      if slot is None:  # every host slot of this shard is taken by blocks in flight
        overflow.append(b)
        continue
      host_victims.extend((b[0], p, k) for k, p in evicted)
      placed.append((b[0], b[1], b[2], slot[0]))
    if self.disk is not None:
      self.host_to_disk(self._missing(host_victims, Tier.DISK))
      self._device_to_disk(pools, self._missing(overflow, Tier.DISK))
    else:
      self.stats.add("host_full_drops", len(overflow))
    if not placed:
      return
    stack, per = self._gather_device(pools, placed)
    host_ids = np.full((self.num_shards, stack.shape[2] // self.num_shards),
                       self.host.pages_per_shard, np.int32)
    for s, items in enumerate(per):
      host_ids[s, :len(items)] = [it[3] for it in items]
    self.host.store(stack, host_ids)
    for shard, _, key, slot in placed:
      self.index.publish(shard, slot, key, Tier.HOST, parent=self.index.parent_of(key))
      self.index.release(shard, [slot], Tier.HOST)
    self.stats.add("demoted_host", len(placed))
    self.stats.add("bytes_moved", self._bytes(len(placed)))

  def host_to_disk(self, blocks: list[Block]) -> None:
    """``blocks``: (shard, host slot, key) of host slots about to be overwritten."""
    if not blocks:
      return
    ids, per = buckets.shard_ids(blocks, self.num_shards, 0, lambda b: b[1])
    self._write_disk(self.host.read_numpy(ids), per, ids.shape[1])

  def _device_to_disk(self, pools, blocks: list[Block]) -> None:
    if not blocks:
      return
    stack, per = self._gather_device(pools, blocks)
    self._write_disk(to_host(stack), per, stack.shape[2] // self.num_shards)

  @property
  def disk_available(self) -> bool:
    """Whether the disk tier is attached (not cooling down after repeated failures)."""
    return self.disk is not None and (self.disk_breaker is None or self.disk_breaker.available)

  def _disk_outcome(self, ok: bool) -> None:
    if self.disk_breaker is not None:
      was = self.disk_breaker.available
      self.disk_breaker.record(ok)
      if was and not self.disk_breaker.available:
        self.stats.add("disk_detached")
        logging.warning("disk tier %s keeps failing: detached for %.0f s (requests recompute "
                        "what it holds meanwhile)", self.disk.kvstore,
                        self.disk_breaker.cool_down_s)

  def _write_disk(self, stack: np.ndarray, per: list[list], n: int) -> None:
    if not self.disk_available:
      self.stats.add("disk_detached_drops", sum(len(items) for items in per))
      return
    for s, items in enumerate(per):
      for i, b in enumerate(items):
        key = b[2]
        if self.index.slot_of(0, key, Tier.DISK) is not None or key in self._writing:
          continue  # on disk already, or being written (another shard's copy of it)
        slot = self.index.allocate(0, 1, Tier.DISK)
        if slot is None:
          self.stats.add("disk_full_drops")
          continue
        parent = self.index.parent_of(key)
        writer = self._next_writer % self.processes  # a job's processes take turns
        self._next_writer += 1
        if writer == self.process:
          payload = np.ascontiguousarray(stack[:, :, s * n + i]).view(self.config.jnp_dtype)
          self._pending_writes.append(self.disk.write(slot[0], payload, key, parent))
          self.stats.add("disk_writes")
        else:
          self._pending_writes.append(self.disk.claim(slot[0], key, parent))
        self._writing.add(key)
        self.stats.add("bytes_moved", self._bytes(1))
    self.pump()

  def pump(self) -> None:
    """Publishes disk writes that committed (after one flush of the batch to the device);
    releases the slots of failed ones. In a job, every process publishes the same writes at
    the same call: each reports the outcome of its own writes and all take the writer's word
    (a collective, at deterministic points, when writes are pending)."""
    if not self._pending_writes:
      return
    self._settle_own_writes()
    codes = np.array([w.code for w in self._pending_writes], np.int32)
    if self.processes > 1:
      codes = allgather_codes(codes).sum(axis=0)  # only a write's writer reports it
    still, published, failed = [], 0, 0
    for w, code in zip(self._pending_writes, codes):
      if code == 0:  # not finished yet
        still.append(w)
        continue
      self._writing.discard(w.key)
      failed += code != WRITE_OK
      if code == WRITE_OK:
        self.index.publish(0, w.slot, w.key, Tier.DISK, parent=w.parent)
        published += 1
      else:
        self.stats.add("disk_write_failures")
      self.index.release(0, [w.slot], Tier.DISK)
    self._pending_writes = still
    self.stats.add("demoted_disk", published)
    if published or failed:
      self._disk_outcome(published > 0)  # one outcome per batch that finished

  def _settle_own_writes(self) -> None:
    """Sets ``code`` on this process's writes that finished; the committed ones are made
    durable first, with one flush for all of them."""
    done = [w for w in self._pending_writes
            if w.future is not None and not w.code and w.future.done()]
    committed = []
    for w in done:
      try:
        w.future.result(timeout=0)
        committed.append(w)
      except Exception:  # pylint: disable=broad-except  (a failed write: never published)
        w.code = WRITE_FAILED
    if not committed:
      return
    try:
      self.disk.sync()
      ok = WRITE_OK
      self.stats.add("disk_syncs")
    except OSError:
      ok = WRITE_FAILED
    for w in committed:
      w.code = ok

  @property
  def writes_in_flight(self) -> int:
    return len(self._pending_writes)

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits (up to ``timeout_s``) for every disk write; returns how many are left."""
    t_end = time.monotonic() + timeout_s
    for w in self._pending_writes:
      try:
        if w.future is not None:
          w.future.result(timeout=max(0.0, t_end - time.monotonic()))
      except Exception:  # pylint: disable=broad-except  (handled in pump)
        pass
    self.pump()
    return len(self._pending_writes)

  # ---- upwards -----------------------------------------------------------------------------
  def promote(self, pools, fetches: list[Fetch], deadline_s: float):
    """Copies lower-tier blocks into device pages and verifies them. Returns new pools."""
    pools, pending = self.start_promote(pools, fetches)
    return self.finish_promote(pools, pending, time.monotonic() + deadline_s)

  def start_promote(self, pools, fetches: list[Fetch]):
    """Issues every fetch without waiting. Returns ``(pools, pending)``; compute
    dispatched meanwhile overlaps the reads and copies."""
    t0 = time.perf_counter()
    started = []
    for source in self.sources:
      mine = [f for f in fetches if f.tier == source.tier]
      if mine and source.tier == Tier.DISK and self.processes > 1:
        # A job: each process reads what its own devices need; outcomes agreed later.
        _, handle = source.start_fetch([f for f in mine if f.shard in self._local_shards])
        started.append((source, _JobReads(mine, handle)))
      elif mine:
        landing, handle = source.start_fetch(mine)
        if landing is not None:
          pools = self.land(pools, landing)
        started.append((source, handle))
    shard = [f for f in fetches if f.tier == Tier.SHARD]
    if shard:  # device to device inside the job: a collective, no verification needed
      pools = self._promote_shard(pools, shard)
    return pools, (fetches, started, t0)

  def _promote_shard(self, pools, fetches: list[Fetch]):
    per_shard = self.config.pages_per_shard
    n = buckets.transfer_pages(len(fetches))
    src = np.zeros((n,), np.int32)
    dst = np.full((n,), self.num_shards * per_shard, np.int32)  # padding: dropped
    for i, f in enumerate(fetches):
      src_shard, src_page = f.slot
      src[i], dst[i] = src_shard * per_shard + src_page, f.shard * per_shard + f.page
      f.ok = True
    return pages_lib.copy_across_shards(pools, src, dst, mesh=self.mesh, config=self.config)

  def _finish_job_reads(self, source, reads: "_JobReads", t_end: float) -> Landing | None:
    """Waits for this process's reads, then agrees on every fetch's outcome with the job's
    other processes (``_agree_reads``) and lands the blocks all agree on."""
    payloads = {}

    def collect(items: list[Staged]) -> None:
      payloads.update({(shard, page): payload for shard, page, payload in items})

    source.finish_fetch(reads.handle, t_end, collect)
    zeros = np.zeros(self.payload_shape, self.config.jnp_dtype)
    items = [(f.shard, f.page, payloads.get((f.shard, f.page), zeros))
             for f in _agree_reads(reads.fetches, self._local_shards)]
    return self.stage(items) if items else None

  def release_pin(self, f: Fetch) -> None:
    """Drops the reference a fetch took at admission on its source."""
    if f.tier == Tier.SHARD:
      self.index.release(f.slot[0], [f.slot[1]], Tier.DEVICE)
    elif f.tier in LOCAL_TIERS:
      self.index.release(f.shard, [f.slot], f.tier)

  def finish_promote(self, pools, pending, t_end: float):
    """Waits (until ``t_end``, monotonic) for the fetches of ``start_promote``, verifies
    and lands them. Sets ``ok``/``reason`` on every fetch; the caller truncates each
    request's hit at its first failed block and calls ``drop_failed``."""
    fetches, started, t_start = pending
    t_wait = time.perf_counter()
    for source, handle in started:
      if isinstance(handle, _JobReads):
        landing = self._finish_job_reads(source, handle, t_end)
      else:
        landing = source.finish_fetch(handle, t_end, self.stage)
      if source.tier == Tier.DISK:  # the store answered (bad bytes are answers too), or raised
        self._disk_outcome(any(f.reason not in (Failure.READ_RETRY, Failure.READ_ERROR)
                               for f in fetches if f.tier == Tier.DISK))
      if landing is not None:
        pools = self.land(pools, landing)
    jax.block_until_ready(pools)
    t_done = time.perf_counter()
    self.stats.add("fetch_wait_s", t_done - t_wait)
    self.stats.add("fetch_s", t_done - t_start)
    for f in fetches:
      self.release_pin(f)  # the pin taken at admission
    ok = sum(f.ok for f in fetches)
    self.stats.add("blocks_fetched", ok)
    self.stats.add("bytes_moved", self._bytes(ok))
    self.last_fetch = {"blocks": ok, "bytes": self._bytes(ok), "seconds": t_done - t_start,
                       "tiers": sorted({int(f.tier) for f in fetches})}
    return pools

  def drop_failed(self, fetch: Fetch) -> None:
    """Records a failed fetch and drops the bad copy and the chain after it."""
    self.stats.failures[fetch.reason.value] += 1
    self.stats.add("verify_failures", fetch.reason.corrupt)
    self.stats.add("read_timeouts", fetch.reason == "deadline")
    if fetch.tier == Tier.REMOTE:
      self.stats.add("remote_failures")
      return  # nothing of ours to drop: the peer's copy is the peer's
    if fetch.reason == "read_retry":
      return  # the record stays, and so does its chain: the next lookup reads it again
    shard = 0 if fetch.tier == Tier.DISK else fetch.shard
    self.index.drop_chain(shard, fetch.key, fetch.tier)
    if fetch.tier == Tier.DISK:
      if fetch.reason == "gone":
        self.disk.forget(fetch.slot)  # someone else's eviction: nothing left to delete
      elif fetch.reason != "deadline":
        self.disk.delete(fetch.slot)

  # ---- records of the long-context path ----------------------------------------------------
  def write_records(self, slots: list[int], payloads: list[np.ndarray], keys: list[bytes],
                    deadline_s: float) -> None:
    """Writes private disk records and waits until each has committed (raises if one
    fails or misses the deadline): a streamed page must be durable before it is used."""
    writes = [self.disk.write(s, p, k, None) for s, p, k in zip(slots, payloads, keys)]
    t_end = time.monotonic() + deadline_s
    for w in writes:
      w.future.result(timeout=max(0.0, t_end - time.monotonic()))
    self.disk.sync()

  def read_records(self, slots: list[int], keys: list[bytes], deadline_s: float
                   ) -> list[np.ndarray]:
    """Reads and verifies private disk records (all in flight at once) within the deadline."""
    return self.disk.read_verified(slots, keys, time.monotonic() + deadline_s)
