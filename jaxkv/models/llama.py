"""The Llama family's decoder in Flax NNX, with its attention's KV in jaxkv pages.

RMSNorm, rotary position embeddings (the rotate-half convention of Hugging Face
checkpoints, with Llama 3's frequency scaling or linear position interpolation),
grouped-query attention and a SwiGLU MLP; optional q/k/v biases (Qwen2) and an output
head tied to the embedding. It uses only the public layer ``jaxkv.nnx`` (``PagedKV`` +
``PageBatch``), exactly as a user's own model would.

The layers run under a scan (``LlamaConfig.scan_layers``, the default): their weights are
stacked on a leading layer axis, one ``PagedKV(num_layers=L)`` holds every layer's pages,
and ``jax.lax.scan`` runs one compiled layer over the stack, so a step compiles in the time
of one layer whatever the depth. With ``scan_layers=False`` the layers are a Python loop of
modules, each with its own ``PagedKV``: the form a user's own model most often has. Both
give the same weights for the same seed (layers are initialised one after another in both)
and the same tokens. ``jaxkv.models.from_pretrained``
fills it from a checkpoint; sizes are configurable so tests run many shapes on CPU and
benchmarks build realistic ones with random weights.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxkv import nnx as kvnnx
from jaxkv.config import SUPPORTED_DTYPES
from jaxkv.errors import InputError


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama 3's RoPE frequency scaling (``rope_scaling`` with ``rope_type: llama3``):
  wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are
  divided by ``factor``, shorter than ``... / high_freq_factor`` kept, and the band
  between interpolated."""
  factor: float
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    if not self.factor > 0 or not self.high_freq_factor > self.low_freq_factor > 0:
      raise InputError(f"RopeScaling({self}) needs factor > 0 and high_freq_factor > "
                       "low_freq_factor > 0.")
    if self.original_max_position_embeddings <= 0:
      raise InputError(f"RopeScaling.original_max_position_embeddings="
                       f"{self.original_max_position_embeddings} must be positive.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinearRopeScaling:
  """Linear position interpolation (``rope_scaling`` with ``rope_type: linear``): every
  position is divided by ``factor`` (so every frequency is), stretching the trained
  context ``factor`` times."""
  factor: float

  def __post_init__(self):
    if (not isinstance(self.factor, (int, float)) or isinstance(self.factor, bool)
        or not 0 < self.factor < math.inf):
      raise InputError(f"LinearRopeScaling.factor={self.factor!r} must be a positive number.")


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
  # A RopeScaling (or its fields as a mapping), a LinearRopeScaling, or None.
  rope_scaling: RopeScaling | LinearRopeScaling | None = None
  qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2; Llama attention_bias)
  out_bias: bool = False  # a bias on the output projection (Llama attention_bias)
  tie_embeddings: bool = False  # the output head is the embedding matrix transposed
  # Attention in the checkpoint's own model reaches back at most this many tokens (0: no
  # limit). jaxkv's attention does not window, so sequences are limited to it instead.
  sliding_window: int = 0
  # The layers run under a scan over stacked weights (one layer compiled); False: a
  # Python loop of layer modules (every layer compiled into each step).
  scan_layers: bool = True

  def __post_init__(self):
    if isinstance(self.rope_scaling, dict) or hasattr(self.rope_scaling, "to_dict"):
      d = dict(self.rope_scaling.to_dict() if hasattr(self.rope_scaling, "to_dict")
               else self.rope_scaling)
      object.__setattr__(self, "rope_scaling", RopeScaling(**d) if d else None)
    if self.rope_scaling is not None and not isinstance(self.rope_scaling,
                                                        (RopeScaling, LinearRopeScaling)):
      raise InputError(f"LlamaConfig.rope_scaling={self.rope_scaling!r} must be a "
                       "jaxkv.models.RopeScaling, its fields as a mapping, a "
                       "LinearRopeScaling, or None.")
    if self.sliding_window < 0:
      raise InputError(f"LlamaConfig.sliding_window={self.sliding_window} must be >= 0.")
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InputError(f"LlamaConfig.{name}={v!r} must be a positive integer.")
    if self.num_heads % self.num_kv_heads:
      raise InputError(f"LlamaConfig num_heads={self.num_heads} must be divisible by "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise InputError(f"LlamaConfig.head_dim={self.head_dim} must be even for RoPE.")
    if self.dtype not in SUPPORTED_DTYPES:
      raise InputError(f"LlamaConfig.dtype={self.dtype!r} must be one of {SUPPORTED_DTYPES}.")


class RMSNorm(nnx.Module):
  """Normalises in float32, rounds to the activations' dtype, then scales (the order of
  the Hugging Face Llama implementation; in float32 the rounding is a no-op)."""

  def __init__(self, dim: int, eps: float, dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (self.scale.get_value() * x32.astype(x.dtype)).astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float,
                     scaling: RopeScaling | LinearRopeScaling | None = None):
  """The ``head_dim / 2`` rotary frequencies (radians per position), float32."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if isinstance(scaling, LinearRopeScaling):  # position / factor, as a frequency
    inv_freq = inv_freq / scaling.factor
  elif scaling is not None:
    wavelen = 2 * math.pi / inv_freq
    old = scaling.original_max_position_embeddings
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    smooth = (old / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    between = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    inv_freq = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor,
                         jnp.where(wavelen < high_wavelen, inv_freq, between))
  return inv_freq


def apply_rope(x, positions, theta: float,
               scaling: RopeScaling | LinearRopeScaling | None = None):
  """x: [B, T, H, D]; positions: [B, T] (negative = padding, treated as 0). Rotates the
  pair (i, i + D/2) by position x frequency i (rotate-half)."""
  inv_freq = rope_frequencies(x.shape[-1], theta, scaling)
  angles = jnp.maximum(positions, 0).astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
  """With ``paged`` the module keeps its own ``PagedKV``; without (a layer of a scanned
  stack) it is called with ``attend``, the stack's attention for its layer."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, paged: bool = True):
    dt = jnp.dtype(cfg.dtype)
    lin = lambda i, o, bias: nnx.Linear(i, o, use_bias=bias, dtype=dt, param_dtype=dt,
                                        rngs=rngs)
    self.cfg = cfg
    self.q_proj = lin(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.qkv_bias)
    self.k_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
    self.v_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias)
    self.o_proj = lin(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.out_bias)
    if paged:
      self.kv = kvnnx.PagedKV(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)

  def __call__(self, x, batch: kvnnx.PageBatch, attend=None):
    b, t, _ = x.shape
    c = self.cfg
    q = self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim)
    k = self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    q = apply_rope(q, batch.positions, c.rope_theta, c.rope_scaling)
    k = apply_rope(k, batch.positions, c.rope_theta, c.rope_scaling)
    out = attend(q, k, v) if attend is not None else self.kv(q, k, v, batch)
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

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, paged: bool = True):
    dt = jnp.dtype(cfg.dtype)
    self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    self.attn = Attention(cfg, rngs=rngs, paged=paged)
    self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, batch, attend=None):
    x = x + self.attn(self.attn_norm(x), batch, attend)
    return x + self.mlp(self.mlp_norm(x))


def stacked_blocks(cfg, rngs: nnx.Rngs, block=None) -> nnx.Module:
  """``cfg.num_layers`` blocks (of class ``block``: this module's ``Block`` by default, or
  another family's with the same constructor) as one whose every weight has a leading layer
  axis. The layers are initialised one after another from ``rngs``, as the loop form's
  are, so a seed gives the same weights in both forms."""
  block = block or Block
  blocks = [block(cfg, rngs=rngs, paged=False) for _ in range(cfg.num_layers)]
  graphdef, first = nnx.split(blocks[0])
  states = [first] + [nnx.state(b) for b in blocks[1:]]
  return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


class Llama(nnx.Module):
  """Decoder-only LM: ``model(tokens [B, T], batch) -> logits [B, T, vocab]`` (float32;
  ``[B, 1, vocab]`` when ``batch.logits_at`` names the one token per row to compute)."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.vocab_size = cfg.vocab_size
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    if cfg.scan_layers:
      self.layers = stacked_blocks(cfg, rngs)
      self.kv = kvnnx.PagedKV(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              num_layers=cfg.num_layers)
    else:
      self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dt,
                                param_dtype=dt, rngs=rngs)

  @property
  def max_context(self) -> int | None:
    """The longest sequence this model computes as its checkpoint's own implementation
    does (a sliding-window checkpoint's window), or None: no limit. The engine refuses a
    cache whose sequences could be longer."""
    return self.cfg.sliding_window or None

  def __call__(self, tokens, batch: kvnnx.PageBatch):
    x = self.embed(tokens)
    if self.cfg.scan_layers:
      x = self._scan_layers(x, batch)
    else:
      for layer in self.layers:
        x = layer(x, batch)
    if batch.logits_at is not None:  # only the tokens whose logits the step reads
      x = jnp.take_along_axis(x, batch.logits_at[:, None, None], axis=1)
    x = self.norm(x)
    # The head accumulates and returns float32 whatever the weights' dtype: bfloat16
    # logits (8 bits of mantissa) tie and flip greedy choices between runs whose
    # activations differ in the last bit (a cached prefix vs a recomputed one).
    if self.cfg.tie_embeddings:
      return jnp.einsum("btd,vd->btv", x, self.embed.embedding[...],
                        preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", x, self.lm_head.kernel[...],
                      preferred_element_type=jnp.float32)

  def _scan_layers(self, x, batch):
    """One compiled layer scanned over the stacked weights; the pages ride in the carry,
    so each layer's K/V is written and read in place in the stack."""
    graphdef, weights = nnx.split(self.layers)
    kv = self.kv

    def body(carry, xs):
      x, k_pages, v_pages = carry
      layer, w = xs
      pages = {}

      def attend(q, k, v):
        out, pages["k"], pages["v"] = kv.attend(q, k, v, batch, k_pages, v_pages, layer)
        return out

      x = nnx.merge(graphdef, w)(x, batch, attend)
      return (x, pages["k"], pages["v"]), None

    layers = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
    (x, k_pages, v_pages), _ = jax.lax.scan(
        body, (x, kv.k_pages.get_value(), kv.v_pages.get_value()), (layers, weights))
    kv.k_pages.set_value(k_pages)
    kv.v_pages.set_value(v_pages)
    return x
