"""KVCache: the tiered, sharded, paged cache a model's attention layers read and write.

It owns everything that holds or describes cached bytes: the ``CacheConfig`` (shapes and
budgets), the mesh the pools are sharded over, the device page pools, the lower tiers
(host pool, disk store, remote peers) with the ``TierMover`` that moves blocks between
them, the host-side ``PrefixIndex`` that says which slot of which tier holds which block,
the pins that keep prefixes resident, and the ``Stats`` every part adds to.

A cache belongs to one model's weights: ``CacheConfig.weights_digest`` is part of every
block key and record fingerprint. Left empty, ``attach`` computes it from the model
(``jaxkv.identity``) before anything is read from disk or a peer, so blocks written under
other weights are never adopted, pulled or restored.

The device pools start as the ``jaxkv.nnx.KVPages`` variables of a model: ``attach``
allocates them inside the model's ``PagedKV`` layers and then takes them out of it, so
the model's weights and structure go to the runner while the pools stay here. Every
jitted step takes the pools donated and gives them back through ``update_pools``, the one
way they change.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv import identity
from jaxkv import nnx as kvnnx
from jaxkv.worker import pages as pages_lib
from jaxkv import security
from jaxkv.config import CacheConfig, TierConfig
from jaxkv.manager.index import TIER_NAMES, PrefixIndex, Tier
from jaxkv.stats import Stats
from jaxkv.worker.transfers import TierMover
from jaxkv.errors import CapacityError, InputError
from jaxkv.manager import CacheManager


class KVCache:
  """The tiered, sharded KV cache."""

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
    self.host = None
    self.disk = None
    self.remote = None
    self.disk_recovered = {"adopted": 0, "deleted": 0, "temporaries": 0}
    if tiers.host_enabled:
      from jaxkv.worker.tiers.host import HostTier
      self.host = HostTier(mesh, config, tiers, self.num_arrays)
    self.remotes = []
    if tiers.disk_enabled:
      from jaxkv.worker.tiers.disk import DiskTier
      self.disk = DiskTier(tiers.disk_kvstore, num_slots=tiers.disk_pages,
                           payload_shape=self.payload_shape, dtype=config.jnp_dtype,
                           fingerprint=config.fingerprint(), key=self._deployment_key,
                           encrypt=self.encrypt)
    self.stats = Stats()
    self.mover = None
    # The host-side half: index, pins, allocation (the scheduler and admission see this).
    self.manager = CacheManager(
        self.index, stats=self.stats, page_bytes=config.page_bytes,
        write_through=tiers.write_policy == "write_through", has_disk=self.disk is not None,
        disk_attached=lambda: self.mover is None or self.mover.disk_available)
    logging.info(
        "KVCache %s: %d data shard(s) x %d pages of %d tokens (%.1f MiB per device)%s%s%s",
        config.model_name, self.num_shards, config.pages_per_shard, config.page_size,
        self.pool_bytes_per_device / 2**20,
        f"; host tier {tiers.host_pages_per_shard} pages per shard" if self.host else "",
        f"; disk tier {tiers.disk_pages} blocks at {tiers.disk_kvstore}" if self.disk else "",
        f"; deployment key {self.key_id}" if self._deployment_key else "")
    if config.weights_digest:  # the model is known: open what depends on its identity now
      self.open_tiers()
    self._pools = None  # the device pools, flat (leaves of the model's KVPages state)
    self.pool_def = None  # their tree structure
    self._row_shardings: dict = {}

  def open_tiers(self) -> None:
    """Opens what depends on the cache's fingerprint, so on the model's weights: blocks a
    previous run left on disk (adopted only if written under this fingerprint), the
    remote peers, and the mover over every tier. Once the model is known: at
    construction when ``CacheConfig.weights_digest`` names it, else the engine calls this
    after ``attach``. Opening twice does nothing."""
    if self.mover is not None:
      return
    if not self.config.weights_digest:
      raise InputError("the cache's model is not known yet: attach(model) (jaxkv.Engine "
                       "does) or set CacheConfig.weights_digest before opening its tiers.")
    config, tiers = self.config, self.tiers
    if tiers.remote_peers:
      from jaxkv.worker.tiers.remote import RemoteClient, RemoteTier
      self.remotes = [RemoteClient(p, config.fingerprint(), deadline_s=tiers.read_deadline_s,
                                   secret=self._deployment_key, encrypt=self.encrypt,
                                   transport=tiers.remote_transport)
                      for p in tiers.remote_peers]
      self.remote = RemoteTier(self.remotes, self.payload_shape, config.jnp_dtype)
      self.manager.set_remote(self.remote)
    if self.disk is not None:
      self._adopt_disk_blocks()
    # The mover's jitted page moves depend on shapes only: it keeps the config without
    # the weights, so caches of differently trained models share their compilations.
    self.mover = TierMover(index=self.index, mesh=self.mesh,
                           config=dataclasses.replace(config, weights_digest=""),
                           num_shards=self.num_shards, payload_shape=self.payload_shape,
                           host=self.host, disk=self.disk, remote=self.remote,
                           stats=self.stats)

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
    self.index.bind_fingerprint(self.config.fingerprint())
    if self.disk is not None:
      self.disk.bind_fingerprint(self.config.fingerprint())

  @property
  def deployment_key(self) -> bytes | None:
    """The secret this cache keys block keys and authenticates with (None: keyless), for
    the parts that seal or authenticate in its name: checkpoints, the block server."""
    return self._deployment_key

  @property
  def num_arrays(self) -> int:
    """Page arrays the model holds: K and V of every layer."""
    return 2 * self.config.num_layers

  @property
  def payload_shape(self) -> tuple[int, int, int, int]:
    """One block outside device memory: ``[2 * layers, kv_heads, page_size, head_dim]``."""
    c = self.config
    return (self.num_arrays, c.num_kv_heads, c.page_size, c.head_dim)

  @property
  def pool_bytes_per_device(self) -> int:
    c = self.config
    model = self.mesh.shape[c.model_axis]
    return c.pages_per_shard * c.page_bytes // model

  # ---- the device pools --------------------------------------------------------------------
  def attach(self, model: nnx.Module) -> tuple:
    """Allocates the device pools inside ``model``'s ``PagedKV`` layers, takes them over
    and binds the weights' digest into the fingerprint (opening no store: ``open_tiers``).
    Returns ``(graphdef, weights)``: the rest of the model, for the runner."""
    if self._pools is not None:
      raise InputError("this KVCache already serves a model; build one KVCache per engine.")
    kvnnx.init_pages(model, self.config, self.mesh)
    graphdef, state, rest = nnx.split(model, kvnnx.KVPages, ...)
    self._bind_weights(identity.weights_digest(model, rest))
    self._pools, self.pool_def = jax.tree.flatten(state)
    return graphdef, rest

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
    """The device pools, K and V of every layer (the order the tiers' stacks use; a
    jitted step takes them flat, donated, and returns them)."""
    self._check_attached()
    return self._pools

  def update_pools(self, fn) -> tuple:
    """The one way the pools change: ``fn(pools)`` takes them (a jitted step donates them)
    and returns ``(new pools, *rest)``; the new pools replace the old and ``rest`` is
    returned. Every writer of a page (steps, fetches, restores, calibration) goes
    through here."""
    self._check_attached()
    pools, *rest = fn(self._pools)
    self._pools = list(pools)
    return tuple(rest)

  def pools_alive(self) -> bool:
    return not any(x.is_deleted() for x in self.pools)

  def reset_pools(self) -> None:
    """After a failed step consumed the donated pools: the cached bytes are gone, so the
    index forgets every unreferenced device block and the pools start again from zeros."""
    for s in range(self.num_shards):
      self.index.evict_all_unreferenced(s)
    self._pools = [pages_lib.zeros_pool(self.mesh, self.config) for _ in self._pools]

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
    self.mover.demote(self.pools, victims)
    for s in range(self.num_shards):
      self.index.evict_all_unreferenced(s, Tier.DEVICE)
    return len(victims)

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits for lower-tier writes in flight; returns how many did not finish in time."""
    return self.mover.flush(timeout_s)

  def occupancy(self) -> dict:
    """``cached_blocks`` and ``capacity_blocks`` by tier (device and host summed over data
    shards; disk is one store) and ``referenced_pages`` (device page references held)."""
    index, shards = self.index, range(self.num_shards)
    cached = {TIER_NAMES[t]: sum(index.num_cached(s, t) for s in shards)
              for t in (Tier.DEVICE, Tier.HOST)}
    cached["disk"] = index.num_cached(0, Tier.DISK)
    capacity = {"device": self.config.pages_per_shard * self.num_shards,
                "host": self.tiers.host_pages_per_shard * self.num_shards,
                "disk": self.tiers.disk_pages if self.disk is not None else 0}
    return {"cached_blocks": cached, "capacity_blocks": capacity,
            "referenced_pages": sum(sum(index.held_slots(s).values()) for s in shards)}

  def _adopt_disk_blocks(self) -> None:
    """Blocks a previous run left on disk come back into the index once verified. In a
    multi-process job the store must be one every process sees (checked); process 0
    verifies it and the others take its list, so every index starts the same."""
    if jax.process_count() == 1:
      good, deleted = self.disk.scan()
    else:
      good, deleted = self._adopt_in_job()
    for slot, key, parent in good:
      self.index.acquire(0, [slot], Tier.DISK)
      self.index.publish(0, slot, key, Tier.DISK, parent=parent)
      self.index.release(0, [slot], Tier.DISK)
    self.disk_recovered = {"adopted": len(good), "deleted": deleted,
                           "temporaries": self.disk.removed_temporaries}
    self.stats.add_discarded_at_open(self.disk.discarded)  # by reason (process 0's, in a job)
    logging.info("disk tier %s: adopted %d blocks from earlier runs; discarded %d records "
                 "(other weights or layout, or failed verification) and %d unfinished writes",
                 self.disk.kvstore, len(good), deleted, self.disk.removed_temporaries)

  def _adopt_in_job(self) -> tuple[list, int]:
    from jaxkv import distributed
    disk = self.disk
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
    good, deleted = disk.scan() if jax.process_index() == 0 else ([], 0)
    text = json.dumps([[slot, key.hex(), parent.hex() if parent else None]
                       for slot, key, parent in good] + [deleted])
    rows = json.loads(distributed.broadcast_bytes(text.encode()).decode())
    good = [(slot, bytes.fromhex(k), bytes.fromhex(p) if p else None) for slot, k, p in rows[:-1]]
    return good, rows[-1]

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
