"""Attention over pages that live in host memory, streamed through device in chunks.

A long sequence keeps its hot pages (the first "sink" pages and a recent window) in the
device pool and the rest, its *cold* pages, in the host pool. ``stream_state`` folds the
cold pages into the same online-softmax state ``chunked.paged_state`` builds from the hot
ones, ``pages_per_chunk`` host pages at a time:

- each chunk's pages are sliced out of the host pool (one ``dynamic_slice`` per page and
  array, on host memory: a contiguous region of the page-major pool) and transferred to device memory, then attended and merged;
- double buffering: step ``c`` issues the transfer of chunk ``c + 1`` *before* it
  computes on chunk ``c``, so the copy of the next chunk overlaps the attention of this
  one; at most two chunks per layer are on device at once (the staging budget);
- cold page ``j`` of row ``b`` is logical block ``cold_first[b] + j``: positions, and so the
  causal mask, come from there, and entries past ``cold_count[b]`` are masked.

The host pool holds raw bits (see ``pages.bits_dtype``); pages are bitcast back to the
cache dtype on device. Shapes are fixed by the bucketed ``cold_slots`` width, so every
decode step of a long request runs the same executable on the same staging shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.ops.chunked import merge_chunk
from jaxkv.ops.reference import check_window


def stream_state(state, qg, host_pool, k_index: int, v_index: int, cold_slots, cold_first,
                 cold_count, q_positions, kv_lens, *, pages_per_chunk: int, dtype,
                 window=None):
  """Folds every cold page of every row into ``state``.

  host_pool: ``[host_pages, arrays, kv_heads, page_size, head_dim]`` raw bits in host
  memory (page-major, ``pages.host_spec``) (shard-local inside ``shard_map``); k_index/v_index: this layer's K and V in it;
  cold_slots: ``[B, C]`` host slots, C a multiple of ``pages_per_chunk``; cold_first,
  cold_count: ``[B]``; window: a sliding window (``reference``'s module docstring): cold
  keys before a query's window are masked (every chunk is still fetched: the double
  buffer's shapes stay fixed).
  """
  window = check_window(window)
  batch, width = cold_slots.shape
  _, _, heads, page_size, head_dim = host_pool.shape
  num_chunks = width // pages_per_chunk
  chunk_tokens = pages_per_chunk * page_size

  def fetch(c):
    ks, vs = [], []
    for b in range(batch):
      for i in range(pages_per_chunk):
        slot = jax.lax.dynamic_index_in_dim(cold_slots[b], c * pages_per_chunk + i,
                                            keepdims=False)
        for index, out in ((k_index, ks), (v_index, vs)):  # [1, 1, H, S, D] -> [1, H, 1, S, D]
          out.append(jax.lax.dynamic_slice(host_pool, (slot, index, 0, 0, 0),
                                           (1, 1, heads, page_size, head_dim)).reshape(
                                               1, heads, 1, page_size, head_dim))
    ks, vs = jax.device_put((ks, vs), jax.memory.Space.Device)  # host -> device
    shape = (heads, batch, chunk_tokens, head_dim)
    k = jnp.concatenate(ks, axis=2).reshape(shape)  # [1, H, B*ppc, S, D] -> [H, B, L, D]
    v = jnp.concatenate(vs, axis=2).reshape(shape)
    return jax.lax.bitcast_convert_type(k, dtype), jax.lax.bitcast_convert_type(v, dtype)

  page_in_chunk = jnp.arange(pages_per_chunk, dtype=jnp.int32)
  tok_in_page = jnp.arange(page_size, dtype=jnp.int32)

  def step(carry, c):
    state, (k_cur, v_cur) = carry
    nxt = fetch(jnp.minimum(c + 1, num_chunks - 1))  # in flight while this chunk computes
    cold_index = c * pages_per_chunk + page_in_chunk  # [ppc]
    block = cold_first[:, None] + cold_index[None]  # [B, ppc] logical blocks
    kpos = (block[:, :, None] * page_size + tok_in_page[None, None]).reshape(batch, -1)
    valid = jnp.repeat(cold_index[None] < cold_count[:, None], page_size, axis=1)
    state = merge_chunk(state, qg, k_cur, v_cur, kpos, q_positions, kv_lens, valid, window)
    return (state, nxt), None

  (state, _), _ = jax.lax.scan(step, (state, fetch(0)), jnp.arange(num_chunks, dtype=jnp.int32))
  return state
