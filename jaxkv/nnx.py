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

A model that runs its layers under a scan (one layer compiled, the stacked weights scanned:
what ``jaxkv.models.Llama`` does) holds one ``PagedKV(..., num_layers=L)`` for the whole
stack, whose pages are ``[L, kv_heads, ...]``, and calls ``attend`` in the scan's body with
the layer index and the pages it carries; the pages are written and read in place in the
stack (no layer is copied out).

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
from jaxkv import config as config_lib
from jaxkv.config import CacheConfig
from jaxkv.errors import InputError


class KVPages(nnx.Cache):
  """One layer's K or V pages: ``[kv_heads, num_pages, page_size, head_dim]``; a stack of
  layers' (``PagedKV(num_layers=L)``): ``[L, kv_heads, num_pages, page_size, head_dim]``."""


class WindowPages(KVPages):
  """The K or V pages of a stack of sliding-window layers (``PagedKV(window=W)``): the
  cache's window group, ``[L, kv_heads, num_window_pages, page_size, head_dim]``. Its pages
  hold only what a running sequence's window still needs, and the cached windows before
  block boundaries (``jaxkv.manager.windows``), which host memory and the pool may keep
  copies of."""


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
  # [B] int32: the one token per row whose logits the step reads (a prefill's last prompt
  # token). A model may return logits for those alone, [B, 1, vocab]: the output head is
  # the largest matmul of a long prefill. None: every token's.
  logits_at: jax.Array | None = None
  # [B, pages_per_seq] int32: the window group's page of each block (shard-local ids of
  # the window pool); None when the cache has no window group.
  window_table: jax.Array | None = None


class PagedKV(nnx.Module):
  """Paged KV storage and attention for one layer, or with ``num_layers`` for a stack of
  identical layers run under a scan (``attend`` in the scan's body).

  ``window``: a stack of sliding-window layers that each see their ``window`` most recent
  tokens: the cache's window group. Its pages are the window pool's (``WindowPages``,
  addressed by ``PageBatch.window_table``), which keeps only the blocks a window still
  needs; without it every block of a sequence stays for these layers too."""

  def __init__(self, *, num_kv_heads: int, head_dim: int, num_layers: int | None = None,
               window: int = 0):
    if num_layers is not None and (not isinstance(num_layers, int) or isinstance(num_layers, bool)
                                   or num_layers <= 0):
      raise InputError(f"PagedKV num_layers={num_layers!r} must be a positive integer or None "
                       "(one layer).")
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
      raise InputError(f"PagedKV window={window!r} must be 0 or a positive number of tokens "
                       "(the sliding window of the layers in the cache's window group).")
    self.num_kv_heads = num_kv_heads
    self.head_dim = head_dim
    self.num_layers = num_layers
    self.window = window
    self.k_index = -1  # where this layer's K and V (a stack's first layer's) sit among the
    self.v_index = -1  # rows tiers move (set by init_pages; used to find them in the host pool)
    lead = () if num_layers is None else (num_layers,)
    empty = jnp.zeros((*lead, num_kv_heads, 0, 1, head_dim), jnp.float32)
    kind = WindowPages if window else KVPages
    self.k_pages = kind(empty)
    self.v_pages = kind(empty)

  @property
  def layers(self) -> int:
    """How many of the model's layers this holds (1, or the stack's length)."""
    return 1 if self.num_layers is None else self.num_layers

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, batch: PageBatch,
               layer=None, *, window=None) -> jax.Array:
    """q: [B, T, Hq, D]; k, v: [B, T, Hkv, D]. Returns attention output [B, T, Hq, D].
    ``layer``: which of a stack's layers (a stack's pages are updated in place);
    ``window``: a sliding window (see ``attend``)."""
    out, k_pages, v_pages = self.attend(q, k, v, batch, self.k_pages.get_value(),
                                        self.v_pages.get_value(), layer, window=window)
    self.k_pages.set_value(k_pages)
    self.v_pages.set_value(v_pages)
    return out

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, batch: PageBatch, k_pages,
             v_pages, layer=None, *, window=None):
    """The functional form, for a scan's body: writes ``k``/``v`` into ``k_pages``/``v_pages``
    (this module's pages as the scan carries them) at ``layer`` (a scalar, traced or not;
    None for a one-layer ``PagedKV``), attends, and returns ``(out, k_pages, v_pages)``.

    ``window``: a sliding window (Gemma 3's local layers): a query at position ``t`` sees
    keys at ``t - window < p <= t``. None or 0: every key up to ``t``. A scan over layers
    passes each layer's as a traced int32 scalar, 0 for its global layers; None (or a
    Python 0) adds nothing to the compiled step."""
    if (layer is None) != (self.num_layers is None):
      raise InputError(f"PagedKV(num_layers={self.num_layers}) called with layer={layer!r}: a "
                       "stack of layers needs the layer's index, one layer takes none.")
    if k_pages.shape[-3] == 0:
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
    table = batch.page_table
    if self.window:
      if batch.window_table is None:
        raise InputError("a PagedKV(window=...) stack needs PageBatch.window_table (the window "
                         "group's pages): build the cache from the model (CacheConfig.for_model "
                         "reads its window group) and run it through jaxkv's engine.")
      # A streamed sequence's window-group layers need nothing streamed: its ring in the
      # window pool holds every key their queries can see (jaxkv.worker.streaming).
      table, window, stream = batch.window_table, self.window, None
    return pages_lib.write_and_attend(
        q, k, v, k_pages, v_pages, table, batch.positions, batch.kv_lens,
        mesh=batch.mesh, config=batch.config, stream=stream, layer=layer, window=window)


def paged_layers(model: nnx.Module) -> list[PagedKV]:
  """The model's ``PagedKV`` modules in graph order (a stack counts for its ``layers``)."""
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, PagedKV)]


def layer_shapes(model: nnx.Module) -> dict:
  """``num_layers``, ``num_kv_heads`` and ``head_dim`` of an NNX model's ``PagedKV`` layers
  (their count, and the kv heads and head_dim every one must share): what
  ``jaxkv.config.model_shapes`` reads from a model without a config attribute. A model
  with a window group (``PagedKV(window=W)``) adds ``window_layers`` and ``sliding_window``;
  ``num_layers`` then counts the other layers (those whose blocks the tiers keep)."""
  layers = paged_layers(model) if isinstance(model, nnx.Module) else []
  if not layers:
    raise InputError(config_lib.no_shapes(model))
  kinds = sorted({(layer.num_kv_heads, layer.head_dim) for layer in layers})
  if len(kinds) != 1:
    raise InputError(f"the model's PagedKV layers have different (num_kv_heads, head_dim): "
                     f"{kinds}; one cache holds layers of one shape.")
  out = {"num_layers": sum(layer.layers for layer in layers if not layer.window),
         "num_kv_heads": kinds[0][0], "head_dim": kinds[0][1]}
  windows = sorted({layer.window for layer in layers if layer.window})
  if len(windows) > 1:
    raise InputError(f"the model's PagedKV stacks have different windows {windows}; one "
                     "cache keeps one window group.")
  if windows:
    out["window_layers"] = sum(layer.layers for layer in layers if layer.window)
    out["sliding_window"] = windows[0]
  return out


def num_paged_layers(model: nnx.Module) -> int:
  """How many layers keep KV in the model's ``PagedKV`` modules."""
  return sum(m.layers for m in paged_layers(model))


def init_pages(model: nnx.Module, config: CacheConfig, mesh: Mesh) -> None:
  """Allocates every ``PagedKV`` layer's pools (zeros) in the config's sharding: the window
  group's with ``config.window_pages_per_shard`` pages per shard."""
  layers = paged_layers(model)
  count = sum(m.layers for m in layers if not m.window)
  windowed = sum(m.layers for m in layers if m.window)
  if count != config.num_layers or windowed != config.window_layers:
    raise InputError(
        f"the model has {count} PagedKV layers and {windowed} in a window group but "
        f"CacheConfig.num_layers={config.num_layers}, window_layers={config.window_layers}; "
        "make them agree (CacheConfig.for_model(model, ...) reads them).")
  for i, layer in enumerate(layers):
    if (layer.num_kv_heads, layer.head_dim) != (config.num_kv_heads, config.head_dim):
      raise InputError(
          f"PagedKV layer {i} has num_kv_heads={layer.num_kv_heads}, head_dim={layer.head_dim}"
          f" but CacheConfig has num_kv_heads={config.num_kv_heads}, head_dim="
          f"{config.head_dim}; make them agree.")
  pages_lib.validate_mesh(mesh, config)
  for layer in layers:
    pages = config.window_pages_per_shard if layer.window else None
    layer.k_pages.set_value(pages_lib.zeros_pool(mesh, config, layers=layer.num_layers,
                                                 pages=pages))
    layer.v_pages.set_value(pages_lib.zeros_pool(mesh, config, layers=layer.num_layers,
                                                 pages=pages))
  # The flattened cache state's page arrays give a block's rows in the tiers (gather_stacked:
  # K0, V0, K1, V1, ...; a stack's layers interleaved): remember where each layer's K and V
  # (a stack's layer 0's) are. The window group's are not among them.
  windows = window_leaf_ids(model)
  leaves = [x for x in jax.tree.leaves(nnx.state(model, KVPages)) if id(x) not in windows]
  order = {id(leaf): row for leaf, row in zip(leaves, pages_lib.first_rows(leaves))}
  for layer in layers:
    if not layer.window:
      layer.k_index = order[id(layer.k_pages.get_value())]
      layer.v_index = order[id(layer.v_pages.get_value())]


def window_leaf_ids(model: nnx.Module) -> frozenset:
  """``id`` of the arrays of the model's window group (``WindowPages``), as they are now."""
  return frozenset(id(x) for x in jax.tree.leaves(nnx.state(model, WindowPages)))
