"""A small Llama-style decoder in Flax NNX whose attention keeps its KV in jaxkv pages.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP. It uses
only the public layer ``jaxkv.nnx`` (``PagedKV`` + ``PageBatch``), exactly as a user's
own model would. Sizes are configurable so tests can run many shapes on CPU and
benchmarks can build realistic ones with random weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import nnx as kvnnx
from jaxkv.config import SUPPORTED_DTYPES


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  vocab_size: int = 256
  hidden_size: int = 64
  num_layers: int = 2
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 16
  mlp_dim: int = 128
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  dtype: str = "float32"  # activations and weights

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"LlamaConfig.{name}={v!r} must be a positive integer.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"LlamaConfig num_heads={self.num_heads} must be divisible by "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise ValueError(f"LlamaConfig.head_dim={self.head_dim} must be even for RoPE.")
    if self.dtype not in SUPPORTED_DTYPES:
      raise ValueError(f"LlamaConfig.dtype={self.dtype!r} must be one of {SUPPORTED_DTYPES}.")


class RMSNorm(nnx.Module):

  def __init__(self, dim: int, eps: float, dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale.get_value().astype(jnp.float32)).astype(x.dtype)


def apply_rope(x, positions, theta: float):
  """x: [B, T, H, D]; positions: [B, T] (negative = padding, treated as 0)."""
  d = x.shape[-1]
  inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
  angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
    self.cfg = cfg
    self.q_proj = lin(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    self.k_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
    self.v_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
    self.o_proj = lin(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    self.kv = kvnnx.PagedKV(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)

  def __call__(self, x, batch: kvnnx.PageBatch):
    b, t, _ = x.shape
    c = self.cfg
    q = self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim)
    k = self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    q = apply_rope(q, batch.positions, c.rope_theta)
    k = apply_rope(k, batch.positions, c.rope_theta)
    out = self.kv(q, k, v, batch)
    return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))


class MLP(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
    self.gate = lin(cfg.hidden_size, cfg.mlp_dim)
    self.up = lin(cfg.hidden_size, cfg.mlp_dim)
    self.down = lin(cfg.mlp_dim, cfg.hidden_size)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, batch):
    x = x + self.attn(self.attn_norm(x), batch)
    return x + self.mlp(self.mlp_norm(x))


class Llama(nnx.Module):
  """Decoder-only LM: ``model(tokens [B, T], batch) -> logits [B, T, vocab]`` (float32)."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.vocab_size = cfg.vocab_size
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dt,
                              param_dtype=dt, rngs=rngs)

  def __call__(self, tokens, batch: kvnnx.PageBatch):
    x = self.embed(tokens)
    for layer in self.layers:
      x = layer(x, batch)
    return self.lm_head(self.norm(x)).astype(jnp.float32)
