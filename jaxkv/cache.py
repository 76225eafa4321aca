"""KVCache: the tiered, sharded, paged cache a model's attention layers read and write.

It is the public facade over two halves with one owner each:

* the ``CacheManager`` (``jaxkv.manager``, host only, no JAX): the ``PrefixIndex`` that
  says which slot of which tier holds which block, the pins that keep prefixes resident,
  allocation and eviction. The scheduler and admission see only this half.
* the ``CacheWorker`` (``jaxkv.worker.worker``): the device page pools, the lower tiers
  (host pool, disk store, remote peers) and the ``TierMover`` that moves blocks between
  them. The runner, streaming and checkpoints work through this half.

``KVCache`` itself keeps what both share: the ``CacheConfig`` (shapes and budgets), the
mesh, the deployment key and the ``Stats`` every part adds to.

A cache belongs to one model's weights: ``CacheConfig.weights_digest`` is part of every
block key and record fingerprint. Left empty, ``attach`` computes it from the model
(``jaxkv.identity``) before anything is read from disk or a peer, so blocks written under
other weights are never adopted, pulled or restored.

The device pools start as the ``jaxkv.nnx.KVPages`` variables of a model: ``attach``
allocates them inside the model's ``PagedKV`` layers and hands them to the worker, so
the model's weights and structure go to the runner while the pools stay with the worker.
Every jitted step takes the pools donated and gives them back through ``update_pools``,
the one way they change.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh

from jaxkv import distributed, identity
from jaxkv import nnx as kvnnx
from jaxkv.worker import pages as pages_lib
from jaxkv import security
from jaxkv.config import CacheConfig, TierConfig, check_fits_model
from jaxkv.manager.index import TIER_NAMES, PrefixIndex, Tier
from jaxkv.stats import Stats
from jaxkv.worker.worker import CacheWorker
from jaxkv.errors import InputError
from jaxkv.manager import CacheManager
from jaxkv.manager import windows as windows_lib
from jaxkv.manager.events import FULL_ATTENTION, BlockEvents, window_group
from jaxkv.manager.publisher import EventPublisher, endpoint_host
from jaxkv.scheduling.step import TierOrders


def _worker_member(name: str, what: str) -> property:
  """A deprecated facade attribute: the worker's ``name``, with a warning."""
  def get(self):
    warnings.warn(f"KVCache.{name} is deprecated: {what} belongs to the cache's worker "
                  f"(cache.worker.{name}); the facade's verbs (offload, flush, "
                  "occupancy, ...) cover what serving needs.", DeprecationWarning, stacklevel=2)
    return getattr(self.worker, name)
  return property(get, doc=f"Deprecated: ``cache.worker.{name}`` ({what}).")


class KVCache:
  """The tiered, sharded KV cache: a host-side ``CacheManager`` (index, pins, allocation)
  over a device-side ``CacheWorker`` (pools, tiers, mover), behind one object."""

  def __init__(self, config: CacheConfig, mesh: Mesh | None = None,
               tiers: TierConfig | None = None, *, deployment_key: bytes | str | None = None):
    """``deployment_key`` (``jaxkv.security``): the secret that keys tenants' block keys and
    authenticates remote peers; by default ``$JAXKV_DEPLOYMENT_KEY_FILE`` or
    ``$JAXKV_DEPLOYMENT_KEY`` if set, else none (keys are then guessable from a tenant's name
    and a prompt: keep such a cache's stores and servers private)."""
    if not isinstance(config, CacheConfig):
      raise TypeError(f"config must be a jaxkv.CacheConfig, got {type(config).__name__}.")
    tiers = TierConfig() if tiers is None else tiers
    if not isinstance(tiers, TierConfig):
      raise TypeError(f"tiers must be a jaxkv.TierConfig, got {type(tiers).__name__}.")
    if mesh is None:
      mesh = pages_lib.make_mesh(data=len(jax.devices()), model=1, data_axis=config.data_axis,
                                 model_axis=config.model_axis)
    pages_lib.validate_mesh(mesh, config)
    self.config = config
    self.tiers = tiers
    self.mesh = mesh
    self.num_shards = pages_lib.data_shards(mesh, config)
    self._check_fits_in_memory()
    key = security.check_key(deployment_key)
    self._deployment_key = key if key is not None else security.load_deployment_key()
    self.key_id = security.key_id(self._deployment_key)
    if tiers.encryption == "on" and self._deployment_key is None:
      raise InputError("TierConfig.encryption='on' needs a deployment key (--deployment_key_file "
                       "or $JAXKV_DEPLOYMENT_KEY_FILE); give one, or set encryption='auto'.")
    # Blocks leaving the process are encrypted (not only MACed) under the key.
    self.encrypt = self._deployment_key is not None and tiers.encryption != "off"
    if self._deployment_key is not None and not self.encrypt and (
        tiers.disk_enabled or tiers.remote_peers):
      security.warn_insecure("TierConfig.encryption='off': disk records and remote answers "
                             "carry plaintext KV, from which a prompt can be read back",
                             "set encryption='auto' unless the store and network are private")
    self.index = PrefixIndex(num_shards=self.num_shards, pages_per_shard=config.pages_per_shard,
                             page_size=config.page_size, fingerprint=config.fingerprint(),
                             host_pages_per_shard=tiers.host_pages_per_shard,
                             disk_slots=tiers.disk_pages, secret=self._deployment_key)
    self.stats = Stats()
    # The device half: pools, tiers, mover (runner, streaming, checkpoints work through it).
    # The host-side half: index, pins, allocation (the scheduler and admission see this).
    self.manager = CacheManager(
        self.index, stats=self.stats, page_bytes=config.page_bytes,
        write_through=tiers.write_policy == "write_through", has_disk=tiers.disk_enabled,
        has_pool=tiers.pool_enabled,
        disk_attached=lambda: self.worker.disk_available(),
        # A job: process 0 asks the peers and broadcasts their answers to every process.
        share_answers=distributed.broadcaster(),
        asks_peers=jax.process_index() == 0)
    # The device half: pools, tiers, mover (runner, streaming, checkpoints work through it);
    # what its copies do it reports to the manager.
    self.worker = CacheWorker(config, tiers, mesh, manager=self.manager, stats=self.stats,
                              key=self._deployment_key, encrypt=self.encrypt)
    logging.info(
        "KVCache %s: %d data shard(s) x %d pages of %d tokens (%.1f MiB per device)%s%s%s",
        config.model_name, self.num_shards, config.pages_per_shard, config.page_size,
        self.pool_bytes_per_device / 2**20,
        f"; host tier {tiers.host_pages_per_shard} pages per shard" if self.worker.host else "",
        f"; disk tier {tiers.disk_pages} blocks at {tiers.disk_kvstore}" if self.worker.disk else "",
        f"; deployment key {self.key_id}" if self._deployment_key else "")
    # KV events for routers: process 0 publishes for the job (every process holds the same
    # index, so one stream tells it whole). Started last, and closed if what follows fails.
    self.events_publisher = self.events = self.window_events = None
    if tiers.kv_events and jax.process_index() == 0:
      self.events_publisher = EventPublisher(
          tiers.kv_events, replay=tiers.kv_events_replay, topic=tiers.kv_events_topic)
      for flag, endpoint in (("kv_events", tiers.kv_events),
                             ("kv_events_replay", tiers.kv_events_replay)):
        host = endpoint_host(endpoint) if endpoint else None
        if host is not None and not security.is_loopback(host):
          # No key guards these sockets: whoever reaches them reads every tenant's blocks.
          security.warn_insecure(
              f"--{flag}={endpoint} listens beyond loopback with no authentication: whoever "
              "reaches it learns which blocks every tenant holds and their token ids "
              "(mapped per tenant, which without a deployment key anyone can undo)",
              "bind it on 127.0.0.1 or a private address only the router's hosts reach "
              "(kv_events_tokens=false sends hashes only)")
      told = dict(page_size=config.page_size, tokens=tiers.kv_events_tokens,
                  raw_tokens=tiers.kv_events_raw_tokens)
      # A hybrid model's events name their group: the global layers' blocks (the index)
      # and the window group's kept blocks (``size_windows`` hands it their changes).
      self.events = BlockEvents(self.events_publisher.put, **told,
                                group=FULL_ATTENTION if config.has_windows else None)
      self.window_events = (BlockEvents(self.events_publisher.put, **told,
                                        group=window_group(config.sliding_window))
                            if config.has_windows else None)
      self.manager.set_events(self.events, self.window_events)
    if config.weights_digest:  # the model is known: open what depends on its identity now
      try:
        self.open_tiers()
      except BaseException:
        self.close()
        raise

  def open_tiers(self) -> None:
    """Opens what depends on the cache's fingerprint, so on the model's weights: blocks a
    previous run left on disk (adopted only if written under this fingerprint), the
    remote peers, and the mover over every tier. Once the model is known: at
    construction when ``CacheConfig.weights_digest`` names it, else the engine calls this
    after ``attach``. Opening twice does nothing."""
    if self.worker.mover is not None:
      return
    if not self.config.weights_digest:
      raise InputError("the cache's model is not known yet: attach(model) (jaxkv.Engine "
                       "does) or set CacheConfig.weights_digest before opening its tiers.")
    adopted = self.worker.open()
    if self.worker.lookups is not None:
      self.manager.set_remote(self.worker.lookups)
    self.manager.adopt_disk(adopted)
    self._adopt_window_records()

  def _bind_weights(self, digest: str) -> None:
    """Makes ``digest`` part of the fingerprint (before anything was cached under it)."""
    if self.config.weights_digest:
      if self.config.weights_digest != digest:
        raise InputError(
            f"CacheConfig.weights_digest={self.config.weights_digest!r} but the model's "
            f"weights give {digest!r}: this cache belongs to other weights. Build a cache for "
            "this model (weights_digest='' computes it) or load the weights it was made for.")
      return
    self.config = dataclasses.replace(self.config, weights_digest=digest)
    self.manager.bind_fingerprint(self.config.fingerprint())
    self.worker.bind_fingerprint(self.config)

  @property
  def deployment_key(self) -> bytes | None:
    """The secret this cache keys block keys and authenticates with (None: keyless), for
    the parts that seal or authenticate in its name: checkpoints, the block server."""
    return self._deployment_key

  # What the worker owns is the worker's: the facade offers verbs, not its members. The old
  # spellings still answer, with a DeprecationWarning naming the replacement.
  host = _worker_member("host", "the host tier")
  disk = _worker_member("disk", "the disk tier")
  remote = _worker_member("remote", "the remote tier")
  remotes = _worker_member("remotes", "the remote peers' clients")
  pool = _worker_member("pool", "the pool tier")
  mover = _worker_member("mover", "the TierMover")
  pool_def = _worker_member("pool_def", "the pools' tree structure")
  page_state = _worker_member("page_state", "the pools as the model's nnx.State")
  pools = _worker_member("pools", "the device pools")
  disk_recovered = property(lambda self: self.worker.disk_recovered,
                            doc="What opening the disk store adopted, deleted and cleaned.")
  num_arrays = property(lambda self: self.worker.num_arrays,
                        doc="Page arrays the model holds: K and V of every layer.")
  payload_shape = property(lambda self: self.worker.payload_shape,
                           doc="One block outside device memory: [2 * layers, kv_heads, "
                               "page_size, head_dim].")

  @property
  def pool_bytes_per_device(self) -> int:
    c = self.config
    model = self.mesh.shape[c.model_axis]
    return c.pages_per_shard * c.page_bytes // model

  # ---- the device pools --------------------------------------------------------------------
  def size_windows(self, rows_per_shard: int, chunk_pages: int) -> None:
    """With a window group (``CacheConfig.window_layers``): sizes what the config left to
    the engine (``window_pages_per_shard``: room for ``rows_per_shard`` running sequences
    and as many kept windows again; ``window_copy_slots``: what one step's publishing can
    order) and starts the manager's bookkeeping of the group (``manager.windows``). Before
    ``attach``; nothing without a window group."""
    c = self.config
    if not c.has_windows:
      return
    if self.worker.attached:
      raise InputError("size_windows comes before attach(model): the window pool is "
                       "allocated with the model's pages.")
    window = windows_lib.window_blocks(c.sliding_window, c.page_size)
    ring = windows_lib.ring_blocks(c.sliding_window, c.page_size, chunk_pages)
    pages = c.window_pages_per_shard or 2 * rows_per_shard * (ring + window) + 1
    windows_lib.check_room(pages, ring, window, rows_per_shard)
    slots = c.window_copy_slots or 2 * rows_per_shard * ring  # (a step keeps fewer)
    self.config = dataclasses.replace(c, window_pages_per_shard=pages, window_copy_slots=slots)
    self.worker.config = self.config
    self.manager.windows = windows_lib.WindowPages(
        num_shards=self.num_shards, pages_per_shard=pages, sliding_window=c.sliding_window,
        page_size=c.page_size, chunk_pages=chunk_pages, stats=self.stats,
        host_slots=self.tiers.host_window_pages_per_shard if self.worker.window_host else 0,
        pool=self.tiers.pool_enabled and self.tiers.store_windows,
        disk_records=self.worker.window_disk.num_slots if self.worker.window_disk else 0)
    self.manager.windows.observer = self.window_events
    self._adopt_window_records()

  def _adopt_window_records(self) -> None:
    """The window records an earlier run left on the disk (``CacheWorker.open``), once
    both the tiers are open and the window group is sized (whichever comes last)."""
    found, windows = self.worker.window_records_found, self.manager.windows
    if found and windows is not None:
      self.stats.add("window_disk_adopted", sum(windows.records.keep(k) for k in found))
      self.worker.window_records_found = []

  def attach(self, model: nnx.Module) -> tuple:
    """Refuses a cache without ``model``'s shapes (``jaxkv.config.check_fits_model``),
    allocates the device pools inside its ``PagedKV`` layers, hands them to the worker and
    binds the weights' digest into the fingerprint (opening no store: ``open_tiers``).
    Returns ``(graphdef, weights)``: the rest of the model, for the runner."""
    if self.worker.attached:
      raise InputError("this KVCache already serves a model; build one KVCache per engine.")
    check_fits_model(self.config, model)  # its shapes are the model's, or it is refused
    if self.config.has_windows and self.manager.windows is None:
      raise InputError("a cache with a window group is sized for its engine's running "
                       "sequences first: KVCache.size_windows(rows_per_shard, chunk_pages) "
                       "(jaxkv.Engine calls it).")
    kvnnx.init_pages(model, self.config, self.mesh)
    windows = kvnnx.window_leaf_ids(model)
    graphdef, state, rest = nnx.split(model, kvnnx.KVPages, ...)
    self._bind_weights(identity.weights_digest(model, rest))
    self.worker.take_pools(state, windows)
    return graphdef, rest

  def update_pools(self, fn) -> tuple:
    """Deprecated: the pools change through the worker's verbs (``cache.worker.run``,
    ``land``, ``carry_out``)."""
    warnings.warn("KVCache.update_pools is deprecated: change the pools through the "
                  "worker's verbs (cache.worker.run / land / carry_out).", DeprecationWarning,
                  stacklevel=2)
    return self.worker.update_pools(fn)

  def pools_alive(self) -> bool:
    return self.worker.pools_alive()

  def reset_pools(self) -> None:
    """After a failed step consumed the donated pools: the cached bytes are gone, so the
    index forgets every unreferenced device block and the pools start again from zeros."""
    self.manager.forget_device_blocks()
    if self.manager.windows is not None:
      self.manager.windows.forget()
    self.worker.zero_pools()

  def put_rows(self, x: np.ndarray) -> jax.Array:
    """A host array whose leading axis is split over the data shards, on device."""
    return self.worker.put_rows(x)

  def put_rows_many(self, *xs: np.ndarray) -> list[jax.Array]:
    """``put_rows`` of several arrays in one transfer call (a step's inputs)."""
    return self.worker.put_rows_many(*xs)

  # ---- residency -------------------------------------------------------------------------------
  def hold(self, tokens, tenant: str) -> int:
    """Takes a reference on a prefix's full blocks on every data shard (all must be on
    device there), so no eviction touches them until ``release_hold``. Returns the number
    of blocks held per shard. ``Engine.pin`` computes what is missing first."""
    return self.manager.hold(tokens, tenant)

  def release_hold(self, tokens, tenant: str) -> None:
    """Releases one ``hold`` of the same prefix."""
    self.manager.release_hold(tokens, tenant)

  def offload(self) -> int:
    """Moves every unreferenced cached block out of device memory (copying it down first
    under write-back) and frees its page. Returns the number of blocks moved out."""
    victims = self.manager.unreferenced_device_blocks()
    self.worker.carry_out(self.manager.resolve(TierOrders(demote=tuple(victims))))
    self.manager.forget_device_blocks()
    return len(victims)

  # ---- the pool, for a prefill node's hand-off ------------------------------------------------
  def placed_in_pool(self, keys, deadline_s: float) -> list[int]:
    """Waits (up to ``deadline_s``) for this process's pool puts of ``keys``; returns the
    pool ids (64 bits of each value's name) of the leading run placed by then. Needs a pool
    tier."""
    pool = self._pool_tier()
    t_end = time.monotonic() + deadline_s
    lead = pool.placed_run(list(keys), deadline_s)
    windows = self.worker.window_pool
    if windows is not None and lead:
      # A hybrid model's hit needs the window before its cut too (``WindowPages.put``, at
      # the prefill's end): promised only with it.
      w = windows_lib.window_blocks(self.config.sliding_window, self.config.page_size)
      names = [windows_lib.window_key(k) for k in keys[max(0, lead - w):lead]]
      if windows.placed_run(names, max(0.0, t_end - time.monotonic())) < len(names):
        lead = 0
    return [int(pool.name(k)[-16:], 16) for k in keys[:lead]]

  def pin_pool_puts(self) -> None:
    """Every block this cache puts in the pool from now on is soft-pinned (a prefill
    node's: kept until the decode node has it, or the pin's time ends)."""
    self._pool_tier().pin_all = True

  def _pool_tier(self):
    if self.worker.pool is None:
      raise InputError("this cache has no pool tier (TierConfig.pool_master); the "
                       "prefill -> decode hand-off needs one on both nodes.")
    return self.worker.pool

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits for lower-tier writes in flight; returns how many did not finish in time."""
    return self.worker.flush(timeout_s)

  def close(self, timeout_s: float = 10.0) -> None:
    """Leaves what outlives the process otherwise: the pool's queued puts are finished (up
    to ``timeout_s``) and its segment unmounted. The cache serves no more after it."""
    self.worker.close(timeout_s)
    if self.events_publisher is not None:
      self.events_publisher.close()

  def occupancy(self) -> dict:
    """``cached_blocks`` and ``capacity_blocks`` by tier (device and host summed over data
    shards; disk is one store) and ``referenced_pages`` (device page references held)."""
    index, shards = self.index, range(self.num_shards)
    cached = {TIER_NAMES[t]: sum(index.num_cached(s, t) for s in shards)
              for t in (Tier.DEVICE, Tier.HOST)}
    cached["disk"] = index.num_cached(0, Tier.DISK)
    capacity = {"device": self.config.pages_per_shard * self.num_shards,
                "host": self.tiers.host_pages_per_shard * self.num_shards,
                "disk": self.tiers.disk_pages if self.worker.disk is not None else 0}
    return {"cached_blocks": cached, "capacity_blocks": capacity,
            "referenced_pages": sum(sum(index.held_slots(s).values()) for s in shards)}

  def _check_fits_in_memory(self) -> None:
    need = self.pool_bytes_per_device
    for d in self.mesh.devices.flat:
      if d.process_index != jax.process_index():
        continue  # another process checks its own devices
      stats = d.memory_stats() if hasattr(d, "memory_stats") else None
      limit = (stats or {}).get("bytes_limit")
      if limit and need > limit:
        c = self.config
        raise InputError(
            f"the device pool needs {need / 2**30:.2f} GiB per device (pages_per_shard="
            f"{c.pages_per_shard} x page_size={c.page_size} x {c.num_layers} layers) but {d} "
            f"has {limit / 2**30:.2f} GiB; lower pages_per_shard or page_size.")
