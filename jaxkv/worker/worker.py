"""CacheWorker: the device side of a ``KVCache``, the one owner of what holds cached bytes.

It holds the device page pools, the lower tiers (host pool, disk store, remote peers) and
the ``TierMover`` (with its disk journal) that moves blocks between them. Every writer of a
page goes through one of its verbs (``run`` a model step, ``start_promote`` /
``finish_promote`` a fetch group, ``land`` staged blocks, ``warm_moves``), the only callers
of ``update_pools``; the window group's copies below the device (``windows``, a
``WindowTiers``) write its pools through ``land_windows``. Tier work arrives as resolved
``TierOrders`` (``carry_out``): every destination slot chosen by the manager, from a step
plan or from a writer outside one (offload, a streamed sequence, a restore), so the worker
copies and reports and decides nothing. It never writes the index: the blocks a store
holds at open come back as values, a copy down that filled a slot is reported to the
host-side ``CacheManager`` (which publishes), and a fetch that failed verification comes
back in the step's result, which the scheduler settles through the manager.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import numpy as np
from absl import logging
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv.config import CacheConfig, TierConfig
from jaxkv.errors import InputError
from jaxkv.manager import POOL_PEER
from jaxkv.manager.windows import window_blocks, window_key
from jaxkv.stats import Stats
from jaxkv.worker import pages as pages_lib
from jaxkv.worker.transfers import TierMover
from jaxkv.worker.window_tiers import WindowTiers


class CacheWorker:
  """The device pools, the tiers and the mover of one cache."""

  def __init__(self, config: CacheConfig, tiers: TierConfig, mesh: Mesh, *, manager,
               stats: Stats, key: bytes | None, encrypt: bool):
    self.config, self.tiers, self.mesh = config, tiers, mesh
    self.num_shards = pages_lib.data_shards(mesh, config)
    self._manager, self._stats, self._key, self._encrypt = manager, stats, key, encrypt
    self.host = self.disk = self.remote = self.pool = self.mover = None
    self.window_pool = None  # the pool, for a window group's blocks (``open``)
    self.window_remote = None  # the remote peers, for a window group's blocks (``open``)
    self.window_disk = None  # the disk store, for a window group's records
    self.window_records_found: list = []  # keys of those an earlier run left (``open``)
    self.remotes: list = []
    if tiers.host_enabled:
      from jaxkv.worker.tiers.host import HostTier
      self.host = HostTier(mesh, config, tiers, self.num_arrays)
    # The window group's kept blocks in host memory (jaxkv.manager.windows: what it evicts
    # from the device keeps a copy here): a host pool of its own, of the window layers. In
    # a job its loads' checks agree by construction, as the host tier's do: every process
    # reads every checksum (``to_host``, a collective at the same point of the same plan).
    self.window_host = None
    if tiers.host_window_pages_per_shard and config.has_windows:
      from jaxkv.worker.tiers.host import HostTier
      self.window_host = HostTier(
          mesh, config, dataclasses.replace(
              tiers, host_pages_per_shard=tiers.host_window_pages_per_shard),
          2 * config.window_layers)
    self.windows = WindowTiers(self, stats)  # the window group's moves to and from them
    if tiers.disk_enabled:
      from jaxkv.worker.tiers.disk import DiskTier
      self.disk = DiskTier(tiers.disk_kvstore, num_slots=tiers.disk_pages,
                           payload_shape=self.payload_shape, dtype=config.jnp_dtype,
                           fingerprint=config.fingerprint(), key=key, encrypt=encrypt)
      if config.has_windows and tiers.store_windows:
        # Each finished sequence's last window goes there too, as records of the window
        # layers under a fingerprint of their own (``jaxkv.manager.windows``).
        self.window_disk = self.disk.scratch(
            window_key(config.fingerprint()),
            tiers.disk_window_pages or tiers.disk_pages,
            payload_shape=(2 * config.window_layers, *self.payload_shape[1:]))
    self.disk_recovered = {"adopted": 0, "deleted": 0, "temporaries": 0}
    self._pools = None  # the device pools, flat (leaves of the model's KVPages state)
    self.pool_def = None  # their tree structure
    self._row_shardings: dict = {}

  @property
  def num_arrays(self) -> int:
    """Page arrays the model holds: K and V of every layer."""
    return 2 * self.config.num_layers

  @property
  def payload_shape(self) -> tuple[int, int, int, int]:
    """One block outside device memory: ``[2 * layers, kv_heads, page_size, head_dim]``."""
    c = self.config
    return (self.num_arrays, c.num_kv_heads, c.page_size, c.head_dim)

  def bind_fingerprint(self, config: CacheConfig) -> None:
    """The weights are known: what is keyed by the fingerprint follows (before any read)."""
    self.config = config
    if self.disk is not None:
      self.disk.bind_fingerprint(config.fingerprint())
    if self.window_disk is not None:
      self.window_disk.bind_fingerprint(window_key(config.fingerprint()))

  # ---- opening the tiers ---------------------------------------------------------------------
  def open(self) -> list:
    """Connects the remote peers, scans the disk store and builds the mover over every
    tier. Returns the disk records a previous run left that verified, as ``(slot, key,
    parent)`` for the manager to adopt (in a job: process 0's scan, the same on every
    process)."""
    config, tiers = self.config, self.tiers
    if tiers.remote_peers:
      from jaxkv.worker.tiers.remote import RemoteClient, RemoteTier
      self.remotes = [RemoteClient(p, config.fingerprint(), deadline_s=tiers.read_deadline_s,
                                   secret=self._key, encrypt=self._encrypt,
                                   transport=tiers.remote_transport)
                      for p in tiers.remote_peers]
      window_shape = ((2 * config.window_layers, *self.payload_shape[1:])
                      if config.has_windows else None)
      self.remote = RemoteTier(self.remotes, self.payload_shape, config.jnp_dtype, window_shape)
      if config.has_windows:  # a peer's hit past the window edge needs the window before it
        self.window_remote = self.remote.windows()
    if tiers.pool_enabled:
      from jaxkv.worker.tiers.pool import PoolTier
      self.pool = PoolTier(tiers, payload_shape=self.payload_shape, dtype=config.jnp_dtype,
                           fingerprint=config.fingerprint(), key=self._key,
                           stats=self._stats).open()
      if config.has_windows and tiers.store_windows:
        # A finished sequence's last window goes there too, under names of its own, and
        # another engine's hit reads it back (``jaxkv.manager.windows``); in a job each
        # process reads its own shards' and the job agrees on the outcomes.
        self.window_pool = self.pool.reshaped(
            (2 * config.window_layers, *self.payload_shape[1:]))
    good = self._scan_disk() if self.disk is not None else []
    if self.window_disk is not None:
      found, _ = (self.window_disk.scan() if jax.process_count() == 1
                  else self._scan_in_job(self.window_disk, check=False))
      self.window_records_found = [key for _, key, _ in found]
    # The mover's jitted page moves depend on shapes only: it keeps the config without
    # the weights, so caches of differently trained models share their compilations.
    self.mover = TierMover(manager=self._manager, mesh=self.mesh,
                           config=dataclasses.replace(config, weights_digest=""),
                           num_shards=self.num_shards, payload_shape=self.payload_shape,
                           host=self.host, disk=self.disk, remote=self.remote,
                           pool=self.pool, stats=self._stats,
                           disk_queue_bytes=tiers.disk_queue_mb << 20)
    return good

  @property
  def lookups(self):
    """What admission asks about blocks beyond the local tiers (``longest_prefix``): the
    remote peers and the pool, or None when the cache has neither."""
    if self.remote is None and self.pool is None:
      return None
    return PrefixSources(self.remote, self.pool, self.window_pool,
                         window_blocks(self.config.sliding_window, self.config.page_size)
                         if self.config.has_windows else 0,
                         remote_windows=self.window_remote is not None)

  def close(self, timeout_s: float = 10.0) -> None:
    """Finishes the pool's queued puts and leaves the pool (nothing else holds a connection
    that outlives the process)."""
    if self.pool is not None:
      self.pool.close(timeout_s)

  def disk_available(self) -> bool:
    """Whether the disk tier takes reads and writes now (not detached after failures)."""
    return self.mover is None or self.mover.disk_available

  def _scan_disk(self) -> list:
    if jax.process_count() == 1:
      good, deleted = self.disk.scan()
    else:
      good, deleted = self._scan_in_job(self.disk)
    self.disk_recovered = {"adopted": len(good), "deleted": deleted,
                           "temporaries": self.disk.removed_temporaries}
    self._stats.add_discarded_at_open(self.disk.discarded)  # by reason (process 0's, in a job)
    logging.info("disk tier %s: adopted %d blocks from earlier runs; discarded %d records "
                 "(other weights or layout, or failed verification) and %d unfinished writes",
                 self.disk.kvstore, len(good), deleted, self.disk.removed_temporaries)
    return good

  def _scan_in_job(self, disk, check: bool = True) -> tuple[list, int]:
    """In a multi-process job the store must be one every process sees (checked, unless
    ``check`` is False: the same store's blocks were scanned first); process 0 verifies it
    and the others take its list, so every index starts the same."""
    from jaxkv import distributed
    if check:
      self._check_one_store(disk)
    good, deleted = disk.scan() if jax.process_index() == 0 else ([], 0)
    text = json.dumps([[slot, key.hex(), parent.hex() if parent else None]
                       for slot, key, parent in good] + [deleted])
    rows = json.loads(distributed.broadcast_bytes(text.encode()).decode())
    good = [(slot, bytes.fromhex(k), bytes.fromhex(p) if p else None) for slot, k, p in rows[:-1]]
    return good, rows[-1]

  @staticmethod
  def _check_one_store(disk) -> None:
    """Refuses a disk store that some process of the job does not share (what process 0
    writes there, every process must see). A collective: every process has reached it."""
    from jaxkv import distributed
    probe = distributed.broadcast_bytes(os.urandom(16).hex().encode()).decode()
    name = f"job-check-{probe}"
    if jax.process_index() == 0:
      disk.kv.write(name, probe.encode()).result(timeout=60)
    distributed.allgather_codes(np.zeros(1, np.int32))  # written before anyone looks
    seen = disk.kv.read(name).result(timeout=60)
    sees = distributed.allgather_codes(np.array([seen.state == "value"], np.int32))[:, 0]
    if jax.process_index() == 0:
      disk.kv.write(name, None).result(timeout=60)
    if not sees.all():
      raise InputError(
          f"the disk tier at {disk.kvstore} is not one store for the whole job: process(es) "
          f"{[int(i) for i in np.flatnonzero(sees == 0)]} do not see what process 0 writes there. "
          "In a multi-process job every process must open the same shared directory or bucket.")

  # ---- the device pools ----------------------------------------------------------------------
  @property
  def attached(self) -> bool:
    return self._pools is not None

  def take_pools(self, state, window_ids: frozenset = frozenset()) -> None:
    """The pools a model's ``KVPages`` were allocated as (``KVCache.attach``) become this
    worker's; the model keeps none. ``window_ids``: ``id`` of the leaves that are the window
    group's (``jaxkv.nnx.WindowPages``): a step writes them, no tier move touches them."""
    if self._pools is not None:
      raise InputError("this KVCache already serves a model; build one KVCache per engine.")
    self._pools, self.pool_def = jax.tree.flatten(state)
    self._window = [id(x) in window_ids for x in self._pools]

  def _check_attached(self) -> None:
    if self._pools is None:
      raise InputError("the cache has no device pools yet: attach(model) allocates them "
                       "(jaxkv.Engine does this when it is built).")

  @property
  def page_state(self):
    """The pools as the ``nnx.State`` of the model's ``KVPages``."""
    self._check_attached()
    return jax.tree.unflatten(self.pool_def, self._pools)

  @property
  def pools(self) -> list[jax.Array]:
    """The block pools, K and V of every layer whose blocks the tiers move (the order the
    tiers' stacks use). The window group's pools are not among them (``window_pools``)."""
    self._check_attached()
    return [x for x, w in zip(self._pools, self._window) if not w]

  @property
  def step_pools(self) -> list[jax.Array]:
    """Every pool, the window group's included, in the model's order: what a step takes."""
    self._check_attached()
    return self._pools

  @property
  def window_pools(self) -> list[jax.Array]:
    """The window group's K and V pools (empty without one)."""
    self._check_attached()
    return [x for x, w in zip(self._pools, self._window) if w]

  def update_pools(self, fn, *, windows: bool | str = False) -> tuple:
    """The one way the pools change: ``fn(pools)`` takes them (a jitted step donates them)
    and returns ``(new pools, *rest)``; the new pools replace the old and ``rest`` is
    returned. ``fn`` gets the block pools (``pools``); with ``windows`` every pool, in the
    model's order (a step's), or with ``windows="only"`` the window group's alone. Called
    only by this class's verbs (``run``, ``start_promote``, ``finish_promote``, ``land``,
    ``land_windows``, ``warm_moves``, ``copy_windows``): every writer of a page goes through one of them."""
    self._check_attached()
    if windows is True or not any(self._window):
      pools, *rest = fn(self._pools)
      if len(pools) != len(self._pools):  # (only where no pool is the window group's)
        self._window = [False] * len(pools)
      self._pools = list(pools)
      return tuple(rest)
    mine = [i for i, w in enumerate(self._window) if w == (windows == "only")]
    pools, *rest = fn([self._pools[i] for i in mine])
    for i, x in zip(mine, pools):
      self._pools[i] = x
    return tuple(rest)

  def pools_alive(self) -> bool:
    return not any(x.is_deleted() for x in self._pools)

  def zero_pools(self) -> None:
    """After a failed step consumed the donated pools: they start again from zeros (the
    manager forgets the blocks they held, and the windows)."""
    c = self.config
    self._pools = [pages_lib.zeros_pool(self.mesh, c, layers=x.shape[0] if x.ndim == 5 else None,
                                        pages=c.window_pages_per_shard if w else None)
                   for x, w in zip(self._pools, self._window)]

  def copy_windows(self, copies, *, warm: bool = False) -> None:
    """Copies window-group pages within each shard (``copies``: ``(shard, src, dst)``
    triples, a plan's ``window_copies``, every destination chosen by the manager): a
    block's window KV kept under its key once the sequence that wrote it moves on.
    ``warm``: compiles the copy with nothing to copy (page 0 onto itself)."""
    if copies or (warm and any(self._window)):
      self.update_pools(lambda pools: (pages_lib.copy_pages(
          pools, copies, self.config.window_copy_slots, mesh=self.mesh, config=self.config),),
          windows="only")

  def _row_sharding(self, ndim: int) -> NamedSharding:
    sharding = self._row_shardings.get(ndim)
    if sharding is None:
      sharding = NamedSharding(self.mesh, P(self.config.data_axis, *([None] * (ndim - 1))))
      self._row_shardings[ndim] = sharding
    return sharding

  def put_rows(self, x: np.ndarray) -> jax.Array:
    """A host array whose leading axis is split over the data shards, on device."""
    return jax.device_put(x, self._row_sharding(x.ndim))

  def put_rows_many(self, *xs: np.ndarray) -> list[jax.Array]:
    """``put_rows`` of several arrays in one transfer call (a step's inputs)."""
    return jax.device_put(list(xs), [self._row_sharding(x.ndim) for x in xs])

  # ---- what changes the pools: every caller goes through these verbs --------------------------
  def run(self, step, *args):
    """Runs a jitted model step ``step(pools, *args) -> (new pools, *rest)`` over every
    pool, the window group's included (donated); returns ``rest``."""
    return self.update_pools(lambda pools: step(pools, *args), windows=True)

  def carry_out(self, orders, *, later: bool = False):
    """Carries out resolved ``TierOrders`` (the manager chose every destination): copies
    down, records deleted, the journal pumped (``TierMover.carry_out``). Copies read the
    pools; none writes them. ``later``: returns the function that finishes the writes
    below the host (the runner calls it once the step is dispatched)."""
    return self.mover.carry_out(self.pools, orders, later=later)

  def start_promote(self, fetches):
    """Issues a fetch group (``TierMover.start_promote``); returns its ``PendingFetch``."""
    pending, = self.update_pools(lambda pools: self.mover.start_promote(pools, fetches))
    return pending

  def finish_promote(self, pending, t_end: float):
    """Waits for, verifies and lands a fetch group; returns its ``FetchReport``."""
    report, = self.update_pools(lambda pools: self.mover.finish_promote(pools, pending, t_end))
    return report

  def abandon(self, pending) -> None:
    """A fetch group that will never be finished: its pins are released."""
    self.mover.abandon(pending)

  def land(self, landing) -> None:
    """Scatters a ``Landing`` (device stack and destination pages) into the pools."""
    self.update_pools(lambda pools: (self.mover.land(pools, landing),))

  def land_windows(self, landing) -> None:
    """Scatters a ``Landing`` of window-group pages (a restored checkpoint's kept blocks,
    destinations chosen by the manager's ``windows``) into the window group's pools: the
    mover's landing, on those pools."""
    self.update_pools(lambda pools: (self.mover.land(pools, landing),), windows="only")

  def warm_moves(self, max_pages: int) -> None:
    """Compiles every tier move's bucket up to ``max_pages`` pages per shard (all padding:
    no page is read into or written over) and, in a multi-process job, the collectives
    that agree on the moves' outcomes; waits for them."""
    from jaxkv import distributed
    distributed.warm_collectives()
    self.update_pools(lambda pools: (self.mover.warmup(pools, max_pages),))
    self.copy_windows((), warm=True)
    self.windows.warm(max_pages)
    jax.block_until_ready(self._pools)

  def flush(self, timeout_s: float) -> int:
    """Waits for lower-tier writes in flight (disk writes, the window group's records, the
    pool's queued puts); returns how many did not finish in time."""
    t_end = time.monotonic() + timeout_s
    left = self.mover.flush(timeout_s)
    left += self.windows.flush(t_end)
    if self.pool is not None and not self.pool.settle(max(0.0, t_end - time.monotonic())):
      left += self.pool.queued
    return left


class PrefixSources:
  """The remote peers and the pool behind one ``longest_prefix`` (what
  ``CacheManager.peer_prefix`` asks on its lookup thread): ``(peer, blocks)`` of the source
  holding the longest prefix beyond ``local`` blocks, ``peer`` being ``POOL_PEER`` for the
  pool (which wins ties: no peer has to serve it). With ``window_pool`` (a model with a
  window group), a pool answer is ``(POOL_PEER, blocks, [j, ...])``: the blocks among the
  last ``2 * window`` of its prefix whose window KV the pool holds too (one more lookup),
  from which admission finds the longest cut it can serve; with ``remote_windows``, a
  peer's answer is ``(peer, blocks, [j, ...])`` likewise (in the same lookup)."""

  def __init__(self, remote, pool, window_pool=None, window: int = 0,
               remote_windows: bool = False):
    self.remote, self.pool = remote, pool
    self.window_pool, self.window = window_pool, window
    self.remote_windows = remote_windows

  def longest_prefix(self, keys: list[bytes], local: int) -> tuple | None:
    best = None
    if self.pool is not None and len(keys) > local:
      n = self.pool.lookup(keys, local)
      if n > local:
        best = (POOL_PEER, n)
        if self.window_pool is not None:
          lo = max(0, n - 2 * self.window)
          there = self.window_pool.present([window_key(k) for k in keys[lo:n]])
          best = (POOL_PEER, n, [lo + i for i, held in enumerate(there) if held])
    if self.remote is not None:
      found = self.remote.longest_prefix(keys, best[1] if best else local,
                                         windows=self.remote_windows)
      if found is not None:
        best = found
    return best
