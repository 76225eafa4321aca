"""The device page pool: sharded arrays and the shard-local ops that touch them.

One layer's pool is ``[kv_heads, data_shards * pages_per_shard, page_size, head_dim]``
with sharding ``P(model_axis, data_axis, None, None)``: kv heads split over the model
axis, pages over the data axis. Each data shard therefore owns pages
``[s*pages_per_shard, (s+1)*pages_per_shard)`` of the global array, and everything that
addresses pages uses *shard-local* ids ``0 .. pages_per_shard-1`` inside ``shard_map``.
A global id on the sharded axis would make XLA insert collectives; local ids keep every
gather and scatter on the device that owns the page (tests check the compiled HLO).

Batches follow the pool: row ``b`` of a batch of ``B`` rows lives on data shard
``b // (B // data_shards)`` and its page table holds that shard's local ids.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv.config import CacheConfig
from jaxkv.ops import chunked, select, streamed
from jaxkv.ops import reference
from jaxkv.errors import InputError

COLLECTIVE_OPS = ("all-gather", "all-reduce", "all-to-all", "collective-permute",
                  "reduce-scatter", "collective-broadcast", "ragged-all-to-all")


def data_shards(mesh: Mesh, config: CacheConfig) -> int:
  return mesh.shape[config.data_axis]


def validate_mesh(mesh: Mesh, config: CacheConfig) -> None:
  """Raises ValueError when ``mesh`` cannot hold ``config``'s pool."""
  for axis in (config.data_axis, config.model_axis):
    if axis not in mesh.shape:
      raise InputError(
          f"mesh axes {tuple(mesh.axis_names)} lack CacheConfig axis {axis!r}; build the mesh "
          f"with jaxkv.make_mesh(data=..., model=...) or set data_axis/model_axis to its names.")
  model = mesh.shape[config.model_axis]
  if config.num_kv_heads % model:
    raise InputError(
        f"num_kv_heads={config.num_kv_heads} must be divisible by the model axis size "
        f"{model}: kv heads are split over it. Use a model axis that divides the kv heads.")
  explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types)
              if t == jax.sharding.AxisType.Explicit]
  if explicit:
    raise InputError(
        f"mesh axes {explicit} are Explicit; jaxkv needs Auto axes "
        "(jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,)*n) or jaxkv.make_mesh).")


def make_mesh(*, data: int, model: int = 1, data_axis: str = "data", model_axis: str = "model",
              devices=None) -> Mesh:
  """A ``data x model`` mesh with Auto axis types over ``devices`` (default: all)."""
  devices = jax.devices() if devices is None else list(devices)
  if data * model != len(devices):
    raise InputError(f"mesh data={data} x model={model} needs {data * model} devices; "
                     f"{len(devices)} are available. Choose sizes whose product is {len(devices)}.")
  return jax.make_mesh((data, model), (data_axis, model_axis),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def pool_spec(config: CacheConfig) -> P:
  return P(config.model_axis, config.data_axis, None, None)


def batch_spec(config: CacheConfig, ndim: int) -> P:
  return P(config.data_axis, *([None] * (ndim - 1)))


def pool_sharding(mesh: Mesh, config: CacheConfig, memory_kind: str | None = None):
  s = NamedSharding(mesh, pool_spec(config))
  return s.with_memory_kind(memory_kind) if memory_kind else s


def pool_shape(mesh: Mesh, config: CacheConfig, pages: int | None = None
               ) -> tuple[int, int, int, int]:
  """One layer's pool: ``pages`` per shard (default ``pages_per_shard``; the window
  group's pool has ``window_pages_per_shard``)."""
  pages = config.pages_per_shard if pages is None else pages
  return (config.num_kv_heads, data_shards(mesh, config) * pages,
          config.page_size, config.head_dim)


def layer_stack_spec(config: CacheConfig) -> P:
  """Sharding of a stack of layers' pools ``[layers, kv_heads, pages, page_size,
  head_dim]`` (one ``PagedKV`` of a model that scans its layers)."""
  return P(None, *pool_spec(config))


def spec_of(pool, config: CacheConfig) -> P:
  """A pool's sharding spec by its rank: one layer's (4-d) or a stack of layers' (5-d)."""
  return pool_spec(config) if pool.ndim == 4 else layer_stack_spec(config)


def pool_layers(pool) -> int:
  """How many layers' K (or V) one pool array holds: 1, or a stack's length."""
  return 1 if pool.ndim == 4 else pool.shape[0]


def zeros_pool(mesh: Mesh, config: CacheConfig, memory_kind: str | None = None,
               layers: int | None = None, pages: int | None = None) -> jax.Array:
  """One layer's pool of zeros (or, with ``layers``, a stack ``[layers, ...]`` of them),
  created directly in its sharding (no host copy); ``pages`` per shard as ``pool_shape``."""
  return _zeros_fn(mesh, config, memory_kind, layers, pages)()


@functools.lru_cache(maxsize=None)
def _zeros_fn(mesh: Mesh, config: CacheConfig, memory_kind: str | None, layers: int | None,
              pages: int | None = None):
  shape = pool_shape(mesh, config, pages)
  spec = pool_spec(config)
  if layers is not None:
    shape, spec = (layers, *shape), layer_stack_spec(config)
  sharding = NamedSharding(mesh, spec)
  return jax.jit(lambda: jnp.zeros(shape, config.jnp_dtype),
                 out_shardings=sharding.with_memory_kind(memory_kind) if memory_kind
                 else sharding)


# ---- the fused write + attention used by every model layer --------------------------------
def write_and_attend(q, k_new, v_new, k_pages, v_pages, page_table, positions, kv_lens, *,
                     mesh: Mesh, config: CacheConfig, stream=None, layer=None, window=None):
  """Writes this step's K/V into the pages, then attends over them. Traced inside jit.

  q: [B, T, Hq, D]; k_new, v_new: [B, T, Hkv, D]; pages: one layer's pool, or with
  ``layer`` (a scalar, traced under a scan over layers) a stack of layers' pools of which
  the ``layer``-th is written and attended in place;
  page_table: [B, M] shard-local ids; positions: [B, T] (-1 = padding); kv_lens: [B].
  ``stream``: for sequences longer than the device holds, a ``StreamArgs`` naming the
  hot entries of the table and the cold pages to stream from the host pool.
  ``window``: a sliding window (``jaxkv.ops.reference``: None or 0 none; a positive int;
  or a traced int32 scalar, 0 for a global layer): each query sees its ``window`` most
  recent tokens.
  Returns (out [B, T, Hq, D], k_pages, v_pages).
  """
  heads = P(config.data_axis, None, config.model_axis, None)
  rows = P(config.data_axis, None)
  row = P(config.data_axis)
  pool = spec_of(k_pages, config)
  if (layer is None) != (k_pages.ndim == 4):
    raise InputError(f"pages of shape {k_pages.shape} with layer={layer!r}: one layer's pool "
                     "takes no layer; a stack of layers [layers, ...] needs one.")
  layer_arg = () if layer is None else (jnp.asarray(layer, jnp.int32),)
  window = reference.check_window(window)
  # A Python window is a constant of the traced function; a traced one crosses into the
  # shard_map as a replicated scalar, like the layer.
  window_arg = (window,) if isinstance(window, jax.Array) else ()
  scalars = layer_arg + window_arg

  def local(q, k_new, v_new, k_pages, v_pages, page_table, positions, kv_lens, *extra):
    at = extra[0] if layer_arg else None
    span = extra[len(layer_arg)] if window_arg else window
    extra = extra[len(scalars):]
    k_pages = reference.write_pages_reference(k_pages, k_new, page_table, positions, at)
    v_pages = reference.write_pages_reference(v_pages, v_new, page_table, positions, at)
    qg, state = chunked.init_state(q, k_pages.shape[-4])
    block_valid = extra[0] if extra else None
    state = select.paged_state(state, qg, k_pages, v_pages, page_table, positions, kv_lens,
                               pages_per_chunk=config.attention_chunk_pages,
                               block_valid=block_valid, impl=config.attention_impl, layer=at,
                               window=span)
    if extra:
      _, host_pool, slots, first, count = extra
      offset = 0 if at is None else 2 * at  # a stack's layers are K, V rows layer by layer
      state = streamed.stream_state(state, qg, host_pool, stream.k_index + offset,
                                    stream.v_index + offset,
                                    slots, first, count, positions, kv_lens,
                                    pages_per_chunk=stream.pages_per_chunk,
                                    dtype=k_pages.dtype, window=span)
    return chunked.finish(state, q), k_pages, v_pages

  in_specs = [heads, heads, heads, pool, pool, rows, rows, row] + [P()] * len(scalars)
  args = [q, k_new, v_new, k_pages, v_pages, page_table, positions, kv_lens, *scalars]
  if stream is not None:
    in_specs += [rows, host_spec(config), rows, row, row]
    args += [stream.block_valid, stream.host_pool, stream.cold_slots, stream.cold_first,
             stream.cold_count]
  # Varying-axis checks are off where a streamed host pool or a Pallas call would trip them.
  check = stream is None and select.resolve(config.attention_impl)[0] == "jnp"
  fn = jax.shard_map(local, mesh=mesh, in_specs=tuple(in_specs),
                     out_specs=(heads, pool, pool), check_vma=check)
  return fn(*args)


# ---- whole-page moves (tiers use these) ---------------------------------------------------
@functools.lru_cache(maxsize=None)
def _gather_fn(mesh: Mesh, config: CacheConfig):
  pool = pool_spec(config)
  ids = P(config.data_axis, None)

  def local(pages, page_ids):  # pages [H, P_local, S, D]; page_ids [1, n]
    return pages[:, page_ids[0]]

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(pool, ids), out_specs=pool))


@functools.lru_cache(maxsize=None)
def _scatter_fn(mesh: Mesh, config: CacheConfig):
  pool = pool_spec(config)
  ids = P(config.data_axis, None)

  def local(pages, page_ids, values):  # values [H, n, S, D]
    return pages.at[:, page_ids[0]].set(values, mode="drop")

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(pool, ids, pool), out_specs=pool),
                 donate_argnums=(0,))


def gather_pages(pages: jax.Array, page_ids: jax.Array, *, mesh: Mesh,
                 config: CacheConfig) -> jax.Array:
  """Copies pages out of a pool: ``page_ids`` ``[data_shards, n]`` shard-local ids.

  Returns ``[kv_heads, data_shards * n, page_size, head_dim]`` in the pool's sharding:
  rows ``s*n .. (s+1)*n-1`` are shard ``s``'s pages, gathered on the device holding them.
  """
  return _gather_fn(mesh, config)(pages, page_ids)


def scatter_pages(pages: jax.Array, page_ids: jax.Array, values: jax.Array, *, mesh: Mesh,
                  config: CacheConfig) -> jax.Array:
  """Writes whole pages into a pool (donated: updated in place). Inverse of gather.

  Ids ``>= pages_per_shard`` are dropped, so callers can pad ``page_ids`` to a bucket.
  """
  return _scatter_fn(mesh, config)(pages, page_ids, values)


# ---- all layers at once: the unit tiers move -----------------------------------------------
# Pages travel between tiers as raw bits (uint16/uint32): XLA may compute a bfloat16 gather
# or scatter in float32 on some backends, which would canonicalise NaN payloads. Moving
# integers keeps every round trip bit-exact.
# A block's rows are its layers' K and V, layer by layer (K0, V0, K1, V1, ...), whatever
# form the model keeps its pools in: one-layer pools (a model that loops over its layers)
# are one row each, in leaf order (each layer's K then V); a stack of layers (a scanned
# model's K stack and V stack, adjacent leaves) gives its layers' rows interleaved. So a
# record's bytes mean the same for both forms. ``ranks`` (each pool's ndim) is what the
# jitted functions are specialised on.
def bits_dtype(dtype):
  return {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(dtype).itemsize]


def to_bits(x):
  return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


def stacked_spec(config: CacheConfig) -> P:
  """Sharding of ``[2 * layers, kv_heads, data_shards * n, page_size, head_dim]`` stacks."""
  return P(None, config.model_axis, config.data_axis, None, None)


def pool_ranks(pools) -> tuple[int, ...]:
  """What the stacked moves are specialised on: each pool's ndim (4: one layer, 5: a stack)."""
  return tuple(p.ndim for p in pools)


def _rank_specs(config: CacheConfig, ranks) -> tuple:
  return tuple(pool_spec(config) if r == 4 else layer_stack_spec(config) for r in ranks)


def row_groups(ranks) -> list[tuple[int, ...]]:
  """The pools (by position) that give a block's rows together: a one-layer pool alone, a
  stack of layers with the next pool (its K stack, then its V stack)."""
  groups, i = [], 0
  while i < len(ranks):
    if ranks[i] == 4:
      groups.append((i,))
      i += 1
    elif ranks[i] == 5 and i + 1 < len(ranks) and ranks[i + 1] == 5:
      groups.append((i, i + 1))
      i += 2
    else:
      raise InputError(f"pools of ranks {tuple(ranks)}: a stack of layers' pools ([layers, "
                       "kv_heads, pages, page_size, head_dim]) comes as a K stack followed by its "
                       "V stack (one PagedKV(num_layers=L)); one layer's pools are 4-d.")
  return groups


def first_rows(pools) -> list[int]:
  """Each pool's first row in a block (see above): a one-layer pool's own row; a K stack's
  layer-0 K row and its V stack's layer-0 V row (layer ``l``'s are ``2 * l`` further on)."""
  rows, row = [0] * len(pools), 0
  for group in row_groups(pool_ranks(pools)):
    for j, i in enumerate(group):
      rows[i] = row + j
    row += 1 if len(group) == 1 else 2 * pools[group[0]].shape[0]
  return rows


def host_spec(config: CacheConfig) -> P:
  """Sharding of the host pool ``[data_shards * (host_pages + 1), 2 * layers, kv_heads,
  page_size, head_dim]``: page-major, so one block of one shard is one contiguous region
  (``jaxkv.worker.tiers.host``)."""
  return P(config.data_axis, None, config.model_axis, None, None)


def local_gather_stacked(pools, page_ids, ranks):
  """Inside ``shard_map``: the pages ``page_ids[0]`` of every pool as one raw-bits stack
  ``[2 * layers, kv_heads, n, page_size, head_dim]`` (rows in block order, see above)."""
  rows = []
  for group in row_groups(ranks):
    got = [to_bits(pools[i])[..., page_ids[0], :, :] for i in group]
    if len(group) == 1:
      rows.append(got[0][None])
    else:  # [L, 2, H, n, S, D] -> rows K0, V0, K1, V1, ...
      pair = jnp.stack(got, axis=1)
      rows.append(pair.reshape(-1, *pair.shape[2:]))
  return jnp.concatenate(rows)


def local_gather_blocks(pools, page_ids, ranks):
  """``local_gather_stacked`` page-major: ``[n, 2 * layers, kv_heads, page_size,
  head_dim]``, each block contiguous (what a host slot holds)."""
  rows = []
  for group in row_groups(ranks):
    got = [jnp.moveaxis(to_bits(pools[i])[..., page_ids[0], :, :], -3, 0) for i in group]
    if len(group) == 1:  # [n, H, S, D]
      rows.append(got[0][:, None])
    else:  # [n, L, H, S, D] x 2 -> rows K0, V0, K1, V1, ...
      pair = jnp.stack(got, axis=2)
      rows.append(pair.reshape(pair.shape[0], -1, *pair.shape[3:]))
  return jnp.concatenate(rows, axis=1)


@functools.lru_cache(maxsize=None)
def gather_stacked_fn(mesh: Mesh, config: CacheConfig, ranks: tuple[int, ...]):
  """The jitted function behind ``gather_stacked`` for pools of these ranks."""
  ids = P(config.data_axis, None)

  def local(pools, page_ids):
    return local_gather_stacked(pools, page_ids, ranks)

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(_rank_specs(config, ranks), ids),
                               out_specs=stacked_spec(config)))


def local_scatter_stacked(pools, page_ids, values, ranks) -> tuple:
  """Inside ``shard_map``: a raw-bits stack ``values`` written into pages ``page_ids[0]``
  of every pool (ids ``>= pages`` dropped); returns the new pools."""
  def put(p, rows):
    return jax.lax.bitcast_convert_type(
        to_bits(p).at[..., page_ids[0], :, :].set(rows, mode="drop"), p.dtype)

  out, row = list(pools), 0
  for group in row_groups(ranks):
    if len(group) == 1:
      out[group[0]] = put(pools[group[0]], values[row])
      row += 1
    else:
      n = pools[group[0]].shape[0]
      pair = values[row:row + 2 * n].reshape(n, 2, *values.shape[1:])
      for j, i in enumerate(group):
        out[i] = put(pools[i], pair[:, j])
      row += 2 * n
  return tuple(out)


@functools.lru_cache(maxsize=None)
def scatter_stacked_fn(mesh: Mesh, config: CacheConfig, ranks: tuple[int, ...],
                       blocks: bool = False):
  """The jitted function behind ``scatter_stacked`` (pools donated); with ``blocks``, of
  page-major values ``[n, 2 * layers, kv_heads, page_size, head_dim]`` (``host_spec``
  sharding: what the host tier loads)."""
  ids, specs = P(config.data_axis, None), _rank_specs(config, ranks)

  def local(pools, page_ids, values):
    if blocks:
      values = jnp.moveaxis(values, 0, 2)
    return local_scatter_stacked(pools, page_ids, values, ranks)

  values_spec = host_spec(config) if blocks else stacked_spec(config)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, ids, values_spec),
                               out_specs=specs), donate_argnums=(0,))


def scatter_blocks_fn(mesh: Mesh, config: CacheConfig, ranks: tuple[int, ...]):
  """``scatter_stacked_fn`` for page-major blocks."""
  return scatter_stacked_fn(mesh, config, ranks, True)


def gather_stacked(pools, page_ids, *, mesh: Mesh, config: CacheConfig) -> jax.Array:
  """Copies pages of every pool (all layers' K and V) into one stack of raw bits.

  ``page_ids``: ``[data_shards, n]`` shard-local ids. Returns ``[2 * layers, kv_heads,
  data_shards * n, page_size, head_dim]`` of ``bits_dtype`` (rows in the order above);
  rows ``s*n..`` of the page axis are shard ``s``'s pages.
  """
  return gather_stacked_fn(mesh, config, pool_ranks(pools))(tuple(pools), page_ids)


def scatter_stacked(pools, page_ids, values, *, mesh: Mesh, config: CacheConfig) -> tuple:
  """Writes a raw-bits stack into every pool (donated: in place); ids ``>= pages`` are
  dropped."""
  return scatter_stacked_fn(mesh, config, pool_ranks(pools))(tuple(pools), page_ids, values)


_MIX = np.uint32(2654435761)  # odd: a flipped bit always changes the weighted sum
_OFFSET = np.uint32(0x9E3779B9)


def _words(bits):
  """Raw bits as uint32 words (two uint16 per word where the last axis allows)."""
  if bits.dtype.itemsize == 2 and bits.shape[-1] % 2 == 0:
    bits = jax.lax.bitcast_convert_type(bits.reshape(*bits.shape[:-1], bits.shape[-1] // 2, 2),
                                        jnp.uint32)
  return bits.astype(jnp.uint32)


def _weights(a: int, h: int, t: int, d: int, config: CacheConfig, model: int):
  """One weight per word of a page ``[a, h, t, d]`` (inside ``shard_map``): from the word's
  position in the *global* page (kv heads numbered across the model axis), so the partial
  sums of the model shards add up to the same total on any mesh."""
  head = jax.lax.axis_index(config.model_axis) * h + jnp.arange(h)
  pos = ((jnp.arange(a)[:, None, None, None] * (h * model) + head[None, :, None, None]) * t
         + jnp.arange(t)[None, None, :, None]) * d + jnp.arange(d)[None, None, None, :]
  return pos.astype(jnp.uint32) * _MIX + _OFFSET


def local_page_checksums(stack, config: CacheConfig, model: int):
  """Inside ``shard_map``: ``page_checksums`` of this shard's part of a raw-bits stack
  ``[arrays, kv_heads/model, n, page_size, head_dim]``; returns ``[n, 1]`` uint32 (this
  model shard's partial sums)."""
  words = _words(stack)
  a, h, _, t, d = words.shape
  weights = _weights(a, h, t, d, config, model)[:, :, None]
  return jnp.sum(words * weights, axis=(0, 1, 3, 4), dtype=jnp.uint32)[:, None]


def local_block_checksums(blocks, config: CacheConfig, model: int):
  """``local_page_checksums`` of page-major blocks ``[n, arrays, kv_heads/model, page_size,
  head_dim]``: the same values, each block's words reduced where they lie (contiguous)."""
  words = _words(blocks)
  n, a, h, t, d = words.shape
  weighted = words * _weights(a, h, t, d, config, model)[None]
  return jnp.sum(weighted.reshape(n, -1), axis=1, dtype=jnp.uint32)[:, None]


def checksums_spec(config: CacheConfig) -> P:
  """Sharding of ``page_checksums``' ``[data_shards * n, model]`` partial sums."""
  return P(config.data_axis, config.model_axis)


@functools.lru_cache(maxsize=None)
def _checksum_fn(mesh: Mesh, config: CacheConfig):
  model = mesh.shape[config.model_axis]
  return jax.jit(jax.shard_map(lambda stack: local_page_checksums(stack, config, model),
                               mesh=mesh, in_specs=stacked_spec(config),
                               out_specs=checksums_spec(config)))


def checksum_total(partials) -> np.ndarray:
  """One checksum per page from ``page_checksums`` partials, equal on every mesh."""
  from jaxkv.distributed import to_host
  return to_host(partials).astype(np.uint64).sum(axis=-1).astype(np.uint32)


def page_checksums(stack: jax.Array, *, mesh: Mesh, config: CacheConfig) -> jax.Array:
  """Position-weighted 32-bit sums of every page's bits, computed where the bytes are.

  ``stack``: a raw-bits stack (``gather_stacked``). Returns ``[data_shards * n, model]``
  uint32: one sum per page and per model shard (no collective needed). Any single
  flipped bit changes it, and so does a page moved to another slot.
  """
  return _checksum_fn(mesh, config)(stack)


@functools.lru_cache(maxsize=None)
def _copy_fn(mesh: Mesh, config: CacheConfig, ranks: tuple[int, ...]):
  def copy(pools, src, dst):  # global page ids: XLA moves the pages between shards
    return tuple(p.at[..., dst, :, :].set(p[..., src, :, :], mode="drop") for p in pools)

  return jax.jit(copy, donate_argnums=(0,),
                 out_shardings=tuple(NamedSharding(mesh, s) for s in _rank_specs(config, ranks)))


def copy_across_shards(pools, src, dst, *, mesh: Mesh, config: CacheConfig) -> tuple:
  """Copies pages between data shards (a jitted collective): ``src``/``dst`` are global
  page ids (``shard * pages_per_shard + page``); ``dst`` beyond the pool is dropped."""
  return _copy_fn(mesh, config, pool_ranks(pools))(tuple(pools), src, dst)


def copy_pages(pools, copies, slots: int, *, mesh: Mesh, config: CacheConfig) -> list:
  """Copies pages within each shard of every pool in ``pools`` (donated): ``copies`` is
  ``(shard, src, dst)`` triples of shard-local ids, at most ``slots`` per shard (one
  compiled shape). Unused slots copy page 0 onto itself, which the window pool never hands
  out; of two copies to one page, the later. Returns the new pools."""
  shards = data_shards(mesh, config)
  src = np.zeros((shards, slots), np.int32)
  dst = np.zeros((shards, slots), np.int32)
  used = [0] * shards
  # A page given out again before its first copy ran takes the later copy only (one scatter
  # has no order among equal destinations).
  last = {(shard, b): a for shard, a, b in copies}
  for (shard, b), a in last.items():
    if used[shard] == slots:
      raise InputError(f"{used[shard] + 1} window copies on shard {shard} in one order; at "
                       f"most {slots} (CacheConfig.window_copy_slots).")
    src[shard, used[shard]], dst[shard, used[shard]] = a, b
    used[shard] += 1
  ids = NamedSharding(mesh, P(config.data_axis, None))
  src, dst = jax.device_put([src, dst], [ids, ids])
  return list(copy_pages_fn(mesh, config, pool_ranks(pools))(tuple(pools), src, dst))


@functools.lru_cache(maxsize=None)
def copy_pages_fn(mesh: Mesh, config: CacheConfig, ranks: tuple[int, ...]):
  """The jitted function behind ``copy_pages`` for pools of these ranks."""
  ids = P(config.data_axis, None)

  def local(pools, src, dst):
    out = []
    for p in pools:
      axis = p.ndim - 3  # the page axis: [.., kv_heads, pages, page_size, head_dim]
      pages = jnp.take(p, src[0], axis=axis)
      index = (slice(None),) * axis + (dst[0],)
      out.append(p.at[index].set(pages))
    return tuple(out)

  specs = _rank_specs(config, ranks)
  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(specs, ids, ids), out_specs=specs),
                 donate_argnums=(0,))
