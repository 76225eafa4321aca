"""KVCache: the tiered, sharded, paged cache a model's attention layers read and write.

It ties together what describes the cache: the ``CacheConfig`` (shapes and budgets), the
mesh the pools are sharded over, the ``TierConfig`` (host pages, disk store), the tiers
themselves, and the host-side ``PrefixIndex`` that says which slot of which tier holds
which block. The device page arrays live in the model's ``jaxkv.nnx.KVPages`` variables
(allocated by ``attach``), so a Flax model carries its cache the way NNX models carry any
other state; the host pool and the disk store live here.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxkv import nnx as kvnnx
from jaxkv import pages as pages_lib
from jaxkv.config import CacheConfig, TierConfig
from jaxkv.index import PrefixIndex, Tier


class CapacityError(ValueError):
  """A request needs more device pages than the cache can ever give it."""


class KVCache:
  """The tiered, sharded KV cache."""

  def __init__(self, config: CacheConfig, mesh: Mesh | None = None,
               tiers: TierConfig | None = None):
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
    self.index = PrefixIndex(num_shards=self.num_shards, pages_per_shard=config.pages_per_shard,
                             page_size=config.page_size, fingerprint=config.fingerprint(),
                             host_pages_per_shard=tiers.host_pages_per_shard,
                             disk_slots=tiers.disk_pages)
    self.host = None
    self.disk = None
    self.disk_recovered = {"adopted": 0, "deleted": 0, "temporaries": 0}
    if tiers.host_enabled:
      from jaxkv.tiers.host import HostTier
      self.host = HostTier(mesh, config, tiers, self.num_arrays)
    self.remotes = []
    if tiers.remote_peers:
      from jaxkv.tiers.remote import RemoteClient
      self.remotes = [RemoteClient(p, config.fingerprint(), deadline_s=tiers.read_deadline_s)
                      for p in tiers.remote_peers]
    if tiers.disk_enabled:
      from jaxkv.tiers.disk import DiskTier
      self.disk = DiskTier(tiers.disk_kvstore, num_slots=tiers.disk_pages,
                           payload_shape=self.payload_shape, dtype=config.jnp_dtype,
                           fingerprint=config.fingerprint())
      self._adopt_disk_blocks()

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

  def attach(self, model: nnx.Module) -> None:
    """Allocates the device pools inside ``model``'s ``PagedKV`` layers."""
    kvnnx.init_pages(model, self.config, self.mesh)

  def _adopt_disk_blocks(self) -> None:
    """Blocks a previous run left on disk come back into the index once verified."""
    good, deleted = self.disk.scan()
    for slot, key, parent in good:
      self.index.acquire(0, [slot], Tier.DISK)
      self.index.publish(0, slot, key, Tier.DISK, parent=parent)
      self.index.release(0, [slot], Tier.DISK)
    self.disk_recovered = {"adopted": len(good), "deleted": deleted,
                           "temporaries": self.disk.removed_temporaries}

  def _check_fits_in_memory(self) -> None:
    need = self.pool_bytes_per_device
    for d in self.mesh.devices.flat:
      if d.process_index != jax.process_index():
        continue  # another process checks its own devices
      stats = d.memory_stats() if hasattr(d, "memory_stats") else None
      limit = (stats or {}).get("bytes_limit")
      if limit and need > limit:
        c = self.config
        raise ValueError(
            f"the device pool needs {need / 2**30:.2f} GiB per device (pages_per_shard="
            f"{c.pages_per_shard} x page_size={c.page_size} x {c.num_layers} layers) but {d} "
            f"has {limit / 2**30:.2f} GiB; lower pages_per_shard or page_size.")
