"""Suite ``overhead``: jaxkv's steps against a plain dense-KV loop on one device.

What a user would write without jaxkv, written here: the same Llama (same weights, same
tokens) with a contiguous cache ``[layers, 2, rows, max_len, kv_heads, head_dim]`` updated
with ``dynamic_update_slice`` in one jitted step; prefill is one call over the whole prompt,
decode one call per token, the next token fed back on device (no host readback: the
fastest such loop). jaxkv runs the same prompts through ``Engine.submit`` with prefix reuse
off (continuous batching, one token read back per step, as serving needs for stops;
256-token prefill chunks).

- ``decode_vs_dense``: dense seconds per decode step / jaxkv seconds per decode step;
- ``prefill_vs_dense``: dense prefill seconds / jaxkv time to first token;
- ``host_overhead_ms_per_step``: a jaxkv engine step minus its bare jitted decode call;
- ``reuse_ttft_vs_bound``: with a cached context of ``context`` tokens, the TTFT of a turn
  adding 32 tokens / one dense 32-token step over that context (the exact-size bound).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv import buckets, models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import EngineConfig, SamplingParams, SchedulerConfig
from jaxkv.serving.engine import Engine
from jaxkv.models.llama import apply_rope
from jaxkv.worker.pages import make_mesh


def _dense_step(model, cache, tokens, start):
  """The model over ``tokens [B, T]`` at positions ``start + [0, T)`` with a contiguous
  cache; returns (next tokens [B], cache)."""
  c = model.cfg
  b, t = tokens.shape
  positions = start + jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  max_len = cache.shape[3]
  kpos = jnp.arange(max_len, dtype=jnp.int32)
  mask = kpos[None, None, :] <= positions[:, :, None]  # [B, T, L]
  x = model.embed(tokens)
  for i, layer in enumerate(model.layers):
    attn, h = layer.attn, layer.attn_norm(x)
    q = apply_rope(attn.q_proj(h).reshape(b, t, c.num_heads, c.head_dim), positions,
                   c.rope_theta)
    k = apply_rope(attn.k_proj(h).reshape(b, t, c.num_kv_heads, c.head_dim), positions,
                   c.rope_theta)
    v = attn.v_proj(h).reshape(b, t, c.num_kv_heads, c.head_dim)
    cache = jax.lax.dynamic_update_slice(cache, jnp.stack([k, v])[None], (i, 0, 0, start, 0, 0))
    keys, values = cache[i, 0], cache[i, 1]  # [B, L, Hkv, D]
    g = c.num_heads // c.num_kv_heads
    qg = q.reshape(b, t, c.num_kv_heads, g, c.head_dim) * c.head_dim ** -0.5
    s = jnp.einsum("bthgd,blhd->bhgtl", qg, keys)
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    out = jnp.einsum("bhgtl,blhd->bthgd", jax.nn.softmax(s, axis=-1), values)
    x = x + attn.o_proj(out.reshape(b, t, c.num_heads * c.head_dim))
    x = x + layer.mlp(layer.mlp_norm(x))
  logits = model.lm_head(model.norm(x[:, -1:]))[:, 0]
  return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache


class _Dense:
  """The dense loop: one compiled step per (rows, tokens per step) shape."""

  def __init__(self, mc, rows: int, max_len: int):
    # The loop form (a Python loop of layer modules, as a user writes it first) of the same
    # weights as jaxkv's scanned model: a seed gives the same weights in both forms.
    mc = dataclasses.replace(mc, scan_layers=False)
    graphdef, state = nnx.split(models.Llama(mc, rngs=nnx.Rngs(0)))
    self.state = state
    self.shape = (mc.num_layers, 2, rows, max_len, mc.num_kv_heads, mc.head_dim)

    def step(state, cache, tokens, start):
      return _dense_step(nnx.merge(graphdef, state), cache, tokens, start)

    self.step = jax.jit(step, donate_argnums=(1,))

  def fresh(self):
    return jnp.zeros(self.shape, jnp.float32)

  def generate(self, prompts: np.ndarray, new_tokens: int):
    """Returns (prefill seconds, decode seconds per step, tokens [B, new])."""
    cache = self.fresh()
    t0 = time.perf_counter()
    tok, cache = self.step(self.state, cache, jnp.asarray(prompts), 0)
    tok.block_until_ready()
    t1 = time.perf_counter()
    out = [tok]
    for i in range(new_tokens - 1):
      tok, cache = self.step(self.state, cache, tok[:, None], prompts.shape[1] + i)
      out.append(tok)
    out[-1].block_until_ready()
    t2 = time.perf_counter()
    return t1 - t0, (t2 - t1) / max(1, new_tokens - 1), np.stack(out, axis=1)


CHUNK_PAGES = 16  # 256-token prefill chunks (a prompt's short tail runs in a 64-token step)


def _engine(mc, mesh, pages: int, max_seq: int, rows: int, reuse: bool) -> Engine:
  cache = common.bench_cache_config(pages_per_shard=pages, max_pages_per_seq=-(-max_seq // 16))
  return Engine(models.Llama(mc, rngs=nnx.Rngs(0)), KVCache(cache, mesh),
                EngineConfig(max_seqs_per_shard=rows, prefill_chunk_pages=CHUNK_PAGES,
                             prefix_reuse=reuse),
                scheduler=SchedulerConfig(decision="fetch"))


def _jaxkv_generate(engine: Engine, prompts: np.ndarray, new_tokens: int):
  """Submits every prompt at once; returns (TTFT, decode seconds per step, tokens)."""
  handles = [engine.submit(p.tolist(), SamplingParams(max_new_tokens=new_tokens))
             for p in prompts]
  t0 = time.perf_counter()
  t_first = None
  while engine.has_unfinished():
    engine.step()
    if t_first is None and all(h.tokens for h in handles):
      t_first = time.perf_counter()
  t_end = time.perf_counter()
  return (t_first - t0, (t_end - t_first) / max(1, new_tokens - 1),
          np.array([h.tokens for h in handles]))


def _bare_decode_s(engine: Engine, rows: int, width_tokens: int, start: int,
                   steps: int) -> float:
  """Seconds per call of the engine's compiled decode step alone (every row decoding from
  position ``start``, inputs prepared once, nothing read back): what the same steps cost
  without the serving loop around them."""
  runner, cache = engine.runner, engine.cache
  table = cache.put_rows(np.zeros((rows, buckets.table_width(
      -(-width_tokens // 16), cache.config)), np.int32))
  batch = runner.decode_batch([(r, start) for r in range(rows)], rows)
  carry = cache.put_rows(np.zeros((rows,), np.int32))
  carry, _, batch = runner.decode(batch, table, carry, count=False)
  carry.block_until_ready()
  t0 = time.perf_counter()
  for _ in range(steps):
    carry, _, batch = runner.decode(batch, table, carry, count=False)
  carry.block_until_ready()
  return (time.perf_counter() - t0) / steps


def run(*, quick: bool = False) -> dict:
  mesh = make_mesh(data=1, model=1, devices=jax.devices()[:1])
  mc = common.bench_model_config()
  rows, prompt_len, new = 4, 256, 16 if quick else 48
  context = 1024 if quick else 4096
  reps = 2 if quick else 3
  rng = np.random.default_rng(3)
  prompts = rng.integers(1, mc.vocab_size, (rows, prompt_len)).astype(np.int32)
  max_seq = prompt_len + new
  dense = _Dense(mc, rows, max_seq)
  engine = _engine(mc, mesh, pages=rows * (-(-max_seq // 16)) + 8, max_seq=max_seq, rows=rows,
                   reuse=False)
  engine.warmup(max_seq_len=max_seq, rows_per_shard=[rows])
  dense.generate(prompts, new)  # compile
  _jaxkv_generate(engine, prompts, new)
  figures = {"dense": [], "jaxkv": []}
  for _ in range(reps):  # interleaved
    figures["dense"].append(dense.generate(prompts, new))
    figures["jaxkv"].append(_jaxkv_generate(engine, prompts, new))
  med = lambda name, i: float(np.median([f[i] for f in figures[name]]))
  same = all(np.array_equal(f[2], figures["dense"][0][2]) for f in figures["jaxkv"])
  bare = _bare_decode_s(engine, rows, max_seq, prompt_len, steps=new)

  # A cached context, then a turn adding 32 tokens: TTFT vs one exact-size dense step.
  ctx_engine = _engine(mc, mesh, pages=2 * (-(-(context + 64) // 16)) + 8,
                       max_seq=context + 64, rows=1, reuse=True)
  ctx_engine.warmup(max_seq_len=context + 64, rows_per_shard=[1])
  base = rng.integers(1, mc.vocab_size, context).tolist()
  ctx_engine.generate([base], 1)
  ttft = []
  for r in range(reps + 1):
    turn = base + rng.integers(1, mc.vocab_size, 32).tolist()
    before = len(ctx_engine.stats()["ttft_s"])
    ctx_engine.generate([turn], 1)
    if r:  # the first compiles nothing new but warms the lookups
      ttft.append(ctx_engine.stats()["ttft_s"][before])
  ctx_dense = _Dense(mc, 1, context + 32)
  cache = ctx_dense.fresh()
  _, cache = ctx_dense.step(ctx_dense.state, cache, jnp.asarray([base], jnp.int32), 0)
  suffix = jnp.asarray(rng.integers(1, mc.vocab_size, (1, 32)), jnp.int32)
  def dense_turn_s(tokens) -> float:  # one dense step over the cached context
    times = []
    for _ in range(reps + 1):
      snapshot = cache + 0
      t0 = time.perf_counter()
      tok, _ = ctx_dense.step(ctx_dense.state, snapshot, tokens, context)
      tok.block_until_ready()
      times.append(time.perf_counter() - t0)
    return float(np.median(times[1:]))

  bound = dense_turn_s(suffix)
  # jaxkv's step: the 32 tokens padded to its narrowest prefill step (what limits it)
  step = buckets.prefill_width(32, ctx_engine.runner.prefill_widths)
  chunk = dense_turn_s(jnp.pad(suffix, ((0, 0), (0, step - 32))))
  step_s = med("jaxkv", 1)
  return {
      "decode_vs_dense": med("dense", 1) / step_s,
      "prefill_vs_dense": med("dense", 0) / med("jaxkv", 0),
      "host_overhead_ms_per_step": 1e3 * (step_s - bare),
      "reuse_ttft_vs_bound": float(np.median(ttft)) / bound,
      "decode_ms_per_step": {"dense": 1e3 * med("dense", 1), "jaxkv": 1e3 * step_s,
                             "jaxkv_bare_step": 1e3 * bare},
      "prefill_ms": {"dense": 1e3 * med("dense", 0), "jaxkv": 1e3 * med("jaxkv", 0)},
      "reuse_ttft_ms": {"jaxkv": 1e3 * float(np.median(ttft)), "dense_bound": 1e3 * bound,
                        "dense_one_step": 1e3 * chunk, "step_tokens": step},
      "tokens_identical": bool(same),
      "workload": {"rows": rows, "prompt_tokens": prompt_len, "new_tokens": new,
                   "context_tokens": context, "devices": 1},
  }
