"""The model over pages equals the same weights run by an independent NumPy forward (no
pages, no cache, none of jaxkv's layers: tests/numpy_llama.py).

Tolerances: the engine computes in float32, the reference in float64. The tiny model's
logits are at most ~4 in size and the two differ by ~1e-6 (float32 rounding through two
layers and a 128-way head, measured): 2e-4 absolute and relative leaves a 100x margin,
and stays far below what a wrong rotation, mask, norm or head moves (see each test).
"""

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxkv

import gguf_fixtures as gf
import helpers
import hf_fixtures as hf
from numpy_llama import NumpyLlama, log_softmax


@pytest.mark.parametrize("chunk_pages", [1, 3])
def test_engine_logits_equal_dense_forward(mesh, chunk_pages):
  mc = helpers.tiny_model_config()
  engine = helpers.make_engine(mesh, mc, prefix_reuse=False, prefill_chunk_pages=chunk_pages)
  reference = NumpyLlama(engine.model)  # the engine's own weights, read out once
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, mc.vocab_size, n).tolist() for n in (13, 4, 22)]
  tokens, logits = engine.generate(prompts, 5, return_logits=True)
  for prompt, out, lg in zip(prompts, tokens, logits):
    # Causal: row p of one dense forward over the whole sequence is the logits after p.
    dense = reference.logits(prompt + out[:-1])
    want = dense[len(prompt) - 1:]
    np.testing.assert_allclose(lg, want, atol=2e-4, rtol=2e-4)
    assert out == np.argmax(want, axis=-1).tolist()


def test_logprobs_of_prompt_and_answer_equal_the_dense_forwards_log_softmax(mesh):
  """Prompt and generated log-probabilities (and the top-k alternatives) equal a log-softmax
  over the dense forward's logits; a prompt asking for them reuses no block (its logits
  are computed), and its tokens equal the same request's without them."""
  mc = helpers.tiny_model_config()
  engine = helpers.make_engine(mesh, mc, prefill_chunk_pages=1, max_seqs_per_shard=2)
  reference = NumpyLlama(engine.model)
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
    want = reference.log_softmax(seq)  # [row t: the token after t]
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


# llama.cpp's logits for token ids, in a process of its own (a crash in the native library
# fails the test instead of the test worker). Weight repacking ("extra buffer types") is off:
# on a CPU that advertises AMX, a pip-built llama.cpp repacks quantized weights for it and
# dies evaluating them (SIGSEGV or SIGILL, on the developers' machine) unless this is off.
# Float32 weights are not repacked: the setting only keeps a quantized file usable.
# KV cache in float32, as jaxkv's.
LLAMA_CPP_LOGITS = helpers.LLAMA_CPP_PREAMBLE + r"""
path, out, tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
f32 = llama_cpp.GGML_TYPE_F32
llm = llama_cpp.Llama(model_path=path, logits_all=True, n_ctx=64, n_threads=1, verbose=False,
                      type_k=f32, type_v=f32)
llm.eval(tokens)
np.save(out, np.asarray(llm.scores[:len(tokens)], np.float64))
"""


def llama_cpp_log_softmax(path: str, tokens, tmp_path) -> np.ndarray:
  """[T, vocab] log-softmax of llama.cpp's own logits after each of ``tokens``."""
  out = tmp_path / "llama_cpp_logits.npy"
  proc = helpers.start_process([sys.executable, "-c", LLAMA_CPP_LOGITS, path, str(out),
                                json.dumps(tokens)], env=helpers.child_env())
  code, _, err = helpers.finish_process(proc, 120, "llama.cpp's forward")
  assert code == 0, f"llama.cpp exited {code}: {err[-2000:]}"
  return log_softmax(np.load(out))


def test_gguf_models_logprobs_equal_llama_cpps_own(mesh, tmp_path):
  """A float32 GGUF file (a tokenizer in it, as llama.cpp needs): jaxkv's prompt and answer
  log-probabilities and top-5 alternatives equal a log-softmax of llama.cpp's logits for the
  same tokens (a reference no one here wrote: its GGUF reading, its adjacent-pair RoPE on
  the file's rows). Both compute in float32: differences ~1e-6 (measured), bound 1e-4."""
  tokenizer = gf.train_bpe("gpt-2")
  cfg = hf.hf_config("llama", vocab_size=len(tokenizer["tokens"]))
  path = gf.write_gguf(str(tmp_path / "tiny.gguf"), cfg, hf.random_weights(cfg, seed=1),
                       tokenizer=tokenizer)
  one = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
  model = jaxkv.models.from_pretrained(path, dtype="float32", mesh=one)
  cc = jaxkv.CacheConfig.for_model(model, page_size=4, pages_per_shard=16,
                                   max_pages_per_seq=8, attention_chunk_pages=4)
  engine = jaxkv.Engine(model, jaxkv.KVCache(cc, one), jaxkv.EngineConfig(max_seqs_per_shard=1))
  prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], 11).tolist()
  handle = engine.submit(prompt, jaxkv.SamplingParams(max_new_tokens=4, logprobs=5,
                                                      prompt_logprobs=5))
  out = handle.result()
  seq = prompt + out
  want = llama_cpp_log_softmax(path, seq[:-1], tmp_path)
  rows = handle.prompt_logprobs + handle.logprobs  # row t: the token after seq[t]
  assert len(rows) == len(seq) - 1 == want.shape[0]
  got = np.asarray([lp for lp, _ in rows])
  worst = float(np.abs(got - want[np.arange(len(rows)), seq[1:]]).max())
  assert worst < 1e-4, worst
  for t, (_, top) in enumerate(rows):
    assert [i for i, _ in top] == np.argsort(-want[t], kind="stable")[:5].tolist(), t
  assert out == np.argmax(want[len(prompt) - 1:], axis=-1).tolist()  # llama.cpp's greedy


def test_model_rejects_use_before_pages_exist():
  mc = helpers.tiny_model_config()
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  layer = model.kv  # the scanned layers' one PagedKV stack
  z = jnp.zeros((1, 1, 4, 8))
  with pytest.raises(ValueError, match="init_pages"):
    layer(z, jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 2, 8)), None, layer=0)
  with pytest.raises(ValueError, match="needs the layer's index"):
    layer(z, jnp.zeros((1, 1, 2, 8)), jnp.zeros((1, 1, 2, 8)), None)
