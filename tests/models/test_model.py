"""The model over pages equals the same weights run densely (no pages, no cache)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv.models.llama import apply_rope

import helpers


def dense_logits(model: jaxkv.models.Llama, tokens) -> np.ndarray:
  """Causal forward over contiguous K/V, written independently of jaxkv's attention."""
  c = model.cfg
  tokens = jnp.asarray(tokens, jnp.int32)[None]
  t = tokens.shape[1]
  pos = jnp.arange(t, dtype=jnp.int32)[None]
  x = model.embed(tokens)
  causal = np.tril(np.ones((t, t), bool))
  for layer in model.layers:
    a = layer.attn
    h = layer.attn_norm(x)
    q = apply_rope(a.q_proj(h).reshape(1, t, c.num_heads, c.head_dim), pos, c.rope_theta)
    k = apply_rope(a.k_proj(h).reshape(1, t, c.num_kv_heads, c.head_dim), pos, c.rope_theta)
    v = a.v_proj(h).reshape(1, t, c.num_kv_heads, c.head_dim)
    g = c.num_heads // c.num_kv_heads
    k = jnp.repeat(k, g, axis=2).astype(jnp.float32)
    v = jnp.repeat(v, g, axis=2).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k) / np.sqrt(c.head_dim)
    s = jnp.where(causal[None, None], s, -jnp.inf)
    o = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v).astype(x.dtype)
    x = x + a.o_proj(o.reshape(1, t, c.num_heads * c.head_dim))
    x = x + layer.mlp(layer.mlp_norm(x))
  return np.asarray(model.lm_head(model.norm(x)).astype(jnp.float32))[0]


@pytest.mark.parametrize("chunk_pages", [1, 3])
def test_engine_logits_equal_dense_forward(mesh, chunk_pages):
  mc = helpers.tiny_model_config()
  engine = helpers.make_engine(mesh, mc, prefix_reuse=False, prefill_chunk_pages=chunk_pages)
  # The engine's model scans its stacked layers; the reference is the loop form, whose
  # layers are modules the dense forward walks. Same seed: the same weights.
  assert mc.scan_layers
  reference = jaxkv.models.Llama(dataclasses.replace(mc, scan_layers=False), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, mc.vocab_size, n).tolist() for n in (13, 4, 22)]
  tokens, logits = engine.generate(prompts, 5, return_logits=True)
  for prompt, out, lg in zip(prompts, tokens, logits):
    # Causal: row p of one dense forward over the whole sequence is the logits after p.
    dense = dense_logits(reference, prompt + out[:-1])
    want = dense[len(prompt) - 1:]
    np.testing.assert_allclose(lg, want, atol=2e-4, rtol=2e-4)
    assert out == np.argmax(want, axis=-1).tolist()


def log_softmax(x):
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_logprobs_of_prompt_and_answer_equal_the_dense_forwards_log_softmax(mesh):
  """Prompt and generated log-probabilities (and the top-k alternatives) equal a log-softmax
  over the dense forward's logits; a prompt asking for them reuses no block (its logits
  are computed), and its tokens equal the same request's without them."""
  mc = helpers.tiny_model_config()
  engine = helpers.make_engine(mesh, mc, prefill_chunk_pages=1, max_seqs_per_shard=2)
  reference = jaxkv.models.Llama(dataclasses.replace(mc, scan_layers=False), rngs=nnx.Rngs(0))
  rng = np.random.default_rng(3)
  shared = rng.integers(0, mc.vocab_size, 12).tolist()
  prompts = [shared + rng.integers(0, mc.vocab_size, n).tolist() for n in (5, 9)]
  plain = engine.generate(prompts, 4)  # caches the shared blocks
  sp = [jaxkv.SamplingParams(max_new_tokens=4, logprobs=3, prompt_logprobs=k) for k in (0, 5)]
  handles = [engine.submit(p, s) for p, s in zip(prompts, sp)]
  for h in handles:
    h.result()
  assert [h.tokens for h in handles] == plain
  assert all(h.cached_tokens == 0 for h in handles)  # computed whole, cached blocks or not
  worst = 0.0
  for h, p, s in zip(handles, prompts, sp):
    seq = p + h.tokens[:-1]
    want = log_softmax(dense_logits(reference, seq))  # [row t: the token after t]
    assert len(h.prompt_logprobs) == len(p) - 1 and len(h.logprobs) == len(h.tokens)
    for t, (lp, top) in enumerate(h.prompt_logprobs + h.logprobs):
      target = seq[t + 1] if t + 1 < len(seq) else h.tokens[-1]
      worst = max(worst, abs(lp - want[t, target]))
      k = s.prompt_logprobs if t < len(p) - 1 else s.logprobs
      assert [i for i, _ in top] == np.argsort(-want[t], kind="stable")[:k].tolist()
      np.testing.assert_allclose([v for _, v in top], want[t][[i for i, _ in top]], atol=2e-4)
    assert [top[0][0] for _, top in h.logprobs] == h.tokens  # greedy: the most likely
  assert worst < 2e-4, worst
  # The blocks those prompts published are the same bits: a later plain request reuses them.
  again = engine.submit(prompts[1], 4)
  assert again.result() == plain[1] and again.cached_tokens > 0


def test_model_rejects_use_before_pages_exist():
  mc = helpers.tiny_model_config()
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  layer = model.kv  # the scanned layers' one PagedKV stack
  z = jnp.zeros((1, 1, 4, 8))
  with pytest.raises(ValueError, match="init_pages"):
    layer(z, jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 2, 8)), None, layer=0)
  with pytest.raises(ValueError, match="needs the layer's index"):
    layer(z, jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 2, 8)), None)
