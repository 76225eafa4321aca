"""KVCache: the sharded, paged cache a model's attention layers read and write.

It ties together the three things that describe the cache: the ``CacheConfig`` (shapes
and budgets), the mesh the pools are sharded over, and the host-side ``PrefixIndex``
that says which device pages hold which blocks. The page arrays themselves live in the
model's ``jaxkv.nnx.KVPages`` variables (allocated by ``attach``), so a Flax model
carries its cache the way NNX models carry any other state.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxkv import nnx as kvnnx
from jaxkv import pages as pages_lib
from jaxkv.config import CacheConfig
from jaxkv.index import PrefixIndex


class CapacityError(RuntimeError):
  """A request needs more device pages than the cache can ever give it."""


class KVCache:
  """The tiered, sharded KV cache (device tier)."""

  def __init__(self, config: CacheConfig, mesh: Mesh | None = None):
    if not isinstance(config, CacheConfig):
      raise TypeError(f"config must be a jaxkv.CacheConfig, got {type(config).__name__}.")
    if mesh is None:
      mesh = pages_lib.make_mesh(data=len(jax.devices()), model=1, data_axis=config.data_axis,
                                 model_axis=config.model_axis)
    pages_lib.validate_mesh(mesh, config)
    self.config = config
    self.mesh = mesh
    self.num_shards = pages_lib.data_shards(mesh, config)
    self._check_fits_in_memory()
    self.index = PrefixIndex(num_shards=self.num_shards, pages_per_shard=config.pages_per_shard,
                             page_size=config.page_size, fingerprint=config.fingerprint())

  @property
  def pool_bytes_per_device(self) -> int:
    c = self.config
    model = self.mesh.shape[c.model_axis]
    return c.pages_per_shard * c.page_bytes // model

  def attach(self, model: nnx.Module) -> None:
    """Allocates the device pools inside ``model``'s ``PagedKV`` layers."""
    kvnnx.init_pages(model, self.config, self.mesh)

  def _check_fits_in_memory(self) -> None:
    need = self.pool_bytes_per_device
    for d in self.mesh.devices.flat:
      stats = d.memory_stats() if hasattr(d, "memory_stats") else None
      limit = (stats or {}).get("bytes_limit")
      if limit and need > limit:
        c = self.config
        raise ValueError(
            f"the device pool needs {need / 2**30:.2f} GiB per device (pages_per_shard="
            f"{c.pages_per_shard} x page_size={c.page_size} x {c.num_layers} layers) but {d} "
            f"has {limit / 2**30:.2f} GiB; lower pages_per_shard or page_size.")
