"""Suite ``kernels``: every attention implementation on the same decode and prefill steps.

For each implementation (the chunked ``jnp`` path, jaxkv's Pallas kernel in its GPU and
TPU forms), interleaved: one decode step (``q_len`` 1 for every sequence of the batch) and
one prefill chunk (``prefill_tokens`` queries per sequence at the end of its context),
over the same pages, page tables and lengths. Reported per step: median seconds, tokens/s,
the bytes of K/V the step must read and the GB/s that makes, the ratio to ``jnp``, and the
largest difference from the reference (a check that the timed thing is the right thing).

Off its own hardware a kernel runs in Pallas' interpreter: on CPU those rows are labelled
``interpreted`` and their times say nothing about the kernel's speed (only that it runs);
on a GPU or TPU the other backend's kernel is left out.
On a GPU, ``--suite=kernels`` times the Triton-form kernel for real; shapes default to
Llama-3-8B's attention (32 query heads, 8 kv heads, head_dim 128, 16-token pages).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.tools.bench import common
from jaxkv.config import ATTENTION_IMPLS
from jaxkv.ops import paged_attention, paged_attention_reference, resolve_impl

IMPLS = tuple(i for i in ATTENTION_IMPLS if i != "auto")


def shapes(quick: bool, backend: str) -> dict:
  if backend == "gpu" and not quick:  # Llama-3-8B attention, 4k contexts
    return dict(batch=32, heads=32, kv_heads=8, head_dim=128, page_size=16, context=4096,
                prefill_tokens=512, pages_per_chunk=32, dtype="bfloat16")
  if quick:
    return dict(batch=2, heads=4, kv_heads=2, head_dim=32, page_size=16, context=256,
                prefill_tokens=16, pages_per_chunk=4, dtype="float32")
  return dict(batch=4, heads=8, kv_heads=2, head_dim=64, page_size=16, context=1024,
              prefill_tokens=64, pages_per_chunk=8, dtype="float32")


def _case(rng, s: dict, q_len: int):
  dtype = jnp.dtype(s["dtype"])
  pages_per_seq = s["context"] // s["page_size"]
  num_pages = s["batch"] * pages_per_seq
  pool = (s["kv_heads"], num_pages, s["page_size"], s["head_dim"])
  k = jnp.asarray(rng.standard_normal(pool), dtype)
  v = jnp.asarray(rng.standard_normal(pool), dtype)
  table = jnp.asarray(rng.permutation(num_pages).reshape(s["batch"], pages_per_seq), jnp.int32)
  lens = jnp.full((s["batch"],), s["context"], jnp.int32)
  q = jnp.asarray(rng.standard_normal((s["batch"], q_len, s["heads"], s["head_dim"])), dtype)
  pos = jnp.broadcast_to(jnp.arange(s["context"] - q_len, s["context"], dtype=jnp.int32),
                         (s["batch"], q_len))
  return q, k, v, table, pos, lens


def run(*, quick: bool = False, reps: int = 5) -> dict:
  backend = jax.default_backend()
  s = shapes(quick, backend)
  rng = np.random.default_rng(0)
  steps = {"decode": _case(rng, s, 1), "prefill": _case(rng, s, s["prefill_tokens"])}
  kv_bytes = 2 * s["batch"] * s["context"] * s["kv_heads"] * s["head_dim"] * jnp.dtype(
      s["dtype"]).itemsize  # K and V of every context: what a step must read
  # On an accelerator, another backend's kernel would only run interpreted at full size.
  impls = [i for i in IMPLS if backend == "cpu" or not resolve_impl(i)[1]]
  out: dict = {"shapes": s, "backend": backend, "kv_bytes_per_step": kv_bytes}
  for step, args in steps.items():
    want = np.asarray(jax.jit(paged_attention_reference)(*args), np.float32)
    fns, interpreted = {}, {}
    for impl in impls:
      interpreted[impl] = bool(resolve_impl(impl)[1])
      fn = jax.jit(functools.partial(paged_attention, pages_per_chunk=s["pages_per_chunk"],
                                     impl=impl))
      fns[impl] = functools.partial(lambda f: jax.block_until_ready(f(*args)), fn)
      err = float(np.max(np.abs(np.asarray(fns[impl](), np.float32) - want)))
      out[f"{step}_{impl}_max_abs_error"] = err
    times = common.interleaved(fns, reps=reps)
    tokens = s["batch"] * args[0].shape[1]
    for impl in impls:
      t = times[impl]
      out[f"{step}_{impl}"] = {**common.throughput(kv_bytes, t),
                               "tokens_per_s": tokens / t["median_s"],
                               "interpreted": interpreted[impl]}
      out[f"{step}_{impl}_vs_jnp"] = common.ratio(t, times["jnp"])
  out["notes"] = ("rows marked interpreted ran in Pallas' interpreter on this backend: their "
                  "times are not kernel performance; gb_per_s is the step's K/V bytes / time")
  return out
