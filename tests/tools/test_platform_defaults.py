"""Per-platform defaults for a real checkpoint: the dtype it computes in (float32 on CPU),
a mesh that holds its weights once in one machine's memory, prefill steps wide enough to
be bound by the cores — and none of it changes what reuse guarantees: the compute dtype is
part of the cache's fingerprint, and reuse gives the tokens a recompute gives (and its
bits, where every step holds one row)."""

import json
import os
import runpy

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import hf_fixtures as hf
import jaxkv
from jaxkv.tools import builder
from jaxkv.models import from_pretrained
from jaxkv.models.hf import platform_dtype

from helpers import run_script

import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT
BF16 = np.dtype(ml_dtypes.bfloat16)


def bf16_checkpoint(path, seed=0, **overrides):
  """A Llama checkpoint stored in bfloat16 (as most are) with a tokenizer; returns
  ``(path, hf config, the stored weights as float32)``."""
  ids = hf.write_tokenizer(path)
  cfg = hf.hf_config("llama", vocab_size=320, torch_dtype="bfloat16",
                     bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], **overrides)
  weights = {k: v.astype(BF16) for k, v in hf.random_weights(cfg, seed=seed).items()}
  hf.write_checkpoint(path, cfg, weights)
  return path, cfg, {k: v.astype(np.float32) for k, v in weights.items()}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  return bf16_checkpoint(str(tmp_path_factory.mktemp("bf16") / "model"))


def tiny_config():
  return runpy.run_path(os.path.join(ROOT, "configs", "cpu_tiny.py"))["get_config"]()


def test_the_platform_picks_the_dtype():
  assert platform_dtype("bfloat16", "cpu") == (
      "float32", "platform cpu default; checkpoint stores bfloat16")
  assert platform_dtype("float16", "cpu")[0] == "float32"
  assert platform_dtype("float32", "cpu")[0] == "float32"
  assert platform_dtype("bfloat16", "gpu")[0] == "bfloat16"
  assert platform_dtype("bfloat16", "tpu")[0] == "bfloat16"
  assert platform_dtype("float32", "gpu")[0] == "float32"  # the checkpoint's own


def test_auto_loads_a_bf16_checkpoint_in_float32_on_cpu(checkpoint):
  path, _, weights = checkpoint
  stored = from_pretrained(path)  # the default stays the checkpoint's own dtype
  auto = from_pretrained(path, dtype="auto")
  assert stored.cfg.dtype == "bfloat16" and auto.cfg.dtype == "float32"
  q = auto.layers.attn.q_proj.kernel.get_value()[0]  # layer 0 of the scanned stack
  assert q.dtype == np.float32
  np.testing.assert_array_equal(np.asarray(q),
                                weights["model.layers.0.self_attn.q_proj.weight"].T)


def test_cpu_defaults_fit_a_checkpoint_to_one_machine(checkpoint):
  path = checkpoint[0]
  cfg = tiny_config()
  cfg.tiers.host_pages_per_shard = 32
  builder.use_model_dir(cfg, path)
  lines = builder.platform_defaults(cfg, platform="cpu")
  assert cfg.model.dtype == "float32"
  assert (cfg.mesh.data, cfg.mesh.model) == (1, 1)
  # One data shard with the totals of the config's four: rows, device and host pages.
  assert cfg.engine.max_seqs_per_shard == 8 and cfg.cache.pages_per_shard == 1024
  assert cfg.tiers.host_pages_per_shard == 128
  assert cfg.engine.prefill_chunk_pages * cfg.cache.page_size == builder.CPU_PREFILL_TOKENS
  assert cfg.engine.cache_decode_blocks is False
  assert lines[0] == ("dtype float32 (platform cpu default; checkpoint stores bfloat16; "
                      "--config.model.dtype=bfloat16 keeps it)")
  assert lines[1].startswith("mesh 1 x 1 (data x model") and "4 to 8 times" in lines[1]
  assert lines[2].startswith("prefill chunk 8 pages = 128 tokens")


def test_what_the_user_set_is_kept(checkpoint):
  path = checkpoint[0]
  cfg = tiny_config()
  builder.use_model_dir(cfg, path)
  cfg.model.dtype = "bfloat16"
  explicit = {"model.dtype", "mesh.data", "engine.prefill_chunk_pages",
              "engine.cache_decode_blocks"}
  lines = builder.platform_defaults(cfg, platform="cpu", explicit=explicit)
  assert cfg.model.dtype == "bfloat16" and (cfg.mesh.data, cfg.mesh.model) == (4, 2)
  assert cfg.engine.prefill_chunk_pages == 1 and cfg.engine.cache_decode_blocks is True
  assert cfg.cache.pages_per_shard == 256 and cfg.engine.max_seqs_per_shard == 2
  assert lines == ["dtype bfloat16 (asked for; checkpoint stores bfloat16)"]
  # Only the model axis set: the data axis is still folded into one shard.
  cfg = tiny_config()
  builder.use_model_dir(cfg, path)
  builder.platform_defaults(cfg, platform="cpu", explicit={"mesh.model"})
  assert (cfg.mesh.data, cfg.mesh.model, cfg.engine.max_seqs_per_shard) == (1, 2, 8)
  # A dtype the config file chose (neither float32 nor the checkpoint's) is its choice.
  cfg = tiny_config()
  builder.use_model_dir(cfg, path)
  cfg.model.dtype = "float16"
  builder.platform_defaults(cfg, platform="cpu")
  assert cfg.model.dtype == "float16"


def test_other_platforms_processes_and_random_weights_keep_the_config(checkpoint):
  path = checkpoint[0]
  for platform, processes in (("gpu", 1), ("tpu", 1)):
    cfg = tiny_config()
    builder.use_model_dir(cfg, path)
    cfg.model.dtype = "bfloat16"
    before = cfg.to_dict()
    lines = builder.platform_defaults(cfg, platform=platform, processes=processes)
    assert cfg.to_dict() == before and lines == [f"dtype bfloat16 (the config's, on platform "
                                                 f"{platform})"]
  cfg = tiny_config()
  builder.use_model_dir(cfg, path)
  builder.platform_defaults(cfg, platform="cpu", processes=2)  # a job's processes: its mesh
  assert (cfg.mesh.data, cfg.engine.max_seqs_per_shard) == (4, 2)
  assert cfg.engine.prefill_chunk_pages == 8
  cfg = tiny_config()  # the embedded default: random weights, nothing changes
  before = cfg.to_dict()
  assert builder.platform_defaults(cfg, platform="cpu") == [] and cfg.to_dict() == before


def one_device_mesh():
  return jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])


def engine_for(model, tiers=None):
  c = model.cfg
  cc = jaxkv.CacheConfig(model_name="same-name", num_layers=c.num_layers,
                         num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, page_size=4,
                         pages_per_shard=32, max_pages_per_seq=16, attention_chunk_pages=4,
                         dtype="float32")  # the same cache config for every dtype
  return jaxkv.Engine(model, jaxkv.KVCache(cc, one_device_mesh(), tiers),
                      jaxkv.EngineConfig(max_seqs_per_shard=1),
                      scheduler=jaxkv.SchedulerConfig(decision="fetch"))


def test_the_compute_dtype_is_part_of_the_fingerprint(checkpoint, tmp_path):
  """One checkpoint, one cache config, two compute dtypes: different weights digests and
  fingerprints, so blocks computed in bfloat16 are never served to a float32 engine (and
  the other way round) — tested through a shared disk store."""
  path = checkpoint[0]
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"), disk_pages=64,
                           write_policy="write_through")
  prompt = list(range(3, 40))

  def serve(dtype):
    engine = engine_for(from_pretrained(path, dtype=dtype, mesh=one_device_mesh()), tiers)
    out = engine.generate([prompt], 3)
    engine.flush(30)
    return engine, out

  bf16, _ = serve("bfloat16")
  f32, f32_out = serve("float32")
  a, b = bf16.cache.config, f32.cache.config
  assert a.weights_digest != b.weights_digest and a.fingerprint() != b.fingerprint()
  assert f32.stats()["hits"]["disk"] == 0 and f32.cache.disk_recovered["adopted"] == 0
  again, again_out = serve("float32")  # the same dtype again: its own records are hits
  assert again.cache.config.fingerprint() == b.fingerprint()
  assert again.stats()["hits"]["disk"] > 0 and again_out == f32_out


def chat(reuse, fresh, users, turns, *, bitwise):
  """``users`` multi-turn chats sharing a 150-token system prompt, each turn generated
  with reuse and from scratch: equal tokens, and logits equal bit for bit or to 1e-5.
  Returns the device hits of the reusing engine."""
  rng = np.random.default_rng(5)
  system = [int(t) for t in rng.integers(3, 320, 150)]
  history = [list(system) for _ in range(users)]
  for turn in range(turns):
    prompts = []
    for h in history:
      h += [int(t) for t in rng.integers(3, 320, int(rng.integers(20, 90)))]
      prompts.append(list(h))
    got, got_logits = reuse.generate(prompts, 6, return_logits=True)
    want, want_logits = fresh.generate(prompts, 6, return_logits=True)
    assert got == want, turn
    for g, w in zip(got_logits, want_logits):
      if bitwise:
        np.testing.assert_array_equal(g, w, err_msg=f"turn {turn}")
      else:
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5, err_msg=f"turn {turn}")
    for h, answer in zip(history, got):
      h += answer
  return reuse.stats()["hits"]["device"]


def test_reuse_gives_the_tokens_of_a_recompute_at_the_cpu_checkpoint_defaults(checkpoint):
  """cpu_tiny serving a bfloat16 checkpoint with the CPU defaults (float32, one shard of
  8 rows, 128-token prefill steps): two users' chats over two turns (the second reuses the
  shared system prompt and the first turn) with reuse give the tokens of an engine that
  recomputes every prompt from scratch, and the weights are held once."""
  cfg = tiny_config()
  builder.use_model_dir(cfg, checkpoint[0])
  builder.platform_defaults(cfg, platform="cpu")
  reuse = builder.build_engine(cfg, cache="jaxkv")
  fresh = builder.build_engine(cfg, cache="nocache")
  assert reuse.runner.chunk_tokens == 128 and not reuse.config.cache_decode_blocks
  params = jax.tree.leaves(nnx.state(reuse.model, nnx.Param))
  assert all(p.dtype == np.float32 for p in params)
  # Every weight on one device, once (the config's 4 x 2 mesh held 4 to 8 copies).
  assert {d for p in params for d in p.sharding.device_set} == {jax.devices()[0]}
  assert all(sum(s.data.nbytes for s in p.addressable_shards) == p.nbytes for p in params)
  # Logits to 1e-6, not bit for bit: XLA:CPU's matmuls round differently when a step
  # holds another number of rows (2 prompts prefilled together here, 1 there).
  hits = chat(reuse, fresh, users=2, turns=2, bitwise=False)
  assert hits > 2 * (150 // 16)  # the system prompt and earlier turns were reused


def test_one_row_at_a_time_reuse_gives_the_bits_of_a_recompute(tmp_path):
  """The CPU defaults' prefill steps (128 tokens, decode blocks not cached) keep a block's
  K/V the same bits however it was computed, where every step holds one row: reused and
  recomputed prompts give bit-identical logits over three turns (two users: each step holds
  one row whatever their number). (A checkpoint of the
  benchmark model's width: at hidden size 32 XLA:CPU's matmuls round by a row's place in
  the step, and with decode blocks cached the third turn's logits differ.)"""
  path = bf16_checkpoint(str(tmp_path / "wide"), hidden_size=256, intermediate_size=512,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32)[0]
  cfg = tiny_config()
  builder.use_model_dir(cfg, path)
  builder.platform_defaults(cfg, platform="cpu")
  with cfg.unlocked():
    cfg.engine.max_seqs_per_shard = 1
  reuse = builder.build_engine(cfg, cache="jaxkv")
  fresh = builder.build_engine(cfg, cache="nocache")
  assert reuse.runner.chunk_tokens == 128 and not reuse.config.cache_decode_blocks
  assert chat(reuse, fresh, users=2, turns=3, bitwise=True) > 2 * (150 // 16)


def test_generate_computes_a_bf16_checkpoint_in_float32_on_cpu_and_says_so(checkpoint,
                                                                          tmp_path):
  path, cfg, weights = checkpoint
  prompt = [int(t) for t in np.random.default_rng(2).integers(3, 320, 21)]
  ids = ",".join(map(str, prompt))
  runs = {}
  for name, extra in (("default", []), ("asked", ["--dtype=bfloat16"])):
    out = tmp_path / f"{name}.json"
    rc, _, err = run_script(["launch/generate.py", f"--model_dir={path}", f"--prompt_ids={ids}",
                             "--max_new_tokens=5", "--ignore_eos", f"--json_out={out}", *extra])
    assert rc == 0, err[-3000:]
    runs[name] = (json.loads(out.read_text()), err)
  r, err = runs["default"]
  why = "platform cpu default; checkpoint stores bfloat16; --dtype=bfloat16 keeps it"
  assert r["dtype"] == "float32" and r["checkpoint_dtype"] == "bfloat16"
  assert r["dtype_reason"] == why and f"dtype float32 ({why})" in err
  assert r["prefill_chunk_pages"] == 2  # 26 tokens: one step holds the whole request
  # float32 arithmetic on the stored values: the float64 reference's greedy tokens.
  assert r["token_ids"] == hf.reference_greedy(cfg, weights, prompt, 5)[0]
  asked, err = runs["asked"]
  assert asked["dtype"] == "bfloat16"
  assert "dtype bfloat16 (asked for with --dtype; checkpoint stores bfloat16)" in err
  assert asked["weights_digest"] != r["weights_digest"]  # another dtype, another cache


def test_serve_keeps_what_the_command_line_sets(checkpoint, tmp_path):
  path = checkpoint[0]
  out = tmp_path / "serve.json"
  rc, _, err = run_script(["launch/serve.py", f"--model_dir={path}", "--nocompare",
                           f"--json_out={out}", "--config.mesh.data=4",
                           "--config.engine.prefill_chunk_pages=1",
                           "--config.model.dtype=float32", "--config.workload.chat.users=2",
                           "--config.workload.chat.turns=2",
                           # (short chats: at most 32 + 2 x (24 + 4) = 88 tokens, 6 pages)
                           "--config.workload.chat.system_prompt_tokens=32",
                           "--config.workload.chat.user_tokens=(8, 24)",
                           "--config.workload.chat.max_new_tokens=4",
                           # (fewer step shapes to compile: one row a shard, 1 table width)
                           "--config.engine.max_seqs_per_shard=1",
                           "--config.cache.max_pages_per_seq=8"])
  assert rc == 0, err[-3000:]
  assert "dtype float32 (asked for; checkpoint stores bfloat16)" in err
  assert "mesh 1 x" not in err and "prefill chunk" not in err
  assert "blocks filled while decoding" not in err
  r = json.loads(out.read_text())
  assert r["mesh"] == {"data": 4, "model": 2} and r["prefill_chunk_pages"] == 1
  assert r["dtype"] == "float32" and r["stats"]["hits"]["device"] > 0  # it served turn 2
