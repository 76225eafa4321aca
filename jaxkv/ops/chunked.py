"""Paged attention over fixed-size chunks of pages with an online softmax (the ``jnp``
implementation of ``jaxkv.ops.paged_attention``).

Same contract as ``reference.paged_attention_reference`` (see there for the layout).
Instead of gathering every page of a sequence at once, it walks the page table in
chunks of ``pages_per_chunk`` pages (a loop that stops after the chunk holding the
batch's longest sequence), keeping a running max, sum and weighted accumulator per
query, and merges each chunk into them.

Why this is the path the engine runs:
- Memory: it materialises one chunk of K/V per step, not the whole context.
- Exactness of cache hits: a chunk covers a fixed range of absolute positions, and a
  chunk whose keys are all masked leaves the running state bit-for-bit unchanged
  (``alpha == 1``, nothing added). So a token's attention output does not depend on
  how wide the page table happened to be (the engine buckets widths by powers of two),
  nor on how many chunks the loop ran for the other rows of its batch:
  KV computed in a short early turn and KV recomputed later in a wide batch are the
  same bits. Tests check both the tolerance against the reference and this invariance.
- Sliding windows (``window``, see ``reference``): the mask also hides keys before each
  query's window, and the loop starts at the first chunk any query of the batch can see,
  so a long sequence's local layer reads about a window of keys, not the whole context.
  The chunks skipped are wholly masked, so skipping them changes no bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.ops.reference import check_window, first_visible, window_floor


def merge_chunk(state, qg, k, v, kpos, qpos, lens, valid=None, window=None):
  """Folds one chunk of keys/values into the running (max, sum, weighted sum).

  qg: [B, T, H, G, D] scaled float32 queries; k, v: [H, B, L, D]; kpos: [B or 1, L]
  absolute key positions; qpos: [B, T]; lens: [B]; valid: optional [B, L] bool;
  window: ``reference.check_window``'s form (None: no window).
  A chunk whose keys are all masked leaves the state bit-for-bit unchanged.
  """
  # state: [B, H, G, T, 1], [B, H, G, T, 1], [B, H, G, T, D]
  s = jnp.einsum("bthgd,hbld->bhgtl", qg, k.astype(jnp.float32))
  kp = kpos[:, None, None, None, :]
  mask = (kp <= qpos[:, None, None, :, None]) & (kp < lens[:, None, None, None, None])
  if window is not None:
    mask = mask & (kp > window_floor(qpos, window)[:, None, None, :, None])
  if valid is not None:
    mask = mask & valid[:, None, None, None, :]
  v = v.astype(jnp.float32)
  return fold(state, s, mask, lambda p: jnp.einsum("bhgtl,hbld->bhgtd", p, v))


def fold(state, s, mask, weighted):
  """The online-softmax step every path shares: folds scores ``s`` (``[..., L]``, masked
  by ``mask``) into ``state`` = (max, sum, acc) (``[..., 1]``, ``[..., 1]``, ``[..., D]``);
  ``weighted(p)`` is ``p @ V`` of the same chunk. All-masked rows leave the state's bits
  unchanged (``alpha == 1``, nothing added)."""
  m, l, acc = state
  s = jnp.where(mask, s, -jnp.inf)
  m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
  m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
  alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
  p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
  l = l * alpha + jnp.sum(p, axis=-1, keepdims=True)
  acc = acc * alpha + weighted(p)
  return m_new, l, acc


def init_state(q, num_kv_heads: int, scale: float | None = None):
  """Scaled grouped queries ``[B, T, H, G, D]`` and an empty (max, sum, acc) state.

  The state is built with ``*_like`` from q, so it carries q's sharding / varying axes
  when this runs inside ``shard_map``.
  """
  batch, q_len, num_q_heads, head_dim = q.shape
  group = num_q_heads // num_kv_heads
  if scale is None:
    scale = head_dim ** -0.5
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
  acc0 = jnp.zeros_like(jnp.moveaxis(qg, 1, 3))  # [B, H, G, T, D]
  return qg, (jnp.full_like(acc0[..., :1], -jnp.inf), jnp.zeros_like(acc0[..., :1]), acc0)


def finish(state, q):
  """Normalises the running state into attention output of ``q``'s shape and dtype."""
  _, l, acc = state
  out = acc / jnp.maximum(l, 1e-30)  # fully masked (padding) rows: 0
  out = out.transpose(0, 3, 1, 2, 4)  # [B, T, H, G, D]
  return out.reshape(q.shape).astype(q.dtype)


def layer_pages(pages, layer, table):
  """``pages[:, table]`` of one layer's pool (``layer`` None), or of the ``layer``-th of a
  stack ``[layers, H, P, S, D]`` gathered straight from the stack (no layer copied out):
  ``[H, *table.shape, S, D]``."""
  if layer is None:
    return pages[:, table]
  return jnp.moveaxis(pages[layer, :, table], table.ndim, 0)  # [*table, H, S, D] -> [H, ...]


def paged_state(state, qg, k_pages, v_pages, page_table, q_positions, kv_lens, *,
                pages_per_chunk: int, block_valid=None, layer=None, window=None):
  """Folds every page of ``page_table`` into ``state``, ``pages_per_chunk`` at a time.
  ``layer``: the pools are stacks of layers and this is the one attended (see
  ``layer_pages``); ``window``: a sliding window (``reference``'s module docstring).

  ``block_valid`` ([B, M] bool, optional) masks whole table entries: a sequence whose
  older pages live in a lower tier marks those entries invalid here and streams them.
  """
  window = check_window(window)
  batch = page_table.shape[0]
  num_kv_heads, _, page_size, head_dim = k_pages.shape[-4:]
  width = page_table.shape[1]
  num_chunks = -(-width // pages_per_chunk)
  pad = num_chunks * pages_per_chunk - width
  if pad:  # padded entries point at page 0 and are masked by position
    page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    if block_valid is not None:
      block_valid = jnp.pad(block_valid, ((0, 0), (0, pad)))
  chunk_tokens = pages_per_chunk * page_size
  entries = lambda x, c: jax.lax.dynamic_slice_in_dim(x, c * pages_per_chunk, pages_per_chunk, 1)

  def step(c, state):
    table = entries(page_table, c)
    k = layer_pages(k_pages, layer, table).reshape(num_kv_heads, batch, chunk_tokens, head_dim)
    v = layer_pages(v_pages, layer, table).reshape(num_kv_heads, batch, chunk_tokens, head_dim)
    kpos = (c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32))[None]
    valid = (None if block_valid is None
             else jnp.repeat(entries(block_valid, c), page_size, axis=1))
    return merge_chunk(state, qg, k, v, kpos, q_positions, kv_lens, valid, window)

  # Only the chunks below the longest sequence's length: the rest are masked for every
  # row and would leave the state unchanged, so a step costs what its sequences hold,
  # not what the table's width could hold. With a window, likewise only from the first
  # chunk a query of the batch can see.
  used = jnp.minimum(num_chunks, -(-jnp.max(kv_lens, initial=0) // chunk_tokens))
  start = 0 if window is None else jnp.min(first_visible(q_positions, window)) // chunk_tokens
  state = jax.lax.fori_loop(start, used, step, state)
  return state
