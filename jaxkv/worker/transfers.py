"""TierMover: moves blocks between device, host and disk, and verifies what comes back.

It is called from one thread, always in the same order for the same work, so every
transfer is issued deterministically (multi-host jobs need that). Device and host
transfers are asynchronous JAX dispatches ordered by data dependencies: a gather that
reads a device page is dispatched before any step that overwrites it. Disk I/O runs on
TensorStore futures. Every wait on a tier happens through this module, with a deadline.

Moves
- ``carry_out``: copies down, every destination chosen by the manager
  (``CacheManager.resolve``, ``jaxkv.manager.copies``): evicted or freshly published device
  blocks into the host slots it took; the host blocks those slots held read out first to the
  disk slots it took and to the pool (one read for both; the pool's puts are written behind
  by its own thread); device blocks that go below the host directly the same way. The mover
  takes no slot and evicts nothing: it copies and reports (``copied``, ``copy_failed``).
- ``start_promote`` / ``finish_promote``: lower-tier hits are copied into the device pages
  a request was given, through each tier's ``FetchSource`` (issue everything, let the
  caller compute, then wait, verify and land). Blocks that another data shard holds on
  device are copied with a collective. ``start_promote`` returns a ``PendingFetch``;
  ``finish_promote`` counts each failure and returns the ``FetchReport`` (one ``Failure``
  or None per fetch). The scheduler hands the report to the manager, which releases the
  fetches' pins and forgets each failed copy's chain; the disk records of that chain come
  back as the next step's ``TierOrders.drop`` (``delete_records``). A promotion that will
  never be finished (its step failed) is given up with ``abandon``, which releases its pins.
- ``write_records`` / ``read_records`` / ``delete_records``: the long-context path's private
  disk records, and the records of dropped chains.
Blocks are published in a lower tier only when their bytes are there: host slots when
the copy is dispatched (later reads are ordered after it), disk slots when the write has
committed (``jaxkv.worker.journal``). A slot in flight holds the reference the manager took
when it chose it, so eviction cannot reuse it meanwhile. In a multi-process job each process reads the disk records (and pulls the
remote blocks) its own devices need, and the outcomes are agreed
(``distributed.agree_reads``) before anything lands.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import buckets
from jaxkv import distributed
from jaxkv.worker import pages as pages_lib
from jaxkv.distributed import local_data_shards, put_global, to_host
from jaxkv.errors import InvariantError
from jaxkv.manager.index import Tier
from jaxkv.worker.journal import DEFAULT_QUEUE_BYTES, DiskJournal
from jaxkv.scheduling.step import TierOrders
from jaxkv.stats import Stats
from jaxkv.worker.tiers.base import Failure, Fetch, FetchReport, FetchSource, Landing, Staged

Block = tuple  # (shard, device page or host slot, key)
# A read's outcome as ``distributed.agree_reads`` takes it: 1 verified, 2 + i failure i.
_VERIFIED = 1
_FAILURES = list(Failure)


def _read_code(failure: Failure | None) -> int:
  return _VERIFIED if failure is None else 2 + _FAILURES.index(failure)


def _failure_of_code(code: int) -> Failure | None:
  return None if code == _VERIFIED else _FAILURES[code - 2]


def agreed_reads(source, handle, fetches: list[Fetch], t_end: float, stage,
                 local_shards, zeros: np.ndarray
                 ) -> tuple[Landing | None, tuple[Failure | None, ...]]:
  """A job's reads of one source (``source.start_fetch`` was given those of this process's
  ``local_shards``): this process verified those; the job agrees on every outcome (a
  collective), and ``stage`` gets what all agree on, ``zeros`` standing in for another
  process's shards' bytes (not needed here). Returns ``(landing, each read's failure)``."""
  payloads = {}

  def keep(items: list[Staged]) -> None:
    payloads.update({(shard, page): payload for shard, page, payload in items})

  local = iter(source.finish_fetch(handle, t_end, keep).failures)
  codes = [_read_code(next(local)) if f.shard in local_shards else 0 for f in fetches]
  agreed = distributed.agree_reads(np.array(codes, np.int32),
                                   unread=_read_code(Failure.DEADLINE))
  failures = tuple(_failure_of_code(int(c)) for c in agreed)
  items = [(f.shard, f.page, payloads.get((f.shard, f.page), zeros))
           for f, failure in zip(fetches, failures) if failure is None]
  return (stage(items) if items else None), failures


@dataclasses.dataclass(frozen=True)
class _Reads:
  """One tier's reads of a promotion: its handle, and the positions of its fetches in
  ``PendingFetch.fetches``. ``agreed``: a job's disk or remote reads, this process issued
  only those of its own shards and the job agrees on every outcome."""

  source: FetchSource
  handle: Any
  positions: tuple[int, ...]
  agreed: bool = False


@dataclasses.dataclass(frozen=True)
class PendingFetch:
  """A promotion in flight (``TierMover.start_promote``). Hand it back exactly once:
  to ``finish_promote``, or to ``abandon`` when it will never be finished.

  ``fetches``: what was asked for, in the caller's order (a ``FetchReport`` keeps it).
  ``t_start``: when the reads were issued (``time.perf_counter``).
  """

  fetches: tuple[Fetch, ...]
  t_start: float
  reads: tuple[_Reads, ...]
  landed: tuple = ()  # device stacks already landing (the host tier's async copies)


class TierMover:
  """Block movement and verification for one cache (its tiers and layout). What its
  copies do is reported to the cache's ``manager`` (slots taken, copies published or
  dropped); it reads the manager's index, and changes it only through those reports."""

  def __init__(self, *, manager, mesh, config, num_shards: int, payload_shape: tuple,
               host=None, disk=None, remote=None, pool=None, stats: Stats | None = None,
               disk_queue_bytes: int = DEFAULT_QUEUE_BYTES):
    self.manager, self.index = manager, manager.index  # the index: read only
    self.mesh, self.config = mesh, config
    self.num_shards, self.payload_shape = num_shards, tuple(payload_shape)
    self.host, self.disk, self.remote, self.pool = host, disk, remote, pool
    self.stats = stats if stats is not None else Stats()
    # Where fetches come from, in the order they are issued (disk reads first: in flight
    # longest) and waited for.
    self.sources = [t for t in (disk, host, pool, remote) if t is not None]
    # The disk writes in flight and the disk store's health (None without a disk tier).
    self.journal = (DiskJournal(manager=manager, disk=disk, stats=self.stats,
                                page_bytes=config.page_bytes, dtype=config.jnp_dtype,
                                queue_bytes=disk_queue_bytes)
                    if disk is not None else None)
    # A multi-process job shares one disk store: its processes take turns writing blocks
    # (each written once) and read the records their own devices need.
    self.processes = jax.process_count()
    self.process = jax.process_index()
    if pool is not None:
      pool.in_job = self.processes > 1
    self._local_shards = local_data_shards(mesh, config.data_axis)
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

  def stage(self, items: list[Staged], *, payload_shape: tuple | None = None,
            drop: int | None = None) -> Landing:
    """Host bytes of blocks (``(shard, page, payload)``) as one device stack to land.
    ``payload_shape`` and ``drop`` (the page id padding lands on): those of another pool
    than the blocks' (the window group's)."""
    dest, per = buckets.shard_grid(items, self.num_shards,
                                   self.config.pages_per_shard if drop is None else drop)
    n = dest.shape[1]
    arrays, heads, page, dim = payload_shape or self.payload_shape
    bits = pages_lib.bits_dtype(self.config.jnp_dtype)
    stack = np.zeros((arrays, heads, self.num_shards * n, page, dim), bits)
    for s, its in enumerate(per):
      for i, (_, page_id, payload) in enumerate(its):
        stack[:, :, s * n + i] = payload.view(bits)
        dest[s, i] = page_id
    return Landing(dest, put_global(stack, self.stack_sharding))  # lands per shard

  def land(self, pools, landing: Landing):
    """Scatters a landing into the (donated) device pools; returns the new pools."""
    dest = jax.device_put(landing.dest, self.ids_sharding)
    if landing.blocks:
      return pages_lib.scatter_blocks_fn(self.mesh, self.config, pages_lib.pool_ranks(pools))(
          tuple(pools), dest, landing.stack)
    return pages_lib.scatter_stacked(pools, dest, landing.stack, mesh=self.mesh,
                                     config=self.config)

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
    if self.host is None and self.disk is None and self.pool is None and self.remote is None:
      return list(pools)  # (a peer's blocks land like the disk's and the pool's: staged)
    if self.host is not None:
      # Its moves' buckets (1, 2, 4, ...) and their landings, up to its slots per shard: a
      # move of more goes in pieces of the largest (``HostTier.warm`` sets it), and one move
      # fills or reads at most that many slots of a shard.
      for size in self.host.warm(pools, min(max_pages, self.host.pages_per_shard)):
        blocks, sums = self.host.load_blocks(np.zeros((shards, size), np.int32))
        distributed.warm_gathers(blocks, sums)  # (a job's reads of them: to_host)
        pad = np.full((shards, size), self.config.pages_per_shard, np.int32)
        pools = self.land(pools, Landing(pad, blocks, blocks=True))
    n = buckets.MIN_TRANSFER_PAGES
    while True:
      pad_dev = jax.device_put(np.full((shards, n), self.config.pages_per_shard, np.int32),
                               self.ids_sharding)
      stack = pages_lib.gather_stacked(pools, jax.device_put(np.zeros((shards, n), np.int32),
                                                             self.ids_sharding),
                                       mesh=self.mesh, config=self.config)
      if self.disk is not None or self.pool is not None:  # device blocks written below
        distributed.warm_gathers(stack)
      if self.host is not None:  # restores and staged streams store whole stacks
        pad_host = np.full((shards, n), self.host.pages_per_shard, np.int32)
        self.host.store(stack, pad_host)
        self.host.expected_checksums(pad_host)
      pools = pages_lib.scatter_stacked(pools, pad_dev, stack, mesh=self.mesh,
                                        config=self.config)
      jax.block_until_ready(pools)
      if n >= max_pages:
        return list(pools)
      n *= 2

  # ---- downwards: resolved orders only ------------------------------------------------------
  def carry_out(self, pools, orders: TierOrders, *, later: bool = False):
    """Carries out orders whose every destination the manager chose
    (``CacheManager.resolve``), in the order their bytes need: disk records deleted; host
    blocks about to be overwritten and device blocks going below the host gathered (the
    copies issued, not waited for); device blocks stored into their host slots (published
    once the copy is dispatched: later reads are ordered after it); then the gathered bytes
    written to the disk slots and the pool, and the disk journal pumped. Every slot the
    orders took is reported to the manager, copied or failed, on every path.

    ``later``: the writes below the host are not waited for here: the returned function
    does them (call it exactly once, after dispatching the step whose pages these were, so
    the step runs while the bytes come off the device). In a multi-process job they are
    done here all the same (the journal agrees on its writes with a collective, which must
    not run beside a step's), and the function returned does nothing. Without ``later``:
    None."""
    if not orders.resolved:
      raise InvariantError("TierOrders reached the worker without destinations: the "
                           "manager resolves them (CacheManager.resolve) when the plan is made.")
    if orders.drop:
      self.delete_records(list(orders.drop))
    disk_slots = dict(orders.to_disk)  # the journal takes each slot it writes
    pool_keys = set(orders.to_pool)
    host_copies, writes = list(orders.to_host), []
    try:
      if self._wanted(orders.host_out, disk_slots, pool_keys):  # read before the stores
        ids, per = buckets.shard_ids(list(orders.host_out), self.num_shards, 0, lambda b: b[1])
        writes.append((self.host.read_later(ids), per, ids.shape[1]))
      if self._wanted(orders.device_out, disk_slots, pool_keys):
        stack, per = self._gather_device(pools, list(orders.device_out))
        writes.append((lambda stack=stack: to_host(stack), per,
                       stack.shape[2] // self.num_shards))
      if host_copies:
        # One program per bucket: gathered on device, sent to the slots (no host computation).
        self.host.store_pages(pools, [(c.shard, c.src, c.dst) for c in host_copies])
        for c in host_copies:
          self.manager.copied(c.shard, c.dst, c.key, Tier.HOST)
        self.stats.add("demoted_host", len(host_copies))
        self.stats.add("bytes_moved", self._bytes(len(host_copies)))
        host_copies = []
    except BaseException:
      self._give_back(host_copies, disk_slots)
      raise

    def finish() -> None:
      try:
        for read, per, n in writes:
          self._write_down(read, per, n, disk_slots, pool_keys)
      finally:
        self._give_back([], disk_slots)
      if orders.pump:
        self.pump()

    if later and self.processes == 1:
      return finish
    finish()
    return (lambda: None) if later else None

  def _give_back(self, host_copies: list, disk_slots: dict) -> None:
    """Slots the orders took and no copy filled go back empty."""
    for c in host_copies:
      self.manager.copy_failed(c.shard, c.dst, c.key, Tier.HOST)
    for key, slot in disk_slots.items():
      self.manager.copy_failed(0, slot, key, Tier.DISK)
    disk_slots.clear()

  @staticmethod
  def _wanted(blocks, disk_slots: dict, pool_keys: set) -> bool:
    """Whether any of ``blocks`` goes to disk or the pool (else nothing is read)."""
    return any(b[2] in disk_slots or b[2] in pool_keys for b in blocks)

  def _write_down(self, read, per: list[list], n: int, disk_slots: dict,
                  pool_keys: set) -> None:
    """The raw bits ``read()`` of blocks ``per[s][i]`` (row ``s * n + i``) to the disk
    journal (those ``disk_slots`` names: it takes their slots) and the pool (those in
    ``pool_keys`` it has not been given lately; in a job each block is put by one
    process). Nothing is read when neither wants a block."""
    keys = [b[2] for blocks in per for b in blocks]
    pool_keys = ({k for k in keys if k in pool_keys and not self.pool.recently_put(k)}
                 if self.pool is not None else set())
    if not pool_keys and not any(k in disk_slots for k in keys):
      return
    stack = read()
    if self.journal is not None:
      self.journal.write(stack, per, n, disk_slots)
    if not pool_keys:
      return
    self.pool.note(sorted(pool_keys))  # every process notes every key, in one order
    items = []
    for s, blocks in enumerate(per):
      for i, b in enumerate(blocks):
        key = b[2]
        if key not in pool_keys or (
            self.processes > 1 and int.from_bytes(key[:4], "little") % self.processes
            != self.process):
          continue
        payload = np.ascontiguousarray(stack[:, :, s * n + i]).view(self.config.jnp_dtype)
        items.append((key, self.index.parent_of(key), payload, self.index.reuses(key) >= 1))
    self.pool.put(items)

  # ---- the disk journal (``jaxkv.worker.journal``) ------------------------------------------------
  @property
  def disk_available(self) -> bool:
    """Whether the disk tier is attached (not cooling down after repeated failures)."""
    return self.journal is not None and self.journal.available

  @property
  def writes_in_flight(self) -> int:
    """Disk writes issued and not yet published or given up."""
    return self.journal.writes_in_flight if self.journal is not None else 0

  def pump(self) -> None:
    """Publishes the disk writes that committed; never blocks (``DiskJournal.pump``)."""
    if self.journal is not None:
      self.journal.pump()

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits (up to ``timeout_s``) for every disk write; returns how many are left."""
    return self.journal.flush(timeout_s) if self.journal is not None else 0

  # ---- upwards -----------------------------------------------------------------------------
  def start_promote(self, pools, fetches) -> tuple[list, PendingFetch]:
    """Issues every fetch without waiting. Returns ``(pools, pending)``; compute
    dispatched meanwhile overlaps the reads and copies. Each fetch holds a pin on its
    source (taken at admission) until ``finish_promote`` or ``abandon`` releases it."""
    t0 = time.perf_counter()
    fetches = tuple(fetches)
    served = {source.tier for source in self.sources} | {Tier.SHARD}
    stray = sorted({int(f.tier) for f in fetches} - {int(t) for t in served})
    if stray:
      raise InvariantError(f"fetches from tiers {stray} but this cache's tiers are "
                           f"{sorted(int(t) for t in served)}: admission placed a hit in a "
                           "tier the cache does not have.")
    reads, landed = [], []
    for source in self.sources:
      positions = tuple(i for i, f in enumerate(fetches) if f.tier == source.tier)
      if not positions:
        continue
      mine = [fetches[i] for i in positions]
      if source.tier in (Tier.DISK, Tier.REMOTE, Tier.POOL) and self.processes > 1:
        # A job: each process reads what its own devices need; outcomes agreed later.
        _, handle = source.start_fetch([f for f in mine if f.shard in self._local_shards])
        reads.append(_Reads(source, handle, positions, agreed=True))
      else:
        landing, handle = source.start_fetch(mine)
        for part in ([] if landing is None else
                     landing if isinstance(landing, list) else [landing]):
          pools = self.land(pools, part)
          landed.append(part.stack)
        reads.append(_Reads(source, handle, positions))
    shard = [f for f in fetches if f.tier == Tier.SHARD]
    if shard:  # device to device inside the job: a collective, no verification needed
      pools = self._promote_shard(pools, shard)
    return pools, PendingFetch(fetches, t0, tuple(reads), tuple(landed))

  def _promote_shard(self, pools, fetches: list[Fetch]):
    per_shard = self.config.pages_per_shard
    n = buckets.transfer_pages(len(fetches))
    src = np.zeros((n,), np.int32)
    dst = np.full((n,), self.num_shards * per_shard, np.int32)  # padding: dropped
    for i, f in enumerate(fetches):
      src_shard, src_page = f.slot
      src[i], dst[i] = src_shard * per_shard + src_page, f.shard * per_shard + f.page
    return pages_lib.copy_across_shards(pools, src, dst, mesh=self.mesh, config=self.config)

  def read(self, source, fetches: list[Fetch], t_end: float, *,
           payload_shape: tuple | None = None, drop: int | None = None
           ) -> tuple[Landing | None, tuple[Failure | None, ...]]:
    """Reads ``fetches`` from ``source`` outside a promotion (a window group's loads from
    the pool) and waits for them (up to ``t_end``, monotonic): ``(what to land, each read's
    failure)``, staged with ``payload_shape`` and ``drop`` (``stage``). In a job each
    process reads its own shards' and the job agrees on every outcome, as a promotion's."""
    stage = functools.partial(self.stage, payload_shape=payload_shape, drop=drop)
    if self.processes == 1:
      _, handle = source.start_fetch(list(fetches))
      outcome = source.finish_fetch(handle, t_end, stage)
      return outcome.landing, outcome.failures
    _, handle = source.start_fetch([f for f in fetches if f.shard in self._local_shards])
    return agreed_reads(source, handle, list(fetches), t_end, stage, self._local_shards,
                        np.zeros(payload_shape or self.payload_shape, self.config.jnp_dtype))

  def _finish_reads(self, reads: _Reads, fetches: tuple[Fetch, ...], t_end: float
                    ) -> tuple[Landing | None, tuple[Failure | None, ...], float | None,
                               float | None]:
    """Waits for one tier's reads; returns what to land, each read's failure, when the
    bytes had arrived (``FetchOutcome.arrived``; None: now) and the link's round trip
    (``FetchOutcome.latency_s``; None: not measured)."""
    if not reads.agreed:
      outcome = reads.source.finish_fetch(reads.handle, t_end, self.stage)
      return outcome.landing, outcome.failures, outcome.arrived, outcome.latency_s
    # A job's disk, remote or pool reads: agreed by every process.
    landing, failures = agreed_reads(
        reads.source, reads.handle, [fetches[i] for i in reads.positions], t_end, self.stage,
        self._local_shards, np.zeros(self.payload_shape, self.config.jnp_dtype))
    return landing, failures, None, None

  def finish_promote(self, pools, pending: PendingFetch, t_end: float
                     ) -> tuple[list, FetchReport]:
    """Waits (until ``t_end``, monotonic) for the fetches of ``start_promote``, verifies
    and lands them, and counts each failure. Returns ``(pools, report)``: the scheduler
    truncates each request's hit at its first failed block, and the manager releases the
    pins and forgets the failed chains (``CacheManager.fetched``)."""
    fetches = pending.fetches
    failures: list[Failure | None] = [None] * len(fetches)  # SHARD copies cannot fail
    t_wait = time.perf_counter()
    arrived = list(pending.landed)
    waited = False  # a tier that gave no arrival time: the bytes count from now
    t_bytes = pending.t_start
    latency = 0.0
    for reads in pending.reads:
      landing, got, t_arrived, trip = self._finish_reads(reads, fetches, t_end)
      latency = max(latency, trip or 0.0)
      if t_arrived is None:
        waited = True
      else:
        t_bytes = max(t_bytes, t_arrived)
      for i, failure in zip(reads.positions, got):
        failures[i] = failure
      if reads.source.tier == Tier.DISK:  # the store answered (bad bytes are answers too)
        unanswered = (Failure.READ_RETRY, Failure.READ_ERROR, Failure.DEADLINE)
        self.journal.record(any(failure not in unanswered for failure in got),
                            hung=bool(got) and all(f == Failure.DEADLINE for f in got))
      if landing is not None:
        pools = self.land(pools, landing)
        arrived.append(landing.stack)
    # Done when the bytes are on the device: the scatters into the pools are ordered after
    # any step already dispatched, and waiting for them would time that compute too (the
    # link's speed is learned from these seconds). Copies across shards live only in the
    # pools, ordered after that compute: they are not waited for, nor timed (seconds 0).
    jax.block_until_ready(arrived)
    t_done = time.perf_counter()
    # A read that ended while the step computed (a split's front) is timed to its end, not
    # to when this call came to wait: else the link looks as slow as the compute.
    t_link = t_done if waited or not pending.reads else t_bytes
    seconds = t_link - pending.t_start if arrived else 0.0
    self.stats.add("fetch_wait_s", t_done - t_wait)
    self.stats.add("fetch_s", t_done - pending.t_start)
    for f, failure in zip(fetches, failures):
      if failure is not None:
        self._count_failure(f, failure)
    ok = sum(failure is None for failure in failures)
    self.stats.add("blocks_fetched", ok)
    self.stats.add("bytes_moved", self._bytes(ok))
    return pools, FetchReport(fetches=fetches, failures=tuple(failures), blocks=ok,
                              bytes=self._bytes(ok), seconds=seconds,
                              tiers=tuple(sorted({int(f.tier) for f in fetches})),
                              latency_s=latency)

  def abandon(self, pending: PendingFetch) -> None:
    """Gives up a promotion that will never be finished (its step failed): releases the
    pin of every fetch. Reads still in flight complete into nothing."""
    for f in pending.fetches:
      self.manager.release_pin(f)

  def _count_failure(self, fetch: Fetch, reason: Failure) -> None:
    self.stats.failures[reason.value] += 1
    self.stats.add("verify_failures", reason.corrupt)
    self.stats.add("read_timeouts", reason == Failure.DEADLINE)
    self.stats.add("remote_failures", fetch.tier == Tier.REMOTE)
    self.stats.add("pool_failures", fetch.tier == Tier.POOL)

  # ---- records of the long-context path ----------------------------------------------------
  def write_records(self, payloads: list[np.ndarray], keys: list[bytes],
                    deadline_s: float) -> None:
    """Writes private disk records (named by ``keys``, in slots the caller took with
    ``allocate_disk``) and waits until each has committed (raises if one fails or misses
    the deadline): a streamed page must be durable before it is used."""
    writes = [self.disk.write(k, p, None) for p, k in zip(payloads, keys)]
    t_end = time.monotonic() + deadline_s
    for w in writes:
      w.result(timeout=max(0.0, t_end - time.monotonic()))
    self.disk.sync()

  def read_records(self, keys: list[bytes], deadline_s: float) -> list[np.ndarray]:
    """Reads and verifies private disk records (all in flight at once) within the deadline."""
    return self.disk.read_verified(keys, time.monotonic() + deadline_s)

  def delete_records(self, keys: list[bytes]) -> None:
    """Removes disk records (best effort): a stream's private ones (their slots are the
    caller's to release), or those of a chain the manager forgot (``TierOrders.drop``)."""
    for key in keys:
      self.disk.delete(key)
