"""Loading a checkpoint: time and peak host memory of ``from_pretrained`` against what a
user would write instead, and against reading the files' bytes.

A Hugging Face directory of Llama 3.2 1B's shapes (bfloat16, random values, two shards;
``quick``: a tiny model) is written once. Each candidate then runs in its own process, so
its peak memory is its own:
- ``jaxkv``: ``jaxkv.models.from_pretrained`` (tensor by tensor onto the device);
- ``load_file``: ``safetensors.numpy.load_file`` of every shard, then one ``device_put``
  of the whole dict (the checkpoint whole in host memory);
- ``read``: the files' bytes read into one reused buffer (the disk/page-cache floor).
Each process imports only what its candidate uses, before its clock and its memory
baseline start. The files were just written, so they are in the page cache: these are
load times without the disk, the part jaxkv controls. Memory is sampled every 2 ms from
``/proc/self/status``: ``anon`` (RssAnon, memory the process owns) and ``file`` (RssFile,
mapped file pages the kernel can drop at any time). On CPU the "device" is this process's
memory too, so the weights themselves count as anon: there the floor is 1.0x the
checkpoint and what a loader adds is the excess over it. Candidates run interleaved,
``reps`` times each.

Then decode speed per dtype on the same checkpoint, in one process on one device
(``DECODE_MODES``, interleaved, a warm-up first): the weights converted to float32 at
load (the CPU default), kept in bfloat16 as stored, and kept in bfloat16 but computed in
float32 (``bf16_storage_f32_compute``: a float32 model whose linear layers and embedding
hold the bfloat16 arrays and convert them inside each step; built here only to measure
it — jaxkv does not offer it, because it measured slower than float32). One request of
``DECODE_PROMPT`` tokens, ``DECODE_NEW`` new tokens; tokens/s over the decode steps
(first token to last). ``decode_vs_float32`` gives each dtype's speed over float32's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from jaxkv.tools.env import child_env

LLAMA_3_2_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=64, tie_word_embeddings=True, rope_theta=500000.0,
                    rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0,
                                      original_max_position_embeddings=8192))
TINY = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)

_CHILD = r"""
import json, os, sys, threading, time
peak = {"anon": 0, "file": 0}
def rss():
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(("RssAnon:", "RssFile:")):
        out[line.split(":")[0][3:].lower()] = int(line.split()[1]) * 1024
  return out
stop = False
def sample():
  while not stop:
    for k, v in rss().items():
      peak[k] = max(peak[k], v)
    time.sleep(0.002)
kind, path = sys.argv[1], sys.argv[2]
if kind != "read":  # reading bytes needs no JAX: that process starts in a second, not five
  import jax, numpy as np
  import jaxkv
  from flax import nnx
  from safetensors.numpy import load_file
  jax.numpy.zeros(1).block_until_ready()
buf = bytearray(64 << 20)
base = rss()
threading.Thread(target=sample, daemon=True).start()
t0 = time.perf_counter()
if kind == "jaxkv":
  model = jaxkv.models.from_pretrained(path)
  leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
  jax.block_until_ready(leaves)
  nbytes = sum(x.nbytes for x in leaves)
elif kind == "load_file":
  host = {}
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      host.update(load_file(os.path.join(path, f)))
  placed = jax.device_put(host)
  jax.block_until_ready(placed)
  nbytes = sum(x.nbytes for x in placed.values())
else:
  nbytes = 0
  for f in sorted(os.listdir(path)):
    if f.endswith(".safetensors"):
      with open(os.path.join(path, f), "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
          nbytes += n
seconds = time.perf_counter() - t0
stop = True
time.sleep(0.01)
for k, v in rss().items():
  peak[k] = max(peak[k], v)
print(json.dumps({"seconds": seconds, "bytes": nbytes,
                  "peak_anon_bytes": peak["anon"] - base["anon"],
                  "peak_file_bytes": peak["file"] - base["file"]}))
"""


DECODE_MODES = ("float32", "bfloat16", "bf16_storage_f32_compute")
DECODE_PROMPT, DECODE_NEW = 16, 5

_DECODE_CHILD = r"""
import json, sys, time
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import jaxkv
from jaxkv.models.llama import Llama
path, modes = sys.argv[2], sys.argv[3].split(",")
reps, prompt_len, new = map(int, sys.argv[4:])
mesh = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])

def bf16_storage_f32_compute(stored):
  # A float32 model over the bfloat16 model's arrays: nnx.Linear and nnx.Embed convert
  # their parameters to their float32 compute dtype inside each step; the norms' scales
  # (a few KB) are made float32, as RMSNorm multiplies by them directly.
  cfg = jaxkv.models.llama_config(jaxkv.models.hf.read_config(path), dtype="float32")
  graphdef, _, rest = nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))),
                                nnx.Param, ...)
  # New variables over the same arrays: the bfloat16 model is left as it is.
  flat = [(p, nnx.Param(v.get_value().astype(jnp.float32) if p[-1] == "scale"
                        else v.get_value()))
          for p, v in nnx.to_flat_state(nnx.state(stored, nnx.Param))]
  rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest)
  return nnx.merge(graphdef, nnx.from_flat_state(flat), rest)

models, engines = {}, {}
for mode in modes:
  if mode == "bf16_storage_f32_compute":
    stored = models.get("bfloat16") or jaxkv.models.from_pretrained(path, dtype="bfloat16",
                                                                     mesh=mesh)
    models[mode] = bf16_storage_f32_compute(stored)
  else:
    models[mode] = jaxkv.models.from_pretrained(path, dtype=mode, mesh=mesh)
for mode, model in models.items():
  c, pages = model.cfg, -(-(prompt_len + new) // 16)
  cache = jaxkv.CacheConfig.for_model(model, model_name=mode, page_size=16,
                                      pages_per_shard=pages, max_pages_per_seq=pages,
                                      attention_chunk_pages=min(pages, 8), dtype=c.dtype)
  engines[mode] = jaxkv.Engine(model, jaxkv.KVCache(cache, mesh), jaxkv.EngineConfig(
      max_seqs_per_shard=1, prefill_chunk_pages=pages, prefix_reuse=False))
  engines[mode].warmup(max_seq_len=prompt_len + new)
weight_bytes = {m: sum(x.nbytes for x in jax.tree.leaves(nnx.state(models[m], nnx.Param)))
                for m in modes}
vocab = models[modes[0]].cfg.vocab_size
runs = {m: [] for m in modes}
for rep in range(reps + 1):  # the first round is a warm-up (one decode step each)
  prompt = [int(t) for t in np.random.default_rng(rep).integers(0, vocab, prompt_len)]
  for mode, engine in engines.items():
    stamps = []
    t0 = time.perf_counter()
    handle = engine.submit(prompt, jaxkv.SamplingParams(max_new_tokens=new if rep else 2),
                           on_token=lambda _: stamps.append(time.perf_counter()))
    tokens = list(handle)
    if rep:
      runs[mode].append({"tokens_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
                         "ttft_s": stamps[0] - t0, "tokens": tokens})
print(json.dumps({"runs": runs, "weight_bytes": weight_bytes}))
"""


def write_checkpoint(path: str, shape: dict, *, shards: int, seed: int = 0) -> int:
  """A bfloat16 Hugging Face directory of ``shape`` with random values; returns bytes."""
  import ml_dtypes
  from safetensors.numpy import save_file
  rng = np.random.default_rng(seed)
  h, m, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
  d, nq, nkv = shape["head_dim"], shape["num_attention_heads"], shape["num_key_value_heads"]
  shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
  if not shape["tie_word_embeddings"]:
    shapes["lm_head.weight"] = (v, h)
  for i in range(shape["num_hidden_layers"]):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.q_proj.weight": (nq * d, h),
                   p + "self_attn.k_proj.weight": (nkv * d, h),
                   p + "self_attn.v_proj.weight": (nkv * d, h),
                   p + "self_attn.o_proj.weight": (h, nq * d),
                   p + "mlp.gate_proj.weight": (m, h), p + "mlp.up_proj.weight": (m, h),
                   p + "mlp.down_proj.weight": (h, m)})
  os.makedirs(path, exist_ok=True)
  names = sorted(shapes)
  weight_map, total = {}, 0
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = {}
    for n in names[s::shards]:
      part[n] = (0.02 * rng.standard_normal(shapes[n], np.float32)).astype(ml_dtypes.bfloat16)
      total += part[n].nbytes
    save_file(part, os.path.join(path, file))
    weight_map.update({n: file for n in part})
    del part
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"weight_map": weight_map}, f)
  config = dict(architectures=["LlamaForCausalLM"], hidden_act="silu", rms_norm_eps=1e-5,
                torch_dtype="bfloat16", **shape)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return total


def _child(kind: str, path: str, *, script: str = _CHILD, args=()) -> dict:
  # One device: the weights once.
  env = child_env(JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
  proc = subprocess.run([sys.executable, "-c", script, kind, path, *map(str, args)], env=env,
                        capture_output=True, text=True, timeout=1800)
  if proc.returncode != 0:
    raise RuntimeError(f"{kind} failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def decode_by_dtype(path: str, *, reps: int) -> dict:
  """Decode tokens/s of the checkpoint at ``path`` per ``DECODE_MODES`` (see the module
  docstring), side by side in one process."""
  import statistics
  out = _child("decode", path, script=_DECODE_CHILD,
               args=(",".join(DECODE_MODES), reps, DECODE_PROMPT, DECODE_NEW))
  runs = out["runs"]
  figures = {}
  for mode, rs in runs.items():
    tps = [r["tokens_per_s"] for r in rs]
    figures[mode] = {"tokens_per_s": statistics.median(tps), "tokens_per_s_min": min(tps),
                     "tokens_per_s_max": max(tps),
                     "ttft_s": statistics.median(r["ttft_s"] for r in rs),
                     "weight_bytes": out["weight_bytes"][mode], "reps": len(rs),
                     "same_tokens_as_float32": all(
                         r["tokens"] == f["tokens"] for r, f in zip(rs, runs["float32"]))}
  base = figures["float32"]["tokens_per_s"]
  ratios = {m: f["tokens_per_s"] / base for m, f in figures.items() if m != "float32"}
  return {"decode": figures, "decode_prompt_tokens": DECODE_PROMPT,
          "decode_new_tokens": DECODE_NEW, "decode_vs_float32": ratios,
          # the same figures as top-level numbers (what launch/bench.py prints)
          "decode_float32_tokens_per_s": base,
          **{f"decode_{m}_vs_float32": r for m, r in ratios.items()}}


def run(*, quick: bool = False, reps: int = 3) -> dict:
  shape, name = (TINY, "tiny") if quick else (LLAMA_3_2_1B, "llama-3.2-1b")
  with tempfile.TemporaryDirectory(prefix="jaxkv-weights-") as tmp:
    path = os.path.join(tmp, name)
    nbytes = write_checkpoint(path, shape, shards=2)
    runs = {k: [] for k in ("jaxkv", "load_file", "read")}
    for _ in range(reps):
      for kind in runs:
        runs[kind].append(_child(kind, path))
    decode = decode_by_dtype(path, reps=reps)
  med = lambda kind, key: float(np.median([r[key] for r in runs[kind]]))
  figures = {kind: {"seconds": med(kind, "seconds"),
                    "seconds_min": min(r["seconds"] for r in runs[kind]),
                    "seconds_max": max(r["seconds"] for r in runs[kind]),
                    "gb_per_s": nbytes / med(kind, "seconds") / 1e9,
                    "peak_anon_bytes": med(kind, "peak_anon_bytes"),
                    "peak_file_bytes": med(kind, "peak_file_bytes"),
                    "reps": len(runs[kind])} for kind in runs}
  return {
      "model": name, "checkpoint_bytes": nbytes, "loads": figures,
      "load_vs_load_file": figures["load_file"]["seconds"] / figures["jaxkv"]["seconds"],
      "load_vs_read": figures["read"]["seconds"] / figures["jaxkv"]["seconds"],
      "peak_anon_vs_checkpoint": figures["jaxkv"]["peak_anon_bytes"] / nbytes,
      "load_file_peak_anon_vs_checkpoint": figures["load_file"]["peak_anon_bytes"] / nbytes,
      "all_loaded_bytes_equal": all(r["bytes"] == nbytes for k in ("jaxkv", "load_file")
                                    for r in runs[k]),
      **decode,
  }
