"""Pure-jnp paged attention: the definition every kernel is checked against.

Layout (the one JAX's own paged-attention kernels take):
- ``k_pages``, ``v_pages``: ``[kv_heads, num_pages, page_size, head_dim]`` for one layer.
- ``page_table``: ``[batch, pages_per_seq]`` int32 page ids; entry ``j`` of row ``b``
  holds tokens ``j*page_size .. (j+1)*page_size-1`` of sequence ``b``. Unused entries
  may hold any valid id: they are masked by position.
- ``q``: ``[batch, q_len, num_q_heads, head_dim]``; ``q_positions``: ``[batch, q_len]``
  absolute position of each query token, ``-1`` for padding (its output is 0).
- ``kv_lens``: ``[batch]`` number of valid KV tokens of each sequence.

One function serves decode (``q_len == 1``) and chunked causal prefill (the chunk's own
K/V are written to the pages first; query ``t`` then sees keys at positions
``<= q_positions[t]``). GQA: query head ``h`` reads kv head ``h // (num_q_heads //
kv_heads)``. Scores, softmax and the weighted sum run in float32.

Sliding windows (``window``, Gemma 3's local layers): with a window ``w > 0`` query ``t``
sees only keys at positions ``p`` with ``q_positions[t] - w < p <= q_positions[t]``, the
``w`` most recent tokens including its own. ``None`` or ``0`` is no window (every key up to
the query). ``w`` may be a Python int or a traced int32 scalar (a model scanning its layers
passes each layer's, ``0`` for its global layers); a Python ``0`` or ``None`` adds nothing
to the compiled graph (see ``check_window``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.errors import InputError


def check_window(window):
  """``window`` as the ops use it: ``None`` for no window (``None`` or a Python ``0``, so
  a layer without one compiles to exactly what it did before windows existed), a positive
  Python int, or an int32 scalar array (traced or not; ``0`` there also means no window,
  chosen at run time). Raises for a negative, non-integer or non-scalar value."""
  if window is None:
    return None
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    if window < 0:
      raise InputError(f"attention window={window} must be >= 0 (0 or None: no window; w > 0: "
                       "each query sees its w most recent tokens).")
    return int(window) or None
  if isinstance(window, (jax.Array, np.ndarray)) and window.shape == () and jnp.issubdtype(
      window.dtype, jnp.integer):
    return jnp.asarray(window, jnp.int32)
  raise InputError(f"attention window={window!r} must be None, a non-negative int or an "
                   "integer scalar array (a traced per-layer window; 0: no window).")


def window_floor(q_positions, window):
  """The last key position hidden from each query by ``window`` (``check_window``'s
  form, not None): a key at ``p`` is visible when ``p > floor``. ``-1`` (nothing hidden)
  where a traced window is 0."""
  if isinstance(window, int):
    return q_positions - window
  return jnp.where(window > 0, q_positions - window, -1)


def first_visible(q_positions, window):
  """``[B]``: the smallest key position any query of each row sees under ``window``
  (``check_window``'s form, not None); a row of padding alone gives int32's max, so a
  loop starting there runs no chunk."""
  first = jnp.maximum(window_floor(q_positions, window) + 1, 0)
  first = jnp.where(q_positions >= 0, first, jnp.iinfo(jnp.int32).max)
  return jnp.min(first, axis=1, initial=jnp.iinfo(jnp.int32).max).astype(jnp.int32)


def check_shapes(q, k_pages, v_pages, page_table, q_positions, kv_lens) -> None:
  """Raises ValueError for inconsistent shapes (static; runs at trace time)."""
  if q.ndim != 4 or k_pages.ndim != 4:
    raise InputError(f"q must be [batch, q_len, heads, head_dim] (got {q.shape}) and "
                     f"k_pages [kv_heads, pages, page_size, head_dim] (got {k_pages.shape}).")
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads = k_pages.shape[0]
  if k_pages.shape != v_pages.shape:
    raise InputError(f"{k_pages.shape=} must equal {v_pages.shape=}.")
  if k_pages.shape[3] != head_dim:
    raise InputError(f"q head_dim={head_dim} must equal the pages' head_dim={k_pages.shape[3]}.")
  if num_q_heads % num_kv_heads:
    raise InputError(f"{num_q_heads=} must be divisible by {num_kv_heads=}.")
  if page_table.ndim != 2 or page_table.shape[0] != batch:
    raise InputError(f"page_table must be [batch={batch}, pages_per_seq]; got {page_table.shape}.")
  if q_positions.shape != (batch, q_len):
    raise InputError(f"q_positions must be [batch, q_len]={(batch, q_len)}; got {q_positions.shape}.")
  if kv_lens.shape != (batch,):
    raise InputError(f"kv_lens must be [batch]={(batch,)}; got {kv_lens.shape}.")


def paged_attention_reference(q, k_pages, v_pages, page_table, q_positions, kv_lens, *,
                              scale: float | None = None, window=None):
  """Attention of ``q`` over the paged K/V of each sequence (``window``: see the module's
  docstring). Returns ``q``'s shape."""
  check_shapes(q, k_pages, v_pages, page_table, q_positions, kv_lens)
  window = check_window(window)
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  pages_per_seq = page_table.shape[1]
  kv_len_max = pages_per_seq * page_size
  if scale is None:
    scale = head_dim ** -0.5

  # Gather each sequence's pages into a contiguous [kv_heads, batch, tokens, head_dim].
  k = k_pages[:, page_table].reshape(num_kv_heads, batch, kv_len_max, head_dim)
  v = v_pages[:, page_table].reshape(num_kv_heads, batch, kv_len_max, head_dim)
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim).astype(jnp.float32) * scale

  scores = jnp.einsum("bthgd,hbld->bhgtl", qg, k.astype(jnp.float32))
  kv_pos = jnp.arange(kv_len_max, dtype=jnp.int32)
  mask = ((kv_pos[None, None, :] <= q_positions[:, :, None])
          & (kv_pos[None, None, :] < kv_lens[:, None, None]))  # [batch, q_len, tokens]
  if window is not None:
    mask = mask & (kv_pos[None, None, :] > window_floor(q_positions, window)[:, :, None])
  mask = mask[:, None, None]  # broadcast over kv heads and group
  scores = jnp.where(mask, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # fully masked (padding) rows
  p = jnp.where(mask, jnp.exp(scores - row_max), 0.0)
  p = p / jnp.maximum(jnp.sum(p, axis=-1, keepdims=True), 1e-30)
  out = jnp.einsum("bhgtl,hbld->bthgd", p, v.astype(jnp.float32))
  return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)


def write_pages_reference(k_pages, new, page_table, positions, layer=None):
  """Writes ``new`` ``[batch, q_len, kv_heads, head_dim]`` into pages at ``positions``.

  ``k_pages``: one layer's pool ``[kv_heads, pages, page_size, head_dim]``, or with
  ``layer`` (a scalar, traced or not) a stack of layers ``[layers, kv_heads, ...]`` whose
  ``layer``-th is written (in place in the stack: no layer is copied out).
  Tokens with position ``-1`` are dropped. Returns the updated pages (donate them to
  update in place).
  """
  k_pages, new, page_table, positions = map(jnp.asarray, (k_pages, new, page_table, positions))
  batch, q_len, num_kv_heads, head_dim = new.shape
  num_pages, page_size = k_pages.shape[-3], k_pages.shape[-2]
  pos = positions.reshape(-1)
  rows = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), q_len)
  valid = pos >= 0
  safe_pos = jnp.where(valid, pos, 0)
  page = page_table[rows, safe_pos // page_size]
  page = jnp.where(valid, page, num_pages)  # out of bounds: dropped by the scatter
  slot = safe_pos % page_size
  vals = new.reshape(batch * q_len, num_kv_heads, head_dim).astype(k_pages.dtype)
  if layer is None:  # [H, N, D]: the indexed dims stay where the slice puts them
    return k_pages.at[:, page, slot].set(vals.transpose(1, 0, 2), mode="drop")
  # (layer, :, page, slot): the scalar and the two index arrays are apart, so the indexed
  # dims come first: [N, H, D]
  return k_pages.at[layer, :, page, slot].set(vals, mode="drop")
