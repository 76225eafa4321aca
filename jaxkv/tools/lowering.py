"""Lowering jaxkv's compiled functions for an accelerator that is not attached.

The Pallas interpreters run a kernel on any machine, but they check neither the memory
limits of the hardware nor what its compiler accepts. ``jax.export`` lowers a function for a
named platform from this one, through the same lowering rules a GPU or TPU host runs, so a
kernel whose blocks do not fit, an op a backend has no rule for or a sharding the mesh
cannot hold fails here, in CI, before any device is lent.

- ``Target``: a platform and the device kind its lowering rules read. TPU rules ask for the
  chip (generation, tiling): lowering runs under an abstract mesh whose abstract device
  names it. The Triton form of the GPU kernel lowers without a device (its rules fall back
  to compute capability 9.0, the H100/H200 generation).
- ``lower``: exports one function; a failure raises ``LoweringError`` naming the function,
  the target and the first line of the error (the lowering error is its cause).
- ``engine_functions``: every function the engine compiles for a config, with abstract
  arguments in their shardings and memory kinds on the config's mesh: the prefill step at
  each width, the decode step, both streaming from the host pool, the page moves between
  device and host memory, and the plan. Nothing is allocated: weights, pools and batches
  are ``ShapeDtypeStruct``s, so a 70B config lowers on a laptop. The model is the config's
  Llama, or another family's config given as ``model_cfg`` (``GEMMA3_270M``: Gemma 3's
  local layers pass their sliding window into the kernel as a traced scalar, a path the
  Llama does not take).

Lowered modules are for checking, never stored: Triton's custom call has no compatibility
guarantee, so ``lower`` lifts export's check for it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax import export
from jax.sharding import AbstractDevice, AbstractMesh, NamedSharding, PartitionSpec as P

from jaxkv import buckets
from jaxkv import nnx as kvnnx
from jaxkv.worker import pages as pages_lib
from jaxkv.config import CacheConfig, StreamConfig
from jaxkv.planning.costs import LINKS, CostArrays
from jaxkv.errors import InputError
from jaxkv.models import Gemma3Config
from jaxkv.ops import select


@dataclasses.dataclass(frozen=True)
class Target:
  """A platform to lower for: ``platform`` as ``jax.export`` names it, the device kind
  its lowering rules see, and the kernel implementation that runs on it."""

  name: str
  platform: str
  device_kind: str
  kernel_impl: str

  @property
  def device(self) -> AbstractDevice:
    return AbstractDevice(device_kind=self.device_kind, num_cores=1,
                          platform="gpu" if self.platform == "cuda" else self.platform)


TARGETS = {t.name: t for t in (
    Target("cuda", "cuda", "NVIDIA H200", "pallas_gpu"),
    Target("tpu_v5e", "tpu", "TPU v5 lite", "pallas_tpu"),
    Target("tpu_v6e", "tpu", "TPU v6 lite", "pallas_tpu"),
)}
# The target a config's ``platform`` lowers for first.
PLATFORM_TARGET = {"gpu": "cuda", "tpu": "tpu_v5e"}

# Custom calls without export's compatibility guarantee that jaxkv's kernels emit.
_UNSTABLE_CALLS = ("__gpu$xla.gpu.triton", "triton_kernel_call", "mosaic_gpu", "mosaic_gpu_v2")


class LoweringError(RuntimeError):
  """A function does not lower for a target (the lowering error is its ``__cause__``)."""


def target(name: str) -> Target:
  if name not in TARGETS:
    raise InputError(f"lowering target {name!r} is not one of {sorted(TARGETS)}.")
  return TARGETS[name]


def abstract_mesh(tgt: Target, axis_sizes: tuple = (1,), axis_names: tuple = ("x",)
                  ) -> AbstractMesh:
  """A mesh of ``tgt``'s devices, none attached (Auto axes, as ``pages.make_mesh``)."""
  return AbstractMesh(tuple(axis_sizes), tuple(axis_names),
                      axis_types=(jax.sharding.AxisType.Auto,) * len(axis_sizes),
                      abstract_device=tgt.device)


def lower(name: str, fn: Callable, args, tgt: Target, mesh: AbstractMesh | None = None
          ) -> export.Exported:
  """``fn`` (jitted or not) exported for ``tgt`` with abstract ``args``, under ``mesh``
  (default: one device of ``tgt``)."""
  mesh = abstract_mesh(tgt) if mesh is None else mesh
  checks = [export.DisabledSafetyCheck.custom_call(c) for c in _UNSTABLE_CALLS]
  fn = fn if hasattr(fn, "trace") else jax.jit(fn)
  try:
    with jax.sharding.use_abstract_mesh(mesh), select.lowering_for(tgt.device.platform):
      return export.export(fn, platforms=[tgt.platform], disabled_checks=checks)(*args)
  except Exception as e:  # any failure to lower is the finding: report which and where
    first = next((line.strip() for line in str(e).splitlines() if line.strip()),
                 type(e).__name__)
    raise LoweringError(f"{name} does not lower for {tgt.name} ({tgt.platform}): "
                        f"{type(e).__name__}: {first}") from e


def custom_calls(exported: export.Exported) -> set[str]:
  """The custom-call targets in a lowered module (a kernel shows up as one)."""
  text = exported.mlir_module()
  pretty = {part.split("(")[0] for part in text.split("stablehlo.custom_call @")[1:]}
  generic = {part.split('"')[0] for part in text.split('call_target_name = "')[1:]}
  return pretty | generic


def loop_trip_counts(text: str) -> list[int]:
  """The trip count of every ``stablehlo.while`` of a module whose condition compares its
  counter with a constant (a loop of static length), in order; -1 where it does not."""
  counts = []
  for m in re.finditer(r"stablehlo\.while\(", text):
    cond = text[m.end():text.find("} do {", m.end())]
    bound = re.search(r"compare\s+LT,\s*%[\w#]+,\s*(%[\w#]+)", cond)
    defs = list(re.finditer(re.escape(bound.group(1)) + r" = stablehlo\.constant dense<(\d+)>",
                            text[:m.start()])) if bound else []
    counts.append(int(defs[-1].group(1)) if defs else -1)
  return counts


def host_move_report(exported: export.Exported) -> dict:
  """What a lowered host-tier move does with host memory, counted in its module:
  ``to_host`` / ``to_device`` (memory-space transfers, and the host pool's own placement
  as a result), ``placements`` (``dynamic_update_slice``), ``scatters``, ``host_compute``
  (regions XLA runs as host computations), ``donated`` (an argument aliased to a result:
  the pool in place) and ``loops`` (``loop_trip_counts``: one transfer per iteration)."""
  text = exported.mlir_module()
  return {
      "loops": loop_trip_counts(text),
      "to_host": text.count('_xla_buffer_placement = "pinned_host"')
                 + text.count('_xla_buffer_placement = "unpinned_host"'),
      "to_device": text.count('_xla_buffer_placement = "device"'),
      "placements": text.count("stablehlo.dynamic_update_slice"),
      "scatters": text.count("stablehlo.scatter") + text.count('"stablehlo.scatter"'),
      "host_compute": text.count("_xla_compute_type"),
      "donated": "tf.aliasing_output" in text or "jax.buffer_donor" in text,
  }


# ---- the engine's functions for a config -------------------------------------------------------
# Gemma 3 270M as its checkpoint configures it (what jaxkv.models.hf.gemma3_config reads
# from its config.json), bfloat16: 18 layers, every sixth global, the others a 512-token
# window; one KV head of 256 for four query heads.
GEMMA3_270M = Gemma3Config(vocab_size=262144, hidden_size=640, num_layers=18, num_heads=4,
                           num_kv_heads=1, head_dim=256, mlp_dim=2048, rope_theta=1_000_000.0,
                           rope_local_theta=10_000.0, query_pre_attn_scalar=256.0,
                           sliding_window=512, global_every=6, dtype="bfloat16")


@dataclasses.dataclass(frozen=True)
class Lowerable:
  """One compiled function of the engine with abstract arguments."""

  name: str
  fn: Callable
  args: tuple


def _sds(mesh, shape, dtype, spec=None, memory_kind=None) -> jax.ShapeDtypeStruct:
  sharding = NamedSharding(mesh, spec if spec is not None else P(), memory_kind=memory_kind)
  return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)


def _abstract_model(model_cfg, cache_cfg: CacheConfig, mesh: AbstractMesh):
  """``(graphdef, pools, pool_def, weights, weight_def, block_pools)`` of the model of
  ``model_cfg`` (a ``Gemma3Config``: Gemma 3, else the Llama), every leaf a
  ``ShapeDtypeStruct`` placed as ``from_pretrained`` and ``init_pages`` place it.
  ``pools`` are what a step takes (every pool, in the model's order); ``block_pools`` the
  ones the tiers move (a window group's pools are not: its pages never leave the device)."""
  from jaxkv import models
  from jaxkv.models import hf
  family = models.Gemma3 if isinstance(model_cfg, models.Gemma3Config) else models.Llama
  model = nnx.eval_shape(lambda: family(model_cfg, rngs=nnx.Rngs(0)))
  for layer in kvnnx.paged_layers(model):
    # A window group's pool (a layer with ``window``) has its own page count; the engine
    # sizes it when the config leaves it 0, never above the block pool's, so the block
    # pool's count stands in for it here (the kernel's blocks do not depend on it).
    pages = (cache_cfg.window_pages_per_shard or None) if layer.window else None
    shape = pages_lib.pool_shape(mesh, cache_cfg, pages)
    pool = (_sds(mesh, shape, cache_cfg.jnp_dtype, pages_lib.pool_spec(cache_cfg))
            if layer.num_layers is None else
            _sds(mesh, (layer.num_layers, *shape), cache_cfg.jnp_dtype,
                 pages_lib.layer_stack_spec(cache_cfg)))
    layer.k_pages.set_value(pool)
    layer.v_pages.set_value(pool)
  window_ids = kvnnx.window_leaf_ids(model)
  graphdef, state, rest = nnx.split(model, kvnnx.KVPages, ...)
  pools, pool_def = jax.tree.flatten(state)
  block_pools = [p for p in pools if id(p) not in window_ids]
  model_size = mesh.shape[cache_cfg.model_axis]

  def place(path, value):
    spec = (hf.partition_spec(path, value.shape, cache_cfg.model_axis, model_size)
            if len(path) >= 2 else P())
    return _sds(mesh, value.shape, value.dtype, spec)

  rest = nnx.from_flat_state([(path, var.replace(place(path, var.get_value())))
                              for path, var in nnx.to_flat_state(rest)])
  weights, weight_def = jax.tree.flatten(rest)
  return graphdef, pools, pool_def, weights, weight_def, block_pools


def _host_moves(mesh, cache_cfg: CacheConfig, kind: str, pools, shards: int,
                host_pages: int, moved: int, name: str = "host") -> tuple:
  """The host pool (abstract) and the host tier's moves at a transfer of ``moved`` pages
  per shard: staging, the per-block store, the load, and the store of a whole stack
  (``name``: the moves' names' start; ``pools``: the device pools they move between)."""
  from jaxkv.worker.tiers import host as host_lib
  bits = pages_lib.bits_dtype(cache_cfg.jnp_dtype)
  block = (sum(pages_lib.pool_layers(p) for p in pools), cache_cfg.num_kv_heads, cache_cfg.page_size,
           cache_cfg.head_dim)
  host_pool = _sds(mesh, (shards * (host_pages + 1), *block), bits,
                   pages_lib.host_spec(cache_cfg), memory_kind=kind)
  fns = host_lib.host_fns(mesh, cache_cfg, kind, pages_lib.pool_ranks(pools))
  size = min(moved, host_lib.MOVE_BUCKET_MAX)
  ids = lambda n: _sds(mesh, (shards, n), jnp.int32, P(cache_cfg.data_axis, None))
  blocks = _sds(mesh, (shards * size, *block), bits, pages_lib.host_spec(cache_cfg))
  stack = _sds(mesh, (block[0], block[1], shards * moved, *block[2:]), bits,
               pages_lib.stacked_spec(cache_cfg))
  return host_pool, [
      Lowerable(f"{name}_stage[pages={size}]", fns.stage, (tuple(pools), ids(size))),
      Lowerable(f"{name}_store[pages={size}]", fns.place, (host_pool, blocks, ids(size))),
      Lowerable(f"{name}_load[pages={size}]", fns.load, (host_pool, ids(size))),
      Lowerable(f"{name}_store_stack[pages={moved}]", fns.store, (host_pool, stack, ids(moved)))]


def _page_moves(cfg: Mapping, cache_cfg: CacheConfig, mesh, pools, block_pools, row
                ) -> tuple:
  """The page moves the engine compiles: a block's pages gathered and scattered (the block
  pools' alone), the host tier's copies when it has one, and the window group's page copy
  when the model has one, with its host copies' moves (``window_host_*``) when the tiers
  keep them (``host_window_pages_per_shard``). Returns ``(host pool or None, [Lowerable,
  ...])``."""
  engine, tiers = dict(cfg["engine"]), dict(cfg.get("tiers", {}))
  shards = mesh.shape[cache_cfg.data_axis]
  num_arrays = sum(pages_lib.pool_layers(p) for p in block_pools)
  ranks = pages_lib.pool_ranks(block_pools)
  host_pages = int(tiers.get("host_pages_per_shard", 0) or 0)
  moved = buckets.transfer_pages(engine["prefill_chunk_pages"])
  ids = row(shards, moved)
  stack_shape = (num_arrays, cache_cfg.num_kv_heads, shards * moved, cache_cfg.page_size,
                 cache_cfg.head_dim)
  bits = pages_lib.bits_dtype(cache_cfg.jnp_dtype)
  stack = _sds(mesh, stack_shape, bits, pages_lib.stacked_spec(cache_cfg))
  out = [Lowerable(f"gather_stacked[pages={moved}]",
                   pages_lib.gather_stacked_fn(mesh, cache_cfg, ranks),
                   (tuple(block_pools), ids)),
         Lowerable(f"scatter_stacked[pages={moved}]",
                   pages_lib.scatter_stacked_fn(mesh, cache_cfg, ranks),
                   (tuple(block_pools), ids, stack))]
  window_pools = [p for p in pools if all(p is not b for b in block_pools)]
  if window_pools:
    slots = row(shards, 8)
    out.append(Lowerable("copy_window_pages[slots=8]",
                         pages_lib.copy_pages_fn(mesh, cache_cfg,
                                                 pages_lib.pool_ranks(window_pools)),
                         (tuple(window_pools), slots, slots)))
    window_host = int(tiers.get("host_window_pages_per_shard", 0) or 0)
    if window_host:  # (a store and a load of a window's blocks; their landing scatters)
      kind = tiers.get("host_memory_kind", "pinned_host")
      _, moves = _host_moves(mesh, cache_cfg, kind, window_pools, shards, window_host,
                             moved, name="window_host")
      out += [m for m in moves if not m.name.startswith("window_host_store_stack")]
  host_pool = None
  if host_pages:
    kind = tiers.get("host_memory_kind", "pinned_host")
    host_pool, moves = _host_moves(mesh, cache_cfg, kind, block_pools, shards, host_pages,
                                   moved)
    out += moves
  return host_pool, out


def engine_functions(cfg: Mapping, tgt: Target, *, impl: str | None = None,
                     num_layers: int | None = None, model_cfg=None
                     ) -> tuple[AbstractMesh, list[Lowerable]]:
  """Every function the engine compiles for ``cfg`` on its mesh of ``tgt`` devices.

  ``impl``: the attention implementation (default: the config's); ``num_layers``: fewer
  layers than the config's (layers are identical, so two lower what thirty-two do, and a
  kernel's lowering, which runs once per layer, stays quick); ``model_cfg``: a model
  config (``LlamaConfig`` or ``Gemma3Config``, e.g. ``GEMMA3_270M``) in place of the
  config's model section, whose shapes and dtype the cache then takes (the cache section
  gives the budgets). Steps are lowered at the largest row bucket and at the narrowest and
  widest page tables; the prefill step at every width the engine runs; streaming at one
  chunk of cold pages.
  """
  from jaxkv.config import model_shapes
  from jaxkv.tools import builder  # the builder imports the engine: not at module load
  from jaxkv.worker import runner as runner_lib
  from jaxkv.planning.plan import padding_inputs, plan
  cache_cfg = builder.cache_config(cfg)
  if model_cfg is None:
    model_cfg = builder.model_config(cfg)
  else:
    shapes = model_shapes(model_cfg)
    shapes.pop("model_name")
    cache_cfg = dataclasses.replace(cache_cfg, **shapes)
  if num_layers is not None:
    model_cfg = dataclasses.replace(model_cfg, num_layers=num_layers)
  if impl is not None:
    cache_cfg = dataclasses.replace(cache_cfg, attention_impl=impl)
  engine = dict(cfg["engine"])
  mesh_cfg = dict(cfg["mesh"])
  mesh = abstract_mesh(tgt, (mesh_cfg["data"], mesh_cfg["model"]),
                       (cache_cfg.data_axis, cache_cfg.model_axis))
  pages_lib.validate_mesh(mesh, cache_cfg)
  graphdef, pools, pool_def, weights, weight_def, block_pools = _abstract_model(
      model_cfg, cache_cfg, mesh)
  steps = runner_lib.Steps(graphdef, pool_def, weight_def, mesh, cache_cfg)
  shards = mesh.shape[cache_cfg.data_axis]
  rows = buckets.pow2_at_least(engine["max_seqs_per_shard"]) * shards
  row = lambda *shape, dtype=jnp.int32: _sds(mesh, shape, dtype,
                                             pages_lib.batch_spec(cache_cfg, len(shape)))
  sampling = lambda n: jax.tree.map(lambda x: row(*x.shape, dtype=x.dtype),
                                    runner_lib.RowSampling.greedy(n))
  max_len = cache_cfg.max_pages_per_seq * cache_cfg.page_size
  widths = buckets.table_widths(max_len, cache_cfg)
  chunk_tokens = engine["prefill_chunk_pages"] * cache_cfg.page_size
  out = []

  # A model with a window group (Gemma 3's local layers) takes the window pool's page
  # table beside the block table: the steps get the pair.
  windows = cache_cfg.has_windows
  table = lambda n, width: (row(n, width), row(n, width)) if windows else row(n, width)

  def decode(name, n, width, stream=None):
    out.append(Lowerable(name, steps.decode, (pools, weights, row(n), table(n, width),
                                              row(n, 1), row(n), sampling(n), stream)))

  def prefill(name, n, width, tokens, stream=None):
    out.append(Lowerable(name, steps.prefill, (
        pools, weights, row(n, tokens), row(n), table(n, width), row(n, tokens), row(n),
        row(n), row(n, dtype=bool), sampling(n), stream)))

  for width in sorted({widths[0], widths[-1]}):
    decode(f"decode[rows={rows},table={width}]", rows, width)
  for tokens in buckets.prefill_widths(chunk_tokens, cache_cfg.page_size):
    prefill(f"prefill[rows={rows},table={widths[-1]},tokens={tokens}]", rows, widths[-1],
            tokens)

  tiers = dict(cfg.get("tiers", {}))
  host_pages = int(tiers.get("host_pages_per_shard", 0) or 0)
  host_pool, moves = _page_moves(cfg, cache_cfg, mesh, pools, block_pools, row)
  out += moves
  if host_pages:  # (a window group's layers read their ring: only the global ones stream)
    chunk = StreamConfig().chunk_pages
    stream = kvnnx.StreamBatch(
        block_valid=row(shards, widths[-1], dtype=bool), host_pool=host_pool,
        cold_slots=row(shards, chunk), cold_first=row(shards), cold_count=row(shards),
        pages_per_chunk=chunk)
    decode(f"decode_streamed[table={widths[-1]},cold={chunk}]", shards, widths[-1], stream)
    prefill(f"prefill_streamed[table={widths[-1]},cold={chunk},tokens={chunk_tokens}]",
            shards, widths[-1], chunk_tokens, stream)

  page_blocks = buckets.plan_rows(cache_cfg.max_pages_per_seq)
  inputs = padding_inputs(buckets.MIN_PLAN_ROWS, page_blocks, shards,
                                   page_size=cache_cfg.page_size, chunk_tokens=chunk_tokens)
  abstract = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  costs = CostArrays(latency_s=jax.ShapeDtypeStruct((len(LINKS),), jnp.float32),
                     bytes_per_s=jax.ShapeDtypeStruct((len(LINKS),), jnp.float32),
                     prefill=jax.ShapeDtypeStruct((3,), jnp.float32),
                     overlap=jax.ShapeDtypeStruct((), jnp.float32))
  out.append(Lowerable(f"plan[requests={buckets.MIN_PLAN_ROWS},blocks={page_blocks}]",
                       plan, (jax.tree.map(abstract, inputs), costs)))
  return mesh, out
