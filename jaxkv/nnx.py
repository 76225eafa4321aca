"""The Flax NNX layer a model calls to keep its KV cache in jaxkv pages.

A user's attention module holds one ``PagedKV`` and calls it with the step's queries,
keys and values after projection (and RoPE):

    class Attention(nnx.Module):
      def __init__(self, ...):
        ...
        self.kv = jaxkv.nnx.PagedKV(num_kv_heads=kv_heads, head_dim=head_dim)

      def __call__(self, x, batch: jaxkv.nnx.PageBatch):
        q, k, v = ...                   # [B, T, heads, head_dim], positions from batch
        out = self.kv(q, k, v, batch)   # writes k, v into pages, attends over them
        return self.o_proj(out.reshape(...))

The page arrays are ``KVPages`` variables, a subtype of ``nnx.Cache``, so NNX filters
see them: ``nnx.split(model, jaxkv.nnx.KVPages, ...)`` separates the cache from the
weights, which is how the engine donates the cache to each jitted step. ``PagedKV``
holds empty placeholders until ``init_pages`` (called by the engine) allocates the
sharded pools described by a ``CacheConfig``; the layer count, kv heads and head_dim
the model declares are checked against the config there.

``PageBatch`` is the per-step metadata every layer shares: page tables with shard-local
ids, the absolute position of every token (``-1`` = padding) and the KV length of each
sequence. It is a frozen pytree; the mesh and config ride along as static fields.
"""

from __future__ import annotations

import dataclasses
import types

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxkv.worker import pages as pages_lib
from jaxkv.config import CacheConfig
from jaxkv.errors import InputError


class KVPages(nnx.Cache):
  """One layer's K or V pages: ``[kv_heads, num_pages, page_size, head_dim]``."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StreamBatch:
  """Sequences longer than the device holds: which table entries are hot (on device)
  and which pages to stream from the host pool (see ``jaxkv.ops.streamed``)."""

  block_valid: jax.Array  # [B, pages_per_seq] bool: the entry's page is on device
  host_pool: jax.Array  # the host tier's pool (raw bits, host memory kind)
  cold_slots: jax.Array  # [B, C] int32 host slots of the cold pages, oldest first
  cold_first: jax.Array  # [B] int32 logical block of the first cold page
  cold_count: jax.Array  # [B] int32 cold pages in use
  pages_per_chunk: int = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageBatch:
  """What every paged-attention layer needs to know about the current step."""

  page_table: jax.Array  # [B, pages_per_seq] int32, shard-local page ids
  positions: jax.Array  # [B, T] int32 absolute positions, -1 = padding token
  kv_lens: jax.Array  # [B] int32 valid KV tokens after this step's write
  mesh: Mesh = dataclasses.field(metadata=dict(static=True))
  config: CacheConfig = dataclasses.field(metadata=dict(static=True))
  stream: StreamBatch | None = None


class PagedKV(nnx.Module):
  """Paged KV storage and attention for one layer."""

  def __init__(self, *, num_kv_heads: int, head_dim: int):
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.k_index = -1  # where this layer's K and V sit among the cache's page arrays
    self.v_index = -1  # (set by init_pages; used to find them in the host pool)
    empty = jnp.zeros((num_kv_heads, 0, 1, head_dim), jnp.float32)
    self.k_pages = KVPages(empty)
    self.v_pages = KVPages(empty)

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, batch: PageBatch) -> jax.Array:
    """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]. Returns attention output [B, T, Hq, D]."""
    k_pages, v_pages = self.k_pages.get_value(), self.v_pages.get_value()
    if k_pages.shape[1] == 0:
      raise InputError("PagedKV has no pages yet: the engine calls jaxkv.nnx.init_pages(model, "
                       "config, mesh) before the first step; call it if you drive the model.")
    if k.shape[2:] != (self.num_kv_heads, self.head_dim) or v.shape != k.shape:
      raise InputError(f"k/v must be [B, T, {self.num_kv_heads}, {self.head_dim}]; "
                       f"got k {k.shape}, v {v.shape}.")
    stream = None
    if batch.stream is not None:
      st = batch.stream
      stream = types.SimpleNamespace(
          block_valid=st.block_valid, host_pool=st.host_pool, cold_slots=st.cold_slots,
          cold_first=st.cold_first, cold_count=st.cold_count,
          pages_per_chunk=st.pages_per_chunk, k_index=self.k_index, v_index=self.v_index)
    out, k_pages, v_pages = pages_lib.write_and_attend(
        q, k, v, k_pages, v_pages, batch.page_table, batch.positions, batch.kv_lens,
        mesh=batch.mesh, config=batch.config, stream=stream)
    self.k_pages.set_value(k_pages)
    self.v_pages.set_value(v_pages)
    return out


def paged_layers(model: nnx.Module) -> list[PagedKV]:
  """The model's ``PagedKV`` layers in graph order (that order is the layer index)."""
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, PagedKV)]


def init_pages(model: nnx.Module, config: CacheConfig, mesh: Mesh) -> None:
  """Allocates every ``PagedKV`` layer's pools (zeros) in the config's sharding."""
  layers = paged_layers(model)
  if len(layers) != config.num_layers:
    raise InputError(
        f"the model has {len(layers)} PagedKV layers but CacheConfig.num_layers="
        f"{config.num_layers}; make them agree.")
  for i, layer in enumerate(layers):
    if (layer.num_kv_heads, layer.head_dim) != (config.num_kv_heads, config.head_dim):
      raise InputError(
          f"PagedKV layer {i} has num_kv_heads={layer.num_kv_heads}, head_dim={layer.head_dim}"
          f" but CacheConfig has num_kv_heads={config.num_kv_heads}, head_dim="
          f"{config.head_dim}; make them agree.")
  pages_lib.validate_mesh(mesh, config)
  for layer in layers:
    layer.k_pages.set_value(pages_lib.zeros_pool(mesh, config))
    layer.v_pages.set_value(pages_lib.zeros_pool(mesh, config))
  # The order of the page arrays in the flattened cache state is the order of the
  # stacks the tiers move (gather_stacked): remember where each layer's K and V are.
  order = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(nnx.state(model, KVPages)))}
  for layer in layers:
    layer.k_index = order[id(layer.k_pages.get_value())]
    layer.v_index = order[id(layer.v_pages.get_value())]
