"""Paged attention over fixed-size chunks of pages with an online softmax.

Same contract as ``reference.paged_attention_reference`` (see there for the layout).
Instead of gathering every page of a sequence at once, it walks the page table in
chunks of ``pages_per_chunk`` pages (a ``lax.scan``), keeping a running max, sum and
weighted accumulator per query, and merges each chunk into them.

Why this is the path the engine runs:
- Memory: it materialises one chunk of K/V per step, not the whole context.
- Exactness of cache hits: a chunk covers a fixed range of absolute positions, and a
  chunk whose keys are all masked leaves the running state bit-for-bit unchanged
  (``alpha == 1``, nothing added). So a token's attention output does not depend on
  how wide the page table happened to be (the engine buckets widths by powers of two):
  KV computed in a short early turn and KV recomputed later in a wide batch are the
  same bits. Tests check both the tolerance against the reference and this invariance.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxkv.ops.reference import check_shapes


def paged_attention(q, k_pages, v_pages, page_table, q_positions, kv_lens, *,
                    pages_per_chunk: int = 8, scale: float | None = None):
  """Attention of ``q`` over each sequence's pages. Returns ``q``'s shape and dtype."""
  check_shapes(q, k_pages, v_pages, page_table, q_positions, kv_lens)
  if pages_per_chunk <= 0:
    raise ValueError(f"{pages_per_chunk=} must be positive.")
  batch, q_len, num_q_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_q_heads // num_kv_heads
  width = page_table.shape[1]
  num_chunks = -(-width // pages_per_chunk)
  pad = num_chunks * pages_per_chunk - width
  if pad:  # padded entries point at page 0 and are masked by position
    page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
  if scale is None:
    scale = head_dim ** -0.5
  chunk_tokens = pages_per_chunk * page_size
  # [chunks, batch, pages_per_chunk]: the scan walks the leading axis.
  tables = page_table.reshape(batch, num_chunks, pages_per_chunk).transpose(1, 0, 2)
  qg = q.reshape(batch, q_len, num_kv_heads, group, head_dim).astype(jnp.float32) * scale
  qpos = q_positions[:, None, None, :, None]  # [B, 1, 1, T, 1]
  lens = kv_lens[:, None, None, None, None]

  def step(carry, xs):
    m, l, acc = carry  # [B, H, G, T, 1], [B, H, G, T, 1], [B, H, G, T, D]
    table, c = xs
    k = k_pages[:, table].reshape(num_kv_heads, batch, chunk_tokens, head_dim)
    v = v_pages[:, table].reshape(num_kv_heads, batch, chunk_tokens, head_dim)
    s = jnp.einsum("bthgd,hbld->bhgtl", qg, k.astype(jnp.float32))
    kpos = (c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32))[None, None, None, None]
    mask = (kpos <= qpos) & (kpos < lens)
    s = jnp.where(mask, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    alpha = jnp.where(jnp.isfinite(m), jnp.exp(m - m_safe), 0.0)
    p = jnp.where(mask, jnp.exp(s - m_safe), 0.0)
    l = l * alpha + jnp.sum(p, axis=-1, keepdims=True)
    acc = acc * alpha + jnp.einsum("bhgtl,hbld->bhgtd", p, v.astype(jnp.float32))
    return (m_new, l, acc), None

  # Initial state built with *_like from q, so it carries q's sharding/varying axes when
  # this runs inside shard_map.
  acc0 = jnp.zeros_like(jnp.moveaxis(qg, 1, 3))  # [B, H, G, T, D]
  init = (jnp.full_like(acc0[..., :1], -jnp.inf), jnp.zeros_like(acc0[..., :1]), acc0)
  (_, l, acc), _ = jax.lax.scan(step, init, (tables, jnp.arange(num_chunks, dtype=jnp.int32)))
  out = acc / jnp.maximum(l, 1e-30)  # fully masked (padding) rows: 0
  out = out.transpose(0, 3, 1, 2, 4)  # [B, T, H, G, D]
  return out.reshape(batch, q_len, num_q_heads, head_dim).astype(q.dtype)
