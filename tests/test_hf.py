"""Hugging Face checkpoints and tokenizers: jaxkv's logits and greedy tokens equal an
independent NumPy implementation (tests/hf_fixtures.py), text goes in and comes out, and
the weights are part of the cache's key."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hf_fixtures as hf
import jaxkv
from jaxkv.models import CheckpointError, from_pretrained

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_for(model, mesh, name="hf", tiers=None, **engine_kw):
  mc = model.cfg
  cc = jaxkv.CacheConfig(model_name=name, num_layers=mc.num_layers,
                         num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, page_size=4,
                         pages_per_shard=48, max_pages_per_seq=24, attention_chunk_pages=4,
                         dtype=mc.dtype)
  return jaxkv.Engine(model, jaxkv.KVCache(cc, mesh, tiers),
                      jaxkv.EngineConfig(max_seqs_per_shard=1, **engine_kw),
                      scheduler=jaxkv.SchedulerConfig(policy="fetch"))


# family, config overrides, shards, and an ablation of the reference that the test must be
# able to tell apart (so it checks the feature, not only that both sides agree).
CASES = {
    "llama-sharded-mha": ("llama", dict(num_key_value_heads=4), 3,
                          dict(rope_theta=500000.0)),
    "llama3-rope-scaling": ("llama3", {}, 1, dict(rope_scaling=None)),
    "mistral": ("mistral", dict(hidden_size=48, head_dim=16, num_attention_heads=2,
                                intermediate_size=96, rms_norm_eps=1e-5), 2,
                dict(rms_norm_eps=0.5)),
    "qwen2-bias-tied": ("qwen2", {}, 1, "no_bias"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_tokens_equal_the_numpy_reference(case, mesh, tmp_path):
  family, overrides, shards, ablation = CASES[case]
  cfg = hf.hf_config(family, **overrides)
  weights = hf.random_weights(cfg, seed=3)
  path = hf.write_checkpoint(str(tmp_path / case), cfg, weights, shards=shards)
  if shards > 1:
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) == shards
  model = from_pretrained(path, mesh=mesh)
  engine = engine_for(model, mesh)
  rng = np.random.default_rng(7)
  prompts = [[int(t) for t in rng.integers(0, cfg["vocab_size"], n)] for n in (37, 9)]
  tokens, logits = engine.generate(prompts, 6, return_logits=True)
  for prompt, got_tokens, got_logits in zip(prompts, tokens, logits):
    want_tokens, want_logits = hf.reference_greedy(cfg, weights, prompt, 6)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got_logits, want_logits, rtol=1e-4, atol=2e-4)
  # The ablated reference is far from jaxkv's logits: the feature is really checked.
  if ablation == "no_bias":
    ablated_cfg, ablated_w = cfg, {k: v * (0 if k.endswith(".bias") else 1)
                                   for k, v in weights.items()}
  else:
    ablated_cfg, ablated_w = {**cfg, **ablation}, weights
  _, ablated = hf.reference_greedy(ablated_cfg, ablated_w, prompts[0], 6)
  assert np.abs(ablated - logits[0]).max() > 1e-2
  # A cache hit (the same prompt again, its blocks reused) changes no token.
  again = engine.generate(prompts[:1], 6)
  assert engine.stats()["hits"]["device"] > 0 and again == tokens[:1]


def test_the_model_is_built_from_the_checkpoint_not_initialised(tmp_path, mesh):
  cfg = hf.hf_config("qwen2")
  path = hf.write_checkpoint(str(tmp_path / "q"), cfg, hf.random_weights(cfg, seed=0))
  model = from_pretrained(path, mesh=mesh, dtype="bfloat16")
  assert model.cfg.tie_embeddings and model.cfg.qkv_bias and not model.cfg.out_bias
  assert not hasattr(model, "lm_head")
  # Tensor-parallel over the model axis (2 devices): whole heads per device, rows of the
  # output projections, vocabulary of nothing here (tied: the embedding is replicated).
  q = model.layers[0].attn.q_proj.kernel.get_value()  # [32, 4 heads x 8]
  assert q.dtype == np.dtype("bfloat16") and len(q.sharding.device_set) == mesh.size
  assert {s.data.shape for s in q.addressable_shards} == {(32, 16)}
  assert {s.data.shape for s in model.layers[0].attn.q_proj.bias.get_value()
          .addressable_shards} == {(16,)}
  assert {s.data.shape for s in model.layers[0].mlp.down.kernel.get_value()
          .addressable_shards} == {(32, 32)}  # [mlp 64, hidden 32]: rows split
  assert model.embed.embedding.get_value().sharding.is_fully_replicated
  want = hf.random_weights(cfg, seed=0)["model.layers.0.self_attn.q_proj.weight"].T
  np.testing.assert_array_equal(np.asarray(q, np.float32),
                                want.astype(np.dtype("bfloat16")).astype(np.float32))


def write_bad(tmp_path, name, *, drop=None, shape=None, **cfg_overrides):
  cfg = hf.hf_config("llama", **cfg_overrides)
  weights = hf.random_weights(hf.hf_config("llama"), seed=0)
  if drop:
    del weights[drop]
  if shape:
    weights[shape] = weights[shape][:-1]
  return hf.write_checkpoint(str(tmp_path / name), cfg, weights)


def truncate(path):
  file = os.path.join(path, "model.safetensors")
  with open(file, "r+b") as f:
    f.truncate(os.path.getsize(file) - 100)
  return path


@pytest.mark.parametrize("kind,needle", [
    ("arch", "architecture 'GPT2LMHeadModel' is not supported"),
    ("missing", "tensor 'model.layers.1.mlp.up_proj.weight' is missing"),
    ("shape", "tensor 'model.norm.weight' has shape (31,); config.json implies (32,)"),
    ("rope", "rope_scaling type 'yarn' is not supported"),
    ("act", "hidden_act='gelu' is not supported"),
    ("nodir", "does not exist"),
    ("truncated", "truncated?"),
])
def test_an_unloadable_checkpoint_is_refused_in_one_line(kind, needle, tmp_path):
  path = {
      "arch": lambda: write_bad(tmp_path, "a", architectures=["GPT2LMHeadModel"]),
      "missing": lambda: write_bad(tmp_path, "m", drop="model.layers.1.mlp.up_proj.weight"),
      "shape": lambda: write_bad(tmp_path, "s", shape="model.norm.weight"),
      "rope": lambda: write_bad(tmp_path, "r", rope_scaling=dict(rope_type="yarn", factor=4.0)),
      "act": lambda: write_bad(tmp_path, "g", hidden_act="gelu"),
      "nodir": lambda: str(tmp_path / "nowhere"),
      "truncated": lambda: truncate(write_bad(tmp_path, "t")),
  }[kind]()
  with pytest.raises(CheckpointError) as e:
    from_pretrained(path)
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_sliding_window_limits_the_cache(tmp_path, mesh):
  cfg = hf.hf_config("mistral", sliding_window=64)
  path = hf.write_checkpoint(str(tmp_path / "w"), cfg, hf.random_weights(cfg, seed=0))
  model = from_pretrained(path, mesh=mesh)
  assert model.max_context == 64
  with pytest.raises(ValueError, match="sliding window.*max_pages_per_seq <= 16"):
    engine_for(model, mesh)  # 24 pages x 4 tokens = 96 > 64


def test_tokenizer_encodes_decodes_and_renders_the_chat(tmp_path):
  ids = hf.write_tokenizer(str(tmp_path))
  tok = jaxkv.Tokenizer.from_dir(str(tmp_path))
  text = "the cache keeps pages, hello world!"
  encoded = tok.encode(text)
  assert encoded[0] == ids["<s>"] and ids["<s>"] not in encoded[1:]  # the post-processor's BOS
  assert tok.decode(encoded) == text
  assert tok.encode(text, add_special_tokens=False) == encoded[1:]
  msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
  assert tok.render_chat(msgs) == "<s><|system|>be brief<|end|><|user|>hello<|end|><|assistant|>"
  chat = tok.encode_chat(msgs)
  assert chat.count(ids["<s>"]) == 1 and chat[-1] == ids["<|assistant|>"]
  assert tok.eos_token_ids == (ids["</s>"], ids["<|end|>"])
  with pytest.raises(jaxkv.tokenizer.TokenizerError, match="'content'"):
    tok.render_chat([{"role": "user"}])
  with pytest.raises(jaxkv.tokenizer.TokenizerError, match="tokenizer.json is missing"):
    jaxkv.Tokenizer.from_dir(str(tmp_path / "nothing"))


def text_checkpoint(tmp_path, seed=0):
  return hf.text_checkpoint(str(tmp_path / f"text{seed}"), seed)


def run(script, *args, timeout=600):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, f"launch/{script}", *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=timeout)


def test_generate_text_in_text_out(tmp_path):
  path, cfg, weights, _ = text_checkpoint(tmp_path)
  tok = jaxkv.Tokenizer.from_dir(path)
  out = tmp_path / "g.json"
  proc = run("generate.py", f"--model_dir={path}", "--prompt=hello world", "--chat",
             "--max_new_tokens=7", f"--json_out={out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  prompt = tok.encode_chat([{"role": "user", "content": "hello world"}])
  want, _ = hf.reference_greedy(cfg, weights, prompt, 7)
  stop = next((i for i, t in enumerate(want) if t in tok.eos_token_ids), None)
  want = want if stop is None else want[:stop + 1]
  assert r["prompt_ids"] == prompt and r["token_ids"] == want
  assert r["text"] == tok.decode(want)
  assert proc.stdout.split() == r["text"].split()  # the answer is what it prints
  # Token ids in, the same answer; no tokenizer needed for the ids.
  ids_out = tmp_path / "ids.json"
  proc = run("generate.py", f"--model_dir={path}", f"--prompt_ids={','.join(map(str, prompt))}",
             "--max_new_tokens=7", f"--json_out={ids_out}")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert json.loads(ids_out.read_text())["token_ids"] == want


@pytest.mark.parametrize("args,needle", [
    (["--prompt=hi", "--prompt_ids=1,2"], "exactly one of --prompt"),
    (["--prompt_ids=1,x"], "must be integers"),
    (["--prompt_ids=1", "--chat"], "--chat needs --prompt"),
])
def test_generate_refuses_bad_input_in_one_line(args, needle, tmp_path):
  path, *_ = text_checkpoint(tmp_path)
  proc = run("generate.py", f"--model_dir={path}", *args)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]


def test_serve_a_checkpoint_with_text_prompts(tmp_path):
  path, cfg, weights, _ = text_checkpoint(tmp_path)
  tok = jaxkv.Tokenizer.from_dir(path)
  shared = "the cache keeps keys and values of every token it has seen. " * 3
  lines = [{"prompt": shared + "hello", "round": 0, "max_new_tokens": 4},
           {"messages": [{"role": "user", "content": shared + "world"}], "round": 1,
            "max_new_tokens": 4},
           {"prompt": [int(t) for t in tok.encode(shared)], "round": 1, "max_new_tokens": 3}]
  trace = tmp_path / "trace.jsonl"
  trace.write_text("".join(json.dumps(l) + "\n" for l in lines))
  out = tmp_path / "serve.json"
  proc = run("serve.py", f"--model_dir={path}", f"--trace={trace}", f"--json_out={out}",
             "--config.cache.pages_per_shard=64")
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The CPU defaults for a checkpoint, each said at load (tests/test_platform_defaults.py).
  for line in ("dtype float32 (platform cpu default, as the checkpoint stores it)",
               "mesh 1 x 1 (data x model", "prefill chunk 8 pages = 128 tokens"):
    assert line in proc.stderr, line
  r = json.loads(out.read_text())
  assert r["mesh"] == {"data": 1, "model": 1} and r["prefill_chunk_pages"] == 8
  assert r["outputs_match"]
  assert r["stats"]["hits"]["device"] > 0  # the shared text was reused
  prompts = [tok.encode(lines[0]["prompt"]), tok.encode_chat(lines[1]["messages"]),
             lines[2]["prompt"]]
  for i, (prompt, n) in enumerate(zip(prompts, (4, 4, 3))):
    want, _ = hf.reference_greedy(cfg, weights, prompt, n)
    if i < 2:  # text lines stop at the tokenizer's eos ids
      stop = next((j for j, t in enumerate(want) if t in tok.eos_token_ids), None)
      want = want if stop is None else want[:stop + 1]
    assert r["texts"][i] == tok.decode(want)
  assert "answer 1:" in proc.stdout


def test_other_weights_never_hit_a_shared_disk_store(tmp_path, mesh):
  """Two checkpoints of one config (a base and a 'fine-tune') on one disk directory: the
  second gets no hit from the first's records; the first, loaded again, gets its own."""
  cfg = hf.hf_config("llama")
  base = hf.write_checkpoint(str(tmp_path / "base"), cfg, hf.random_weights(cfg, seed=0))
  tuned = hf.write_checkpoint(str(tmp_path / "tuned"), cfg, hf.random_weights(cfg, seed=1))
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"), disk_pages=64,
                           write_policy="write_through")
  prompt = list(range(1, 40))

  def serve(path):
    engine = engine_for(from_pretrained(path, mesh=mesh), mesh, name="same-name", tiers=tiers)
    out = engine.generate([prompt], 3)
    engine.flush(30)
    return engine, out

  first, base_out = serve(base)
  second, tuned_out = serve(tuned)
  assert second.stats()["hits"]["disk"] == 0 and second.cache.disk_recovered["adopted"] == 0
  want, _ = hf.reference_greedy(cfg, hf.random_weights(cfg, seed=1), prompt, 3)
  assert tuned_out[0] == want
  third, again = serve(tuned)
  assert third.stats()["hits"]["disk"] > 0 and again == tuned_out
