"""Gemma 3's text decoder in Flax NNX, with its attention's KV in jaxkv pages.

What Gemma 3 computes differently from the Llama family (``jaxkv.models.llama``, whose
rotate-half RoPE it shares):
- hybrid attention: most layers are local (a sliding window of ``sliding_window`` tokens,
  RoPE base ``rope_local_theta``, 10,000 as published) and every ``global_every``-th is
  global (every earlier token, RoPE base ``rope_theta`` with the checkpoint's scaling);
  layer ``i`` is global when ``(i + 1) % global_every == 0`` unless ``layer_types`` says;
- the embeddings are multiplied by ``sqrt(hidden_size)``, rounded to the compute dtype;
- RMSNorm multiplies by ``1 + w`` (the checkpoint stores ``w``; a GGUF file stores ``w + 1``
  and ``jaxkv.models.gguf`` takes the 1 off as it reads), in float32 before rounding;
- each query and key head is RMS-normalised (``q_norm``, ``k_norm``) before RoPE;
- four norms per layer: before attention, after it (before the residual add), before the
  MLP and after it;
- the MLP is GeGLU with the tanh approximation of GELU;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5`` (the paged ops scale by
  ``head_dim ** -0.5``: the queries are rescaled when the two differ);
- the output head is the embedding (tied).

The layers run under a scan over stacked weights (``scan_layers``, the default) as the
Llama does; a layer's window and which RoPE it uses ride in the scan as traced values
(``PagedKV.attend(..., window=w)``, ``w = 0`` for a global layer), so one layer is compiled
for both kinds.

KV groups (``kv_groups``, the default): the local layers' K/V live in the cache's window
group (``PagedKV(window=sliding_window)``, its own pool), which keeps only the blocks a
running sequence's window still needs plus cached windows before block boundaries, so a
long sequence's device memory is about the global layers' share; only the global layers'
blocks go to the lower tiers. The layers then run as a scan over the pattern's periods
(``Gemma3._scan_groups``), each stretch of same-kind layers a scan over its group's pages. ``kv_groups=False`` keeps every layer's pages for the whole
sequence (a local layer's window then only masks what it reads): the all-global layout,
for comparison.
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
from jaxkv.models import llama
from jaxkv.models.llama import LinearRopeScaling, apply_rope

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config:
  vocab_size: int = 256
  hidden_size: int = 64
  num_layers: int = 6
  num_heads: int = 4
  num_kv_heads: int = 1
  head_dim: int = 32
  mlp_dim: int = 128
  rope_theta: float = 1_000_000.0  # global layers
  rope_local_theta: float = 10_000.0  # local (sliding-window) layers
  rope_scaling: LinearRopeScaling | None = None  # global layers only, as published
  norm_eps: float = 1e-6
  query_pre_attn_scalar: float = 0.0  # 0: head_dim
  sliding_window: int = 512
  global_every: int = 6
  # One of LAYER_TYPES per layer; empty: the pattern of ``global_every``.
  layer_types: tuple[str, ...] = ()
  dtype: str = "float32"
  tie_embeddings: bool = True
  scan_layers: bool = True
  kv_groups: bool = True  # local layers' KV in the cache's window group (see the module doc)

  def __post_init__(self):
    for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim", "sliding_window", "global_every"):
      v = getattr(self, name)
      if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise InputError(f"Gemma3Config.{name}={v!r} must be a positive integer.")
    if self.num_heads % self.num_kv_heads:
      raise InputError(f"Gemma3Config num_heads={self.num_heads} must be divisible by "
                       f"num_kv_heads={self.num_kv_heads} (grouped-query attention).")
    if self.head_dim % 2:
      raise InputError(f"Gemma3Config.head_dim={self.head_dim} must be even for RoPE.")
    if self.dtype not in SUPPORTED_DTYPES:
      raise InputError(f"Gemma3Config.dtype={self.dtype!r} must be one of {SUPPORTED_DTYPES}.")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, LinearRopeScaling):
      raise InputError(f"Gemma3Config.rope_scaling={self.rope_scaling!r} must be a "
                       "LinearRopeScaling or None (Gemma 3 scales its global layers linearly).")
    for name in ("rope_theta", "rope_local_theta", "norm_eps"):
      if not getattr(self, name) > 0:
        raise InputError(f"Gemma3Config.{name}={getattr(self, name)!r} must be positive.")
    if self.query_pre_attn_scalar < 0:
      raise InputError(f"Gemma3Config.query_pre_attn_scalar={self.query_pre_attn_scalar} must "
                       "be positive (0: head_dim).")
    types = tuple(self.layer_types)
    if types and (len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types)):
      raise InputError(f"Gemma3Config.layer_types={types!r} must name one of {LAYER_TYPES} for "
                       f"each of its num_layers={self.num_layers} layers (or be empty).")
    object.__setattr__(self, "layer_types", types)

  def is_global(self, layer: int) -> bool:
    """Whether layer ``layer`` attends to every earlier token (else: its window)."""
    if self.layer_types:
      return self.layer_types[layer] == "full_attention"
    return (layer + 1) % self.global_every == 0

  @property
  def window_layers(self) -> int:
    """Layers whose KV the cache keeps in its window group (0 without ``kv_groups``)."""
    if not self.kv_groups:
      return 0
    return sum(not self.is_global(i) for i in range(self.num_layers))

  @property
  def attn_scale(self) -> float:
    """What the queries are multiplied by so that the ops' ``head_dim ** -0.5`` scales the
    scores by ``query_pre_attn_scalar ** -0.5`` (1 when they agree, as in the 270M)."""
    return math.sqrt(self.head_dim / (self.query_pre_attn_scalar or self.head_dim))


class GemmaRMSNorm(nnx.Module):
  """``x / rms(x) * (1 + w)`` in float32, then rounded to ``x``'s dtype (Gemma's order).
  ``scale`` holds ``w`` (zero at init: the identity)."""

  def __init__(self, dim: int, eps: float, dtype):
    self.eps = eps
    self.scale = nnx.Param(jnp.zeros((dim,), dtype))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * (1.0 + self.scale.get_value().astype(jnp.float32))).astype(x.dtype)


def _rope(x, positions, cfg: Gemma3Config, is_global):
  """RoPE of a global layer or a local one; ``is_global`` a Python bool, or a traced one
  in a scan (both rotations computed, one kept: each is the exact one, bit for bit)."""
  glob = lambda: apply_rope(x, positions, cfg.rope_theta, cfg.rope_scaling)
  local = lambda: apply_rope(x, positions, cfg.rope_local_theta)
  if isinstance(is_global, bool):
    return glob() if is_global else local()
  return jnp.where(is_global, glob(), local())


class Attention(nnx.Module):
  """With ``paged`` the module keeps its own ``PagedKV``; without (a layer of a scanned
  stack) it is called with ``attend``, the stack's attention for its layer."""

  def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs, paged: bool = True,
               window: bool = False):
    dt = jnp.dtype(cfg.dtype)
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
    self.cfg = cfg
    self.q_proj = lin(cfg.hidden_size, cfg.num_heads * cfg.head_dim)
    self.k_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
    self.v_proj = lin(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim)
    self.o_proj = lin(cfg.num_heads * cfg.head_dim, cfg.hidden_size)
    self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps, dt)
    self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.norm_eps, dt)
    if paged:
      self.kv = kvnnx.PagedKV(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              window=cfg.sliding_window if window else 0)

  def __call__(self, x, batch: kvnnx.PageBatch, is_global, attend=None):
    b, t, _ = x.shape
    c = self.cfg
    q = self.q_norm(self.q_proj(x).reshape(b, t, c.num_heads, c.head_dim))
    k = self.k_norm(self.k_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim))
    v = self.v_proj(x).reshape(b, t, c.num_kv_heads, c.head_dim)
    q = _rope(q, batch.positions, c, is_global)
    k = _rope(k, batch.positions, c, is_global)
    if c.attn_scale != 1.0:
      q = (q * c.attn_scale).astype(q.dtype)
    if attend is not None:
      out = attend(q, k, v)
    elif self.kv.window:  # the window group's pages: the layer's window is the stack's
      out = self.kv(q, k, v, batch)
    else:
      out = self.kv(q, k, v, batch, window=0 if is_global else c.sliding_window)
    return self.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))


class MLP(nnx.Module):
  """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))``."""

  def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    lin = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)
    self.gate = lin(cfg.hidden_size, cfg.mlp_dim)
    self.up = lin(cfg.hidden_size, cfg.mlp_dim)
    self.down = lin(cfg.mlp_dim, cfg.hidden_size)

  def __call__(self, x):
    return self.down(jax.nn.gelu(self.gate(x), approximate=True) * self.up(x))


class Block(nnx.Module):

  def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs, paged: bool = True,
               window: bool = False):
    dt = jnp.dtype(cfg.dtype)
    norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    self.input_norm = norm()
    self.attn = Attention(cfg, rngs=rngs, paged=paged, window=window)
    self.post_attn_norm = norm()
    self.pre_mlp_norm = norm()
    self.mlp = MLP(cfg, rngs=rngs)
    self.post_mlp_norm = norm()

  def __call__(self, x, batch, is_global, attend=None):
    x = x + self.post_attn_norm(self.attn(self.input_norm(x), batch, is_global, attend))
    return x + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(x)))


class Gemma3(nnx.Module):
  """Decoder-only LM: ``model(tokens [B, T], batch) -> logits [B, T, vocab]`` (float32;
  ``[B, 1, vocab]`` when ``batch.logits_at`` names the one token per row to compute)."""

  def __init__(self, cfg: Gemma3Config, *, rngs: nnx.Rngs):
    dt = jnp.dtype(cfg.dtype)
    self.cfg = cfg
    self.vocab_size = cfg.vocab_size
    self.embed = nnx.Embed(cfg.vocab_size, cfg.hidden_size, dtype=dt, param_dtype=dt,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    if cfg.scan_layers:
      self.layers = llama.stacked_blocks(cfg, rngs, Block)
      local = cfg.window_layers
      self.kv = kvnnx.PagedKV(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              num_layers=cfg.num_layers - local)
      if local:
        self.window_kv = kvnnx.PagedKV(num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                                       num_layers=local, window=cfg.sliding_window)
    else:
      self.layers = nnx.List([
          Block(cfg, rngs=rngs, window=cfg.kv_groups and not cfg.is_global(i))
          for i in range(cfg.num_layers)])
    self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.norm_eps, dt)
    if not cfg.tie_embeddings:
      self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, dtype=dt,
                                param_dtype=dt, rngs=rngs)

  @property
  def max_context(self) -> None:
    """No limit: the local layers' window is computed exactly at any length."""
    return None

  def __call__(self, tokens, batch: kvnnx.PageBatch):
    x = self.embed(tokens)
    x = x * jnp.asarray(math.sqrt(self.cfg.hidden_size), x.dtype)
    if self.cfg.scan_layers:
      x = self._scan_layers(x, batch)
    else:
      for i, layer in enumerate(self.layers):
        x = layer(x, batch, self.cfg.is_global(i))
    if batch.logits_at is not None:  # only the tokens whose logits the step reads
      x = jnp.take_along_axis(x, batch.logits_at[:, None, None], axis=1)
    x = self.norm(x)
    # float32 logits whatever the weights' dtype (see jaxkv.models.llama.Llama).
    if self.cfg.tie_embeddings:
      return jnp.einsum("btd,vd->btv", x, self.embed.embedding[...],
                        preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", x, self.lm_head.kernel[...],
                      preferred_element_type=jnp.float32)

  def _scan_layers(self, x, batch):
    """One compiled layer scanned over the stacked weights, each layer's kind (global or
    local) and window carried beside its weights; the pages ride in the carry. With KV
    groups: ``_scan_groups``."""
    cfg = self.cfg
    if cfg.window_layers:
      return self._scan_groups(x, batch)
    graphdef, weights = nnx.split(self.layers)
    kv = self.kv
    is_global = jnp.asarray([cfg.is_global(i) for i in range(cfg.num_layers)])
    windows = jnp.where(is_global, 0, cfg.sliding_window).astype(jnp.int32)

    def body(carry, xs):
      x, k_pages, v_pages = carry
      layer, glob, window, w = xs
      pages = {}

      def attend(q, k, v):
        out, pages["k"], pages["v"] = kv.attend(q, k, v, batch, k_pages, v_pages, layer,
                                                window=window)
        return out

      x = nnx.merge(graphdef, w)(x, batch, glob, attend)
      return (x, pages["k"], pages["v"]), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (x, k_pages, v_pages), _ = jax.lax.scan(
        body, (x, kv.k_pages.get_value(), kv.v_pages.get_value()),
        (layers, is_global, windows, weights))
    kv.k_pages.set_value(k_pages)
    kv.v_pages.set_value(v_pages)
    return x

  def _scan_groups(self, x, batch):
    """With KV groups each layer reads and writes its own group's pages: a global layer the
    global stack's (at its index among the global layers), a local one the window group's.
    The layer pattern repeats (five local, one global): a scan over its periods, whose body
    runs each stretch of same-kind layers as a scan of its own over that group's pages
    alone, then the layers of a last, partial period the same way. No step touches the
    other group's pages (a ``lax.cond`` between the two would pass both through every
    layer, and XLA copies them)."""
    cfg = self.cfg
    kinds = [cfg.is_global(i) for i in range(cfg.num_layers)]
    period = next(p for p in range(1, len(kinds) + 1)
                  if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
    count, rest = divmod(len(kinds), period)
    graphdef, weights = nnx.split(self.layers)
    stacks = {True: self.kv, False: self.window_kv}

    def stretches(pattern):  # (kind, first layer, layers, index of the first in its group)
      out, i = [], 0
      while i < len(pattern):
        j = i
        while j < len(pattern) and pattern[j] == pattern[i]:
          j += 1
        out.append((pattern[i], i, j - i, sum(k == pattern[i] for k in pattern[:i])))
        i = j
      return out

    def run(x, pages, base, pattern, first: dict):
      """Runs the layers of ``pattern``, the model's from layer ``base`` on; ``first``: each
      group's index of its first layer here (both traced in the period scan). Each layer's
      weights are sliced out of the stack where it runs, once, as a plain scan over the
      stack would (slicing a stretch's weights first would copy them twice more)."""
      for kind, a, n, before in stretches(pattern):
        stack = stacks[kind]

        def body(carry, xs, stack=stack, kind=kind, a=a):
          x, k_pages, v_pages = carry
          layer, j = xs
          lw = jax.tree.map(
              lambda t: jax.lax.dynamic_index_in_dim(t, base + a + j, keepdims=False), weights)
          out = {}

          def attend(q, k, v):
            o, out["k"], out["v"] = stack.attend(q, k, v, batch, k_pages, v_pages, layer)
            return o

          x = nnx.merge(graphdef, lw)(x, batch, kind, attend)
          return (x, out["k"], out["v"]), None

        steps = jnp.arange(n, dtype=jnp.int32)
        (x, k_pages, v_pages), _ = jax.lax.scan(body, (x, *pages[kind]),
                                                (first[kind] + before + steps, steps))
        pages = {**pages, kind: (k_pages, v_pages)}
      return x, pages

    per = {True: sum(kinds[:period]), False: period - sum(kinds[:period])}
    pages = {kind: (stack.k_pages.get_value(), stack.v_pages.get_value())
             for kind, stack in stacks.items()}

    def period_body(carry, t):
      x, pages = carry
      x, pages = run(x, pages, t * period, kinds[:period], {k: t * per[k] for k in per})
      return (x, pages), None

    (x, pages), _ = jax.lax.scan(period_body, (x, pages), jnp.arange(count, dtype=jnp.int32))
    if rest:
      x, pages = run(x, pages, count * period, kinds[count * period:],
                     {k: count * per[k] for k in per})
    for kind, stack in stacks.items():
      stack.k_pages.set_value(pages[kind][0])
      stack.v_pages.set_value(pages[kind][1])
    return x
