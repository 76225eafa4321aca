"""Shared memory of the GPU kernel's Triton form at a config's shapes, from Triton itself.

  pip install triton        # any machine: no GPU, no CUDA install (ptxas ships with it)
  python launch/triton_smem.py --config=configs/llama3_8b_h200.py [--json_out=F]

Lowers ``pallas_gpu`` for CUDA at the config's per-device shapes (decode, every prefill step
width; the chunk ``jaxkv.ops.kernel.gpu_pages_per_chunk`` picks), keeps the Triton module
Pallas builds, and compiles it with the ``triton`` package for sm_90 with the kernel's
warps and stages: ``shared`` is the compiler's own figure, printed beside
``kernel.gpu_smem_bytes`` (the model the kernel sizes its chunk with) and the 227 KiB a
block may use. ``--pages_per_chunk=N`` overrides the chunk (to measure others). Without
the ``triton`` package it prints the model alone. XLA compiles the same module with the
Triton it bundles, whose version may differ from the package's.
"""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

import _common  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "An accelerator config (configs/*.py).")
_CHUNK = flags.DEFINE_integer("pages_per_chunk", None, "Override the kernel's chunk (pages).",
                              lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the figures here as one JSON object.")
flags.mark_flag_as_required("config")


def _triton_modules(fn, args):
  """The Triton modules (text) Pallas builds while ``fn`` lowers for CUDA."""
  from jax._src.pallas.triton import pallas_call_registration as registration
  from jaxkv.tools import lowering
  captured, build = [], registration.lowering.lower_jaxpr_to_triton_module

  def keep(*a, **k):
    result = build(*a, **k)
    captured.append(result.module.operation.get_asm(enable_debug_info=False))
    return result

  registration.lowering.lower_jaxpr_to_triton_module = keep
  try:
    lowering.lower("paged_attention", fn, args, lowering.target("cuda"))
  finally:
    registration.lowering.lower_jaxpr_to_triton_module = build
  return captured


def _compile(text: str, workdir: str, name: str):
  """Triton's shared-memory figure for a module, or None without the ``triton`` package."""
  try:
    import triton
    from triton.backends.compiler import GPUTarget
  except ImportError:
    return None
  from jaxkv.ops import kernel
  path = os.path.join(workdir, f"{name}.ttir")
  with open(path, "w") as f:
    f.write(text)
  compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(
      num_warps=kernel.GPU_NUM_WARPS, num_stages=kernel.GPU_NUM_STAGES))
  return int(compiled.metadata.shared)


def main(argv):
  del argv
  import tempfile

  import jax
  import jax.numpy as jnp

  from jaxkv import buckets
  from jaxkv.tools import builder
  from jaxkv.ops import kernel, paged_attention
  _common.check_output(_JSON_OUT.value, "json_out")
  cfg = _CONFIG.value
  cache, model = builder.cache_config(cfg), builder.model_config(cfg)
  tp = cfg.mesh.model
  heads, kv_heads = model.num_heads // tp, model.num_kv_heads // tp
  rows = buckets.pow2_at_least(cfg.engine.max_seqs_per_shard)
  width = buckets.table_widths(cache.max_pages_per_seq * cache.page_size, cache)[-1]
  itemsize = jnp.dtype(cache.jnp_dtype).itemsize
  pages = _CHUNK.value or kernel.gpu_pages_per_chunk(
      cache.attention_chunk_pages, cache.page_size, model.head_dim, itemsize)
  chosen = kernel.gpu_pages_per_chunk
  kernel.gpu_pages_per_chunk = lambda *_: pages  # the chunk measured (the chosen one, or N)
  s = jax.ShapeDtypeStruct
  pool = s((kv_heads, cache.pages_per_shard, cache.page_size, model.head_dim), cache.jnp_dtype)
  widths = [1] + buckets.prefill_widths(cfg.engine.prefill_chunk_pages * cache.page_size,
                                        cache.page_size)
  out = {"config": cfg.name, "pages_per_chunk": pages, "limit_bytes": kernel.GPU_SMEM_BYTES,
         "budget_bytes": kernel.GPU_SMEM_BUDGET, "steps": {}}
  try:
    with tempfile.TemporaryDirectory() as workdir:
      for q_len in widths:
        args = (s((rows, q_len, heads, model.head_dim), cache.jnp_dtype), pool, pool,
                s((rows, width), jnp.int32), s((rows, q_len), jnp.int32), s((rows,), jnp.int32))
        fn = jax.jit(lambda *a: paged_attention(*a, pages_per_chunk=pages, impl="pallas_gpu"))
        [text] = _triton_modules(fn, args)
        rows_per_program = min(kernel.GPU_ROW_BLOCK,
                               max(16, buckets.pow2_at_least(q_len * heads // kv_heads)))
        step = {"query_tokens": q_len, "rows_per_program": rows_per_program,
                "model_bytes": kernel.gpu_smem_bytes(pages, cache.page_size, model.head_dim,
                                                     itemsize, rows_per_program),
                "triton_bytes": _compile(text, workdir, f"T{q_len}")}
        out["steps"]["decode" if q_len == 1 else f"prefill_{q_len}"] = step
        measured = ("triton not installed" if step["triton_bytes"] is None
                    else f"Triton {step['triton_bytes']:,} B")
        print(f"{cfg.name}: {q_len:4d} query tokens, {pages} pages x {cache.page_size} per "
              f"chunk, {rows_per_program} rows per program: {measured}; model "
              f"{step['model_bytes']:,} B; limit {kernel.GPU_SMEM_BYTES:,} B")
  finally:
    kernel.gpu_pages_per_chunk = chosen
  _common.write_json(_JSON_OUT.value, out)


if __name__ == "__main__":
  app.run(main)
