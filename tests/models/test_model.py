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


def test_model_rejects_use_before_pages_exist():
  mc = helpers.tiny_model_config()
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  layer = model.kv  # the scanned layers' one PagedKV stack
  z = jnp.zeros((1, 1, 4, 8))
  with pytest.raises(ValueError, match="init_pages"):
    layer(z, jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 2, 8)), None, layer=0)
  with pytest.raises(ValueError, match="needs the layer's index"):
    layer(z, jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 2, 8)), None)
