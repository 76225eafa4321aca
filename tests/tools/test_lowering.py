"""Every kernel form and every compiled step of the engine lowers for TPU and CUDA.

No accelerator is attached: ``jaxkv.tools.lowering`` exports each function with ``jax.export``
for the platform (TPU under an abstract v5e or v6e device), which runs the platform's own
lowering rules — block shapes, memory spaces, the ops a backend has rules for, shardings
and memory kinds — where the Pallas interpreters check none of them.
"""

import dataclasses
import glob
import importlib.util
import json
import os
import runpy

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxkv import buckets
from jaxkv.tools import builder, lowering
from jaxkv.ops import kernel, paged_attention

from helpers import ROOT, run_script

CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))
TARGETS = ("cuda", "tpu_v5e", "tpu_v6e")
KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}


def _config(path):
  return runpy.run_path(path)["get_config"]()


def _accelerator_configs():
  return [p for p in CONFIGS if _config(p).platform in lowering.PLATFORM_TARGET]


def _kernel_shapes(cfg):
  """Per-device attention shapes of a config: what one device's kernel call sees inside
  the engine's ``shard_map`` (heads split over the model axis, one data shard's pool and
  rows, the widest page table)."""
  cache = builder.cache_config(cfg)
  model = builder.model_config(cfg)
  tp = cfg.mesh.model
  rows = buckets.pow2_at_least(cfg.engine.max_seqs_per_shard)
  width = buckets.table_widths(cache.max_pages_per_seq * cache.page_size, cache)[-1]
  chunk_tokens = cfg.engine.prefill_chunk_pages * cache.page_size
  return dict(rows=rows, q_heads=model.num_heads // tp, kv_heads=model.num_kv_heads // tp,
              head_dim=model.head_dim, pages=cache.pages_per_shard, page_size=cache.page_size,
              width=width, chunk=cache.attention_chunk_pages, dtype=cache.jnp_dtype,
              q_lens=[1] + buckets.prefill_widths(chunk_tokens, cache.page_size))


def _attention_args(*, rows, q_heads, kv_heads, head_dim, pages, page_size, width, dtype,
                    q_len):
  s = jax.ShapeDtypeStruct
  pool = s((kv_heads, pages, page_size, head_dim), dtype)
  return (s((rows, q_len, q_heads, head_dim), dtype), pool, pool, s((rows, width), jnp.int32),
          s((rows, q_len), jnp.int32), s((rows,), jnp.int32))


def _lower_attention(target_name, shapes, q_len, windowed=False):
  """The kernel lowered for a target; ``windowed``: with a sliding window, a traced int32
  scalar (as a model scanning its layers passes each layer's)."""
  tgt = lowering.target(target_name)
  args = _attention_args(q_len=q_len, **{k: v for k, v in shapes.items()
                                         if k not in ("chunk", "q_lens")})
  if windowed:
    args += (jax.ShapeDtypeStruct((), jnp.int32),)
  fn = jax.jit(lambda *a: paged_attention(*a[:6], pages_per_chunk=shapes["chunk"],
                                          impl=tgt.kernel_impl, window=a[6] if windowed else None))
  return lowering.lower(f"paged_attention[T={q_len}{',window' if windowed else ''}]", fn, args,
                        tgt)


def _kernel_names(exported) -> set[str]:
  text = exported.mlir_module()
  return {part.split('"')[0] for part in text.split('name = "jaxkv_paged_attention')[1:]}


# ---- the kernel forms at every config's shapes ------------------------------------------------
def _shape_cases():
  """(config, target) for every distinct set of per-device shapes (cpu_tiny is the default's):
  CUDA and TPU v5e for each, and TPU v6e too for the configs made for TPUs."""
  cases, seen = [], set()
  for path in CONFIGS:
    cfg = _config(path)
    key = str(sorted((k, str(v)) for k, v in _kernel_shapes(cfg).items()))
    if key in seen:
      continue
    seen.add(key)
    cases += [(path, "cuda"), (path, "tpu_v5e")]
    if cfg.platform == "tpu":
      cases.append((path, "tpu_v6e"))
  return cases


@pytest.mark.parametrize("path,target_name", _shape_cases(),
                         ids=lambda x: os.path.basename(x)[:-3] if x.endswith(".py") else x)
def test_kernel_lowers_at_config_shapes(path, target_name):
  shapes = _kernel_shapes(_config(path))
  tgt = lowering.target(target_name)
  for q_len in shapes["q_lens"]:  # decode, then every prefill step width
    exported = _lower_attention(target_name, shapes, q_len)
    assert KERNEL_CALL[tgt.platform] in lowering.custom_calls(exported), (path, q_len)
  if tgt.platform == "cuda":
    # The Triton form walks the table in chunks whose tiles fit the shared memory budget;
    # the chunk it chose is in the kernel's name ("_{pages}x{page_size}").
    itemsize = jnp.dtype(shapes["dtype"]).itemsize
    pages = kernel.gpu_pages_per_chunk(shapes["chunk"], shapes["page_size"],
                                       shapes["head_dim"], itemsize)
    assert pages <= shapes["chunk"]
    assert kernel.gpu_smem_bytes(pages, shapes["page_size"], shapes["head_dim"],
                                 itemsize) <= kernel.GPU_SMEM_BUDGET
    assert _kernel_names(exported) == {f"_{pages}x{shapes['page_size']}"}


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("q_heads,kv_heads,head_dim,width,chunk", [
    (8, 8, 128, 64, 8),  # GQA 1 (multi-head)
    (32, 8, 128, 200, 16),  # GQA 4; a table that is not a chunk multiple
    (64, 8, 128, 100, 32),  # GQA 8
    (16, 4, 64, 128, 8),  # head_dim 64
    (16, 4, 256, 96, 8),  # head_dim 256
])
def test_kernel_lowers_at_edge_shapes(target_name, q_heads, kv_heads, head_dim, width, chunk):
  shapes = dict(rows=4, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, pages=4000,
                page_size=16, width=width, chunk=chunk, dtype=jnp.bfloat16)
  for q_len in (1, 128):
    exported = _lower_attention(target_name, shapes, q_len)
    assert KERNEL_CALL[lowering.target(target_name).platform] in lowering.custom_calls(exported)


@pytest.mark.parametrize("target_name", ["cuda", "tpu_v5e"])
def test_windowed_kernel_lowers_at_gemma3_shapes(target_name):
  # Gemma 3 270M's local layers (4 query heads on one KV head of 256, bf16 pages of 16
  # tokens): the sliding window, traced, in both kernel forms, for decode and a prefill step.
  shapes = dict(rows=8, q_heads=4, kv_heads=1, head_dim=256, pages=4000, page_size=16,
                width=256, chunk=8, dtype=jnp.bfloat16)
  for q_len in (1, 128):
    exported = _lower_attention(target_name, shapes, q_len, windowed=True)
    assert KERNEL_CALL[lowering.target(target_name).platform] in lowering.custom_calls(exported)
    assert exported.in_avals[-1].shape == () and exported.in_avals[-1].dtype == jnp.int32


def test_gpu_chunk_is_bounded_by_shared_memory_not_by_the_pool():
  # Llama-3-8B/70B heads (head_dim 128, bf16, 16-token pages): the requested 32-page chunk
  # is cut to what fits; the pool size does not enter.
  pages = kernel.gpu_pages_per_chunk(32, 16, 128, 2)
  assert 1 <= pages < 32 and pages & (pages - 1) == 0
  assert kernel.gpu_smem_bytes(pages, 16, 128, 2) <= kernel.GPU_SMEM_BUDGET
  assert kernel.gpu_smem_bytes(2 * pages, 16, 128, 2) > kernel.GPU_SMEM_BUDGET
  assert kernel.gpu_pages_per_chunk(2, 16, 128, 2) == 2  # never wider than asked
  assert kernel.gpu_pages_per_chunk(6, 16, 64, 2) == 4  # a power of two
  with pytest.raises(ValueError, match="power-of-two head_dim"):
    kernel.gpu_pages_per_chunk(8, 16, 96, 2)


# ---- every compiled step of the engine, on each accelerator config's mesh ----------------------
def _engine_cases():
  # Each config on its own platform with that platform's kernel, and on the other with the
  # config's own attention (auto: jnp), so every step lowers for both platforms.
  cases = []
  for path in _accelerator_configs():
    own = lowering.PLATFORM_TARGET[_config(path).platform]
    other = "tpu_v5e" if own == "cuda" else "cuda"
    cases += [(path, own, lowering.target(own).kernel_impl), (path, other, None)]
  return cases


@pytest.mark.parametrize("path,target_name,impl", _engine_cases(),
                         ids=lambda x: os.path.basename(x)[:-3] if isinstance(x, str)
                         and x.endswith(".py") else str(x))
def test_engine_functions_lower(path, target_name, impl):
  cfg = _config(path)
  tgt = lowering.target(target_name)
  # Two layers: every layer is the same function of the same shapes, so two lower what 32
  # or 80 do (the embedding and head are outside the layers and are lowered either way).
  mesh, functions = lowering.engine_functions(cfg, tgt, impl=impl, num_layers=2)
  assert dict(mesh.shape) == {"data": cfg.mesh.data, "model": cfg.mesh.model}
  names = [f.name for f in functions]
  chunk_tokens = cfg.engine.prefill_chunk_pages * cfg.cache.page_size
  widths = buckets.prefill_widths(chunk_tokens, cfg.cache.page_size)
  assert sum(n.startswith("prefill[") for n in names) == len(widths)
  assert any(n.startswith("decode[") for n in names)
  assert any(n.startswith("plan[") for n in names)
  if cfg.tiers.host_pages_per_shard:
    assert {"host_store", "host_load", "decode_streamed", "prefill_streamed"} <= {
        n.split("[")[0] for n in names}
  for f in functions:
    exported = lowering.lower(f.name, f.fn, f.args, tgt, mesh)
    calls = lowering.custom_calls(exported)
    assert exported.platforms == (tgt.platform,)
    # The plan runs on one device; everything else over the whole mesh.
    devices = 1 if f.name.startswith("plan[") else cfg.mesh.data * cfg.mesh.model
    assert exported.nr_devices == devices, f.name
    if f.name.startswith(("host_", "decode_streamed", "prefill_streamed")) and not \
        f.name.startswith("host_stage"):  # (staging is device work alone)
      assert "annotate_device_placement" in calls, f.name  # host memory kinds kept
    if impl is not None and f.name.startswith(("decode", "prefill")):
      assert KERNEL_CALL[tgt.platform] in calls, f.name  # the kernel, not its interpreter


@pytest.mark.parametrize("target_name", ["cuda", "tpu_v5e"])
def test_host_moves_compute_nothing_on_the_host_and_move_one_block_per_transfer(target_name):
  # The host tier's moves as a GPU or TPU compiles them: a store is a loop of one
  # iteration per block, each one transfer into host memory placed into the donated pool
  # (plus the pool's own placement as the result); a load the same loop reading; no
  # host-compute region, no scatter into host memory (XLA runs either on a few host
  # threads, draining the device first). The buckets are the block counts: no padding.
  cfg = _config(os.path.join(ROOT, "configs", "llama3_2_1b_gpu.py"))
  tgt = lowering.target(target_name)
  mesh, functions = lowering.engine_functions(cfg, tgt, num_layers=2)
  moves = {f.name.split("[")[0]: f for f in functions if f.name.startswith("host_")}
  assert set(moves) == {"host_stage", "host_store", "host_load", "host_store_stack"}
  # Staging is device work alone: its own program, so a step reusing the pages waits for
  # the gather only.
  stage = moves.pop("host_stage")
  report = lowering.host_move_report(lowering.lower(stage.name, stage.fn, stage.args, tgt, mesh))
  assert report["to_host"] == report["to_device"] == report["host_compute"] == 0, report
  assert report["loops"] == [], report
  for name, f in moves.items():
    blocks = f.args[-1].shape[1]  # ids [data shards, blocks per shard]
    report = lowering.host_move_report(lowering.lower(f.name, f.fn, f.args, tgt, mesh))
    assert report["host_compute"] == 0 and report["scatters"] == 0, (f.name, report)
    assert report["loops"] == [blocks], (f.name, report)
    if name == "host_load":
      assert (report["to_device"], report["to_host"]) == (1, 0), (f.name, report)
    else:
      assert (report["to_host"], report["placements"]) == (2, 1), (f.name, report)
      assert report["donated"], (f.name, report)


def test_engine_functions_lower_at_full_depth():
  # One config at its real depth (32 layers), as a check that depth changes nothing.
  cfg = _config(os.path.join(ROOT, "configs", "llama3_8b_h200.py"))
  tgt = lowering.target("cuda")
  mesh, functions = lowering.engine_functions(cfg, tgt, impl="pallas_gpu")
  decode = next(f for f in functions if f.name.startswith("decode["))
  exported = lowering.lower(decode.name, decode.fn, decode.args, tgt, mesh)
  # The layers are scanned: one K and one V stack of all 32 layers' pools in, the same out
  # (donated), and one layer's attention compiled (the kernel once, not 32 times).
  pools = [a for a in exported.in_avals
           if a.shape[:2] == (cfg.model.num_layers, cfg.model.num_kv_heads) and len(a.shape) == 5]
  assert len(pools) == 2
  text = exported.mlir_module()
  assert text.count(KERNEL_CALL["cuda"]) == 1


@pytest.mark.parametrize("target_name", ["cuda", "tpu_v5e"])
@pytest.mark.parametrize("kv_groups", [True, False])
def test_gemma3_engine_steps_lower_with_the_windowed_kernel(target_name, kv_groups):
  # Gemma 3 270M at its real shapes and depth (lowering.GEMMA3_270M: 18 layers, one KV head
  # of 256, every sixth layer global, the others a 512-token window) in the engine's decode
  # and prefill steps, with the platform's kernel, in both layouts: the local layers' pages
  # in the cache's window group (their stack attends with its window, through its own page
  # table), or every layer's pages in one stack (the scan carries each layer's window, 0
  # for a global one, into the kernel as a traced scalar). One KV head: the model axis is
  # 1, as this config's mesh has it.
  gemma = dataclasses.replace(lowering.GEMMA3_270M, kv_groups=kv_groups)
  local = gemma.window_layers
  cfg = _config(os.path.join(ROOT, "configs", "llama3_2_1b_gpu.py"))
  cfg.tiers.host_window_pages_per_shard = 4096  # (kept windows' copies in host memory)
  tgt = lowering.target(target_name)
  mesh, functions = lowering.engine_functions(cfg, tgt, impl=tgt.kernel_impl, model_cfg=gemma)
  steps = [f for f in functions if f.name.startswith(("decode[", "prefill["))]
  chunk_tokens = cfg.engine.prefill_chunk_pages * cfg.cache.page_size
  assert sum(f.name.startswith("prefill[") for f in steps) == len(
      buckets.prefill_widths(chunk_tokens, cfg.cache.page_size))
  # The tiers move the global layers' blocks alone: a window group's pages never leave the
  # device. A streamed step streams the global layers' cold pages; the local layers read
  # the window group's ring through its own table.
  named = {f.name.split("[")[0]: f for f in functions}
  gather = named["gather_stacked"]
  assert sorted(p.shape[0] for p in gather.args[0]) == [18 - local] * 2
  assert "decode_streamed" in named and "prefill_streamed" in named
  assert ("copy_window_pages" in named) == bool(local)
  lowering.lower(gather.name, gather.fn, gather.args, tgt, mesh)
  assert ({"window_host_stage", "window_host_store", "window_host_load"} <= set(named)) == bool(local)
  if local:  # the window group's page copy (a kept block), on its own pools
    copy = named["copy_window_pages"]
    assert sorted(p.shape[0] for p in copy.args[0]) == [local] * 2
    lowering.lower(copy.name, copy.fn, copy.args, tgt, mesh)
    # Its host copies' moves: the local layers' pages alone, one transfer per block, no
    # computation on host memory (as the block pools' host moves, test above).
    stage = named["window_host_stage"]
    assert sorted(p.shape[0] for p in stage.args[0]) == [local] * 2
    for f in (named["window_host_store"], named["window_host_load"]):
      assert f.args[0].shape[1] == 2 * local  # (a host slot holds the window layers' K and V)
      report = lowering.host_move_report(lowering.lower(f.name, f.fn, f.args, tgt, mesh))
      assert report["host_compute"] == 0 and report["scatters"] == 0, (f.name, report)
      assert report["loops"] == [f.args[-1].shape[1]], (f.name, report)
    streamed = named["decode_streamed"]
    assert isinstance(streamed.args[3], tuple)  # the block table and the window table
    text = lowering.lower(streamed.name, streamed.fn, streamed.args, tgt, mesh).mlir_module()
    assert text.count(KERNEL_CALL[tgt.platform]) == 2, streamed.name  # one per kind
  kinds = ", ".join(str(gemma.is_global(i)).lower() for i in range(gemma.num_layers))
  for f in (steps[0], steps[-1]):  # a decode step and the widest prefill step
    exported = lowering.lower(f.name, f.fn, f.args, tgt, mesh)
    text = exported.mlir_module()
    # K and V stacks, bfloat16, one KV head of 256: the global layers' and the window
    # group's, or all 18 layers' in one.
    pools = [a for a in exported.in_avals if len(a.shape) == 5]
    assert {(a.shape[1], a.shape[-1], a.dtype) for a in pools} == {
        (1, 256, jnp.dtype(jnp.bfloat16))}
    stacks = [18 - local, local] if local else [18]
    assert sorted(a.shape[0] for a in pools) == sorted(stacks * 2), f.name
    # The layers scanned: the kernel once per kind of layer, not once per layer.
    assert text.count(KERNEL_CALL[tgt.platform]) == len(stacks), f.name
    # In one stack each layer's kind (global or local) rides in the scan; with the window
    # group each stretch of same-kind layers is a scan of its own. The window is 512 tokens.
    assert (f"dense<[{kinds}]>" in text) == (not local), f.name
    assert f"dense<{gemma.sliding_window}> : tensor<i32>" in text, f.name


# ---- what a failure says -----------------------------------------------------------------------
def test_a_failure_names_the_function_the_target_and_the_error():
  # The GPU kernel as it was before it had a Triton form of its own: with no compiler
  # parameters Pallas lowers to Mosaic GPU, which stages the whole block — here a pool of
  # 4,000 pages — in shared memory.
  pool = jax.ShapeDtypeStruct((4000, 16, 128), jnp.bfloat16)

  def copy(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  fn = jax.jit(lambda x: pl.pallas_call(copy, out_shape=pool)(x))
  with pytest.raises(lowering.LoweringError) as info:
    lowering.lower("whole_pool_block", fn, (pool,), lowering.target("cuda"))
  message = str(info.value)
  assert message.startswith("whole_pool_block does not lower for cuda (cuda): ")
  assert "shared memory" in message
  assert info.value.__cause__ is not None  # the lowering error, with its traceback


def test_unknown_target_is_refused():
  with pytest.raises(ValueError, match="tpu_v5e"):
    lowering.target("tpu_v9")


def test_lowering_does_not_change_how_kernels_run_here():
  # After lowering for CUDA, the same kernel on this CPU still runs (in the interpreter)
  # and agrees with the jnp path: lowering_for is scoped to the export.
  shapes = dict(rows=2, q_heads=4, kv_heads=2, head_dim=32, pages=16, page_size=16, width=4,
                chunk=2, dtype=jnp.float32)
  _lower_attention("cuda", shapes, 1)
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((2, 1, 4, 32)), jnp.float32)
  kp = jnp.asarray(rng.standard_normal((2, 16, 16, 32)), jnp.float32)
  vp = jnp.asarray(rng.standard_normal((2, 16, 16, 32)), jnp.float32)
  table = jnp.asarray([[0, 1, 2, 3], [4, 5, 6, 7]], jnp.int32)
  pos = jnp.asarray([[40], [63]], jnp.int32)
  lens = jnp.asarray([41, 64], jnp.int32)
  got = paged_attention(q, kp, vp, table, pos, lens, pages_per_chunk=2, impl="pallas_gpu")
  want = paged_attention(q, kp, vp, table, pos, lens, pages_per_chunk=2, impl="jnp")
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


# What Triton 3.9 reported for the Triton form compiled for sm_90 with 4 warps and 2 stages
# (launch/triton_smem.py, BUILD.md "The GPU form"): (head_dim, pages of 16 tokens per
# chunk, query rows per program) -> shared memory in bytes, bf16 K/V. The 4-, 8- and
# 2-page chunks are the ones the form picks at head_dim 128, 64 and 256; the 32-page ones
# are the chunk it had before; 8 pages at head_dim 128 is the chunk it turned down.
TRITON_SMEM = {
    (128, 4, 16): 61_712, (128, 4, 64): 131_088, (128, 32, 16): 434_560,
    (128, 32, 64): 819_328, (128, 8, 64): 229_408,
    (64, 8, 16): 61_728, (64, 8, 64): 114_720, (64, 32, 16): 233_856, (64, 32, 64): 409_728,
    (256, 2, 16): 67_848, (256, 2, 64): 163_848,
}
TRITON_LIMIT = 232_448  # what one block may opt into on sm_90, as Triton reported it
CHOSEN = {128: 4, 64: 8, 256: 2}  # head_dim -> the chunk (pages) behind the figures above


def test_the_smem_model_matches_the_figures_triton_reported():
  """Runs everywhere (no ``triton`` package needed): the sizing model the GPU form picks
  its chunk with, held to Triton's own figures recorded above. A 64-row program is within
  0.1% of Triton's figure, a 16-row one is never under it (the model only overestimates a
  decode), and the chunk the form picks has Triton's figure under the limit."""
  assert kernel.GPU_SMEM_BYTES == TRITON_LIMIT
  for (head_dim, pages, rows), triton_bytes in TRITON_SMEM.items():
    model = kernel.gpu_smem_bytes(pages, 16, head_dim, 2, rows)
    if rows == kernel.GPU_ROW_BLOCK:
      assert abs(model - triton_bytes) <= triton_bytes // 1000, (head_dim, pages, model)
    else:
      assert rows == 16 and model >= triton_bytes, (head_dim, pages, model)
  for head_dim, pages in CHOSEN.items():
    assert kernel.gpu_pages_per_chunk(32, 16, head_dim, 2) == pages, head_dim
    for rows in (16, 64):
      assert TRITON_SMEM[head_dim, pages, rows] <= TRITON_LIMIT
      assert kernel.gpu_smem_bytes(pages, 16, head_dim, 2, rows) <= kernel.GPU_SMEM_BUDGET
    # The next chunk up is over the budget (the model) though Triton may still fit it.
    assert kernel.gpu_smem_bytes(2 * pages, 16, head_dim, 2) > kernel.GPU_SMEM_BUDGET
  assert TRITON_SMEM[128, 8, 64] <= TRITON_LIMIT < TRITON_SMEM[128, 32, 64]


def test_triton_smem_reports_the_chosen_chunk_for_every_step(tmp_path):
  """launch/triton_smem.py at Llama-3-8B shapes: the chunk the form picks, every step's
  model figure against the recorded Triton figures, and Triton's live figure under the
  limit where the ``triton`` package is installed; where it is not, the script must say
  so (no figure, "triton not installed"), not report one."""
  path = tmp_path / "smem.json"
  code, out, err = run_script(["launch/triton_smem.py", "--config=configs/llama3_8b_h200.py",
                               f"--json_out={path}"], timeout_s=600)
  assert code == 0, err[-3000:]
  r = json.loads(path.read_text())
  cfg = _config(os.path.join(ROOT, "configs", "llama3_8b_h200.py"))
  assert r["pages_per_chunk"] == kernel.gpu_pages_per_chunk(
      cfg.cache.attention_chunk_pages, cfg.cache.page_size, cfg.model.head_dim, 2) == 4
  assert r["limit_bytes"] == TRITON_LIMIT and r["budget_bytes"] == kernel.GPU_SMEM_BUDGET
  chunk_tokens = cfg.engine.prefill_chunk_pages * cfg.cache.page_size
  steps = {"decode"} | {f"prefill_{w}" for w in buckets.prefill_widths(chunk_tokens, 16)}
  assert set(r["steps"]) == steps
  live = importlib.util.find_spec("triton") is not None
  for name, step in r["steps"].items():
    rows = step["rows_per_program"]
    assert rows == (16 if name == "decode" else kernel.GPU_ROW_BLOCK), name
    recorded = TRITON_SMEM[cfg.model.head_dim, r["pages_per_chunk"], rows]
    assert step["model_bytes"] <= kernel.GPU_SMEM_BUDGET
    assert step["model_bytes"] >= recorded - recorded // 1000, name
    if live:  # Triton's own figure at these shapes, whatever its version: under the limit
      assert isinstance(step["triton_bytes"], int) and 0 < step["triton_bytes"] <= TRITON_LIMIT
    else:
      assert step["triton_bytes"] is None, name
  assert "query tokens" in out
  assert ("triton not installed" in out) is not live
