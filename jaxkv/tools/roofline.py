"""Roofline: the least time a decode step and a prefill chunk can take on one device,
from the model's shapes and the device's peak rates alone.

A step reads bytes from HBM (the weights, the KV it attends over) and does arithmetic (the
matmuls, attention). A device that moves at most ``hbm_bytes_per_s`` and computes at most
``peak_flops_per_s`` needs at least ``max(bytes / hbm_bytes_per_s, flops / peak_flops_per_s)``
for it; the larger term is the step's *bound*, ``"memory"`` or ``"compute"``. A decode
step (one token per sequence) reads every weight for a handful of tokens: memory-bound. A
prefill chunk reads them once for hundreds of tokens: compute-bound once the chunk passes
the device's ridge point (peak FLOP/s over HBM bytes/s, about 200 FLOPs per byte on an
H200). The figures come from the shapes, not from a compiled module, so they exist before
any device run does; the first run on the hardware is compared against them.

Scope: ONE device of a data shard. The ``mesh.model`` devices of a shard split the model
tensor-parallel the way ``jaxkv.models.from_pretrained`` places a checkpoint
(``jaxkv.models.hf.partition_spec``): q/k/v, gate, up and the output head by columns, o and
down by rows, a dimension the degree does not divide left whole; the embedding table and
the norms replicated. Each device runs the whole step on its share, all at once, so one
device's time is the step's time. (Random weights built without a mesh are replicated
instead: such a run reads ``mesh.model`` times the weight bytes counted here.)

What is counted, per step on that device:
- weight bytes: every weight read once. The embedding lookup reads only the rows of the
  step's tokens; the output head reads its whole ``vocab x hidden`` share (a tied head
  reads the whole replicated table).
- KV bytes: the step writes its tokens' K and V into their pages, then attends over the
  pages: it reads ``context + new`` tokens of K and V per sequence and layer (its own kv
  heads: ``num_kv_heads / mesh.model``) and writes ``new`` tokens.
- FLOPs: 2 per multiply-add. Matmuls: ``2 x matmul weights x tokens`` (norm scales and
  biases are not matmul weights; the lookup is not arithmetic). Attention: scores and the
  weighted sum, ``4 x layers x q heads x head_dim`` per (query, key) pair, causal: the
  i-th new token of a sequence sees ``context + i + 1`` keys.
Not counted: activations and logits (small beside weights and KV at these shapes, and
fused by XLA), the all-reduces over the model axis after the o and down projections,
launch and host overheads, and the masked work of a kernel that computes whole tiles. The
prediction is therefore a floor: a real step is slower, and how much slower is what the
first device run measures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from jaxkv.config import CacheConfig, EngineConfig
from jaxkv.errors import InputError
from jaxkv.models.llama import LlamaConfig

# Bytes per element of the dtypes a model or cache may use (jaxkv.config.SUPPORTED_DTYPES).
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# The keys of a config's ``hardware`` section the roofline needs (per device), with what
# each means; ``host_link_gb_per_s`` (and ``host_link_latency_ms``) are used when present.
HARDWARE_KEYS = {"hbm_gb_per_s": "HBM bandwidth in GB/s",
                 "peak_tflops": "dense bf16 peak in TFLOP/s"}

DEFAULT_CONTEXT_TOKENS = 4096


def _itemsize(dtype: str, what: str) -> int:
  if dtype not in DTYPE_BYTES:
    raise InputError(f"{what}={dtype!r} must be one of {tuple(DTYPE_BYTES)}.")
  return DTYPE_BYTES[dtype]


def _is_number(v) -> bool:
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def _split(n: int, degree: int) -> int:
  """One device's share of a dimension of ``n`` split over ``degree`` devices; a dimension
  the degree does not divide stays whole (``jaxkv.models.hf.partition_spec``'s rule)."""
  return n // degree if n % degree == 0 else n


# ---- hardware ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
  """One device's peak rates, as a datasheet gives them (a real step reaches less).

  ``host_link_bytes_per_s``: the host link the config's planner uses (0: not given);
  ``host_link_latency_s``: its latency per transfer."""

  hbm_bytes_per_s: float
  peak_flops_per_s: float
  host_link_bytes_per_s: float = 0.0
  host_link_latency_s: float = 0.0

  def __post_init__(self):
    for name in ("hbm_bytes_per_s", "peak_flops_per_s"):
      v = getattr(self, name)
      if not (_is_number(v) and v > 0):
        raise InputError(f"Hardware.{name}={v!r} must be a number > 0 (one device's peak).")
    for name in ("host_link_bytes_per_s", "host_link_latency_s"):
      v = getattr(self, name)
      if not (_is_number(v) and v >= 0):
        raise InputError(f"Hardware.{name}={v!r} must be a number >= 0 (0: not given).")

  @property
  def ridge_flops_per_byte(self) -> float:
    """Arithmetic intensity above which a step is compute-bound on this device."""
    return self.peak_flops_per_s / self.hbm_bytes_per_s

  def host_link_s(self, nbytes: float) -> float | None:
    """Seconds to move ``nbytes`` over the host link (latency + bytes / rate), or None
    when the config gives no host link."""
    if not self.host_link_bytes_per_s:
      return None
    return self.host_link_latency_s + nbytes / self.host_link_bytes_per_s

  @staticmethod
  def from_config(cfg: Mapping) -> "Hardware":
    """The ``hardware`` section of a config (configs/*.py), in bytes/s and FLOP/s."""
    missing = missing_hardware(cfg)
    if missing:
      raise InputError(missing_message(cfg, missing))
    hw = cfg["hardware"]
    for key in HARDWARE_KEYS:
      v = hw[key]
      if not (_is_number(v) and v > 0):
        raise InputError(f"hardware.{key}={v!r} must be a number > 0: one device's "
                         f"{HARDWARE_KEYS[key]}.")
    return Hardware(hbm_bytes_per_s=float(hw["hbm_gb_per_s"]) * 1e9,
                    peak_flops_per_s=float(hw["peak_tflops"]) * 1e12,
                    host_link_bytes_per_s=float(hw.get("host_link_gb_per_s", 0.0)) * 1e9,
                    host_link_latency_s=float(hw.get("host_link_latency_ms", 0.0)) / 1e3)


def missing_hardware(cfg: Mapping) -> list[str]:
  """The ``hardware.*`` keys the roofline needs that ``cfg`` lacks ([] when it has them)."""
  hw = cfg.get("hardware", None) if hasattr(cfg, "get") else None
  return [f"hardware.{k}" for k in HARDWARE_KEYS if hw is None or k not in hw]


def missing_message(cfg: Mapping, missing: list[str]) -> str:
  """What to add to ``cfg`` for its roofline, naming the ``missing`` keys."""
  name = cfg.get("name", "this config") if hasattr(cfg, "get") else "this config"
  wanted = " and ".join(f"{k} ({v})" for k, v in HARDWARE_KEYS.items())
  return (f"config {name} has no {' or '.join(missing)}; for a roofline, give its hardware "
          f"section one device's {wanted}, as configs/llama3_8b_h200.py does.")


# ---- parameters --------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamCounts:
  """Parameters of a Llama-family model (``jaxkv.models.Llama``), whole and on one device
  of a ``model_parallel``-way tensor-parallel group.

  ``matmul_per_device``: weights that multiply every token (q/k/v/o, the gated MLP's three
  matrices, the output head). ``embedding_per_device``: the input embedding table when it
  is separate from the output head (a lookup reads only the rows it needs); 0 when tied.
  The rest of ``per_device`` is norm scales and biases."""

  total: int
  per_device: int
  matmul_per_device: int
  embedding_per_device: int
  model_parallel: int


def param_counts(model: LlamaConfig, model_parallel: int = 1) -> ParamCounts:
  """Counts ``jaxkv.models.Llama``'s parameters from its shapes (see the module docstring
  for how a device's share is split)."""
  if not isinstance(model_parallel, int) or isinstance(model_parallel, bool) or (
      model_parallel < 1):
    raise InputError(f"model_parallel={model_parallel!r} must be an integer >= 1 (the mesh's "
                     "model axis size).")
  tp = model_parallel
  h, layers, vocab = model.hidden_size, model.num_layers, model.vocab_size
  q, kv, mlp = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.mlp_dim
  # Per layer: q, k, v [h, q|kv|kv] by columns; o [q, h] by rows; gate, up [h, mlp] by
  # columns; down [mlp, h] by rows.
  matmul = h * q + 2 * h * kv + q * h + 3 * h * mlp
  matmul_dev = (h * _split(q, tp) + 2 * h * _split(kv, tp) + _split(q, tp) * h
                + 2 * h * _split(mlp, tp) + _split(mlp, tp) * h)
  # Two RMSNorm scales (replicated); q/k/v biases split with their columns; an o bias
  # is replicated (it is added after the rows' partial products are summed).
  other = 2 * h + (q + 2 * kv if model.qkv_bias else 0) + (h if model.out_bias else 0)
  other_dev = (2 * h + (_split(q, tp) + 2 * _split(kv, tp) if model.qkv_bias else 0)
               + (h if model.out_bias else 0))
  table = vocab * h
  if model.tie_embeddings:  # one replicated table: looked up, then multiplied as the head
    head, head_dev, embed_dev = 0, table, 0
  else:
    head, head_dev, embed_dev = h * vocab, h * _split(vocab, tp), table
  final_norm = h
  return ParamCounts(
      total=layers * (matmul + other) + final_norm + table + head,
      per_device=layers * (matmul_dev + other_dev) + final_norm + head_dev + embed_dev,
      matmul_per_device=layers * matmul_dev + head_dev,
      embedding_per_device=embed_dev, model_parallel=tp)


# ---- one step ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class StepCost:
  """One step's traffic and arithmetic on one device, and the time the roofline gives it:
  ``seqs`` sequences each holding ``context_tokens`` cached tokens, each given
  ``new_tokens`` (1: a decode step; a chunk's width: a prefill chunk)."""

  seqs: int
  new_tokens: int  # per sequence
  context_tokens: int  # per sequence, cached before the step
  weight_bytes: int
  kv_read_bytes: int
  kv_write_bytes: int
  matmul_flops: int
  attention_flops: int
  memory_s: float  # bytes / HBM bandwidth
  compute_s: float  # flops / peak FLOP/s

  @property
  def tokens(self) -> int:
    return self.seqs * self.new_tokens

  @property
  def bytes(self) -> int:
    return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

  @property
  def flops(self) -> int:
    return self.matmul_flops + self.attention_flops

  @property
  def seconds(self) -> float:
    """The roofline's time: the slower of moving the bytes and doing the arithmetic."""
    return max(self.memory_s, self.compute_s)

  @property
  def bound(self) -> str:
    """``"memory"`` or ``"compute"``: which term sets ``seconds``."""
    return "memory" if self.memory_s >= self.compute_s else "compute"

  @property
  def tokens_per_s(self) -> float:
    """New tokens per second of a data shard running such steps back to back."""
    return self.tokens / self.seconds


def step_cost(model: LlamaConfig, hardware: Hardware, *, kv_dtype: str, model_parallel: int,
              seqs: int, new_tokens: int, context_tokens: int) -> StepCost:
  """The roofline of one step on one device (what is counted: the module docstring)."""
  for name, v, low in (("seqs", seqs, 1), ("new_tokens", new_tokens, 1),
                       ("context_tokens", context_tokens, 0)):
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
      raise InputError(f"roofline {name}={v!r} must be an integer >= {low}.")
  tp = model_parallel
  if model.num_kv_heads % tp:
    raise InputError(f"num_kv_heads={model.num_kv_heads} must be divisible by the model axis "
                     f"size {tp}: the cache splits whole kv heads over it.")
  counts = param_counts(model, tp)
  weight_itemsize = _itemsize(model.dtype, "model.dtype")
  kv_itemsize = _itemsize(kv_dtype, "cache.dtype")
  tokens = seqs * new_tokens
  rows = min(tokens, model.vocab_size) if counts.embedding_per_device else 0
  weight_params = counts.per_device - counts.embedding_per_device + rows * model.hidden_size
  # K and V of one token, all layers, this device's kv heads.
  kv_token_bytes = (2 * model.num_layers * (model.num_kv_heads // tp) * model.head_dim
                    * kv_itemsize)
  # Causal (query, key) pairs of one sequence: new token i sees context + i + 1 keys.
  pairs = new_tokens * context_tokens + new_tokens * (new_tokens + 1) // 2
  q_heads = _split(model.num_heads * model.head_dim, tp) // model.head_dim
  weight_bytes = weight_params * weight_itemsize
  kv_read = seqs * (context_tokens + new_tokens) * kv_token_bytes
  kv_write = tokens * kv_token_bytes
  matmul_flops = 2 * counts.matmul_per_device * tokens
  attention_flops = 4 * model.num_layers * q_heads * model.head_dim * pairs * seqs
  return StepCost(
      seqs=seqs, new_tokens=new_tokens, context_tokens=context_tokens,
      weight_bytes=weight_bytes, kv_read_bytes=kv_read, kv_write_bytes=kv_write,
      matmul_flops=matmul_flops, attention_flops=attention_flops,
      memory_s=(weight_bytes + kv_read + kv_write) / hardware.hbm_bytes_per_s,
      compute_s=(matmul_flops + attention_flops) / hardware.peak_flops_per_s)


# ---- a config's decode step and prefill chunk ---------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Roofline:
  """A config's roofline: its decode step and prefill chunk on one device, and what a
  block costs over the host link for reference."""

  name: str  # the config's
  hardware: Hardware
  params: ParamCounts
  data_shards: int  # mesh.data: shards running such steps side by side
  decode: StepCost  # engine.max_seqs_per_shard sequences, one new token each
  prefill: StepCost  # one sequence, engine.prefill_chunk_pages x page_size new tokens
  block_bytes: int  # one block, every kv head: what a fetch moves over the host link
  block_host_link_s: float | None  # None: the config gives no host link
  prefill_kv_host_link_s: float | None  # fetching the KV the prefill chunk computes

  def as_json(self) -> dict:
    """The figures as flat ``roofline_*`` keys (what ``launch/plan.py --json_out`` writes)."""
    out = {"roofline_scope": "one device", "roofline_config": self.name,
           "roofline_model_parallel": self.params.model_parallel,
           "roofline_data_shards": self.data_shards,
           "roofline_hbm_bytes_per_s": self.hardware.hbm_bytes_per_s,
           "roofline_peak_flops_per_s": self.hardware.peak_flops_per_s,
           "roofline_params": self.params.total,
           "roofline_params_per_device": self.params.per_device,
           "roofline_context_tokens": self.decode.context_tokens,
           "roofline_block_bytes": self.block_bytes,
           "roofline_block_host_link_s": self.block_host_link_s,
           "roofline_prefill_kv_host_link_s": self.prefill_kv_host_link_s}
    for key, step, seconds_key in (("decode", self.decode, "roofline_decode_step_s"),
                                   ("prefill", self.prefill, "roofline_prefill_chunk_s")):
      out[seconds_key] = step.seconds
      out.update({
          f"roofline_{key}_bytes": step.bytes, f"roofline_{key}_flops": step.flops,
          f"roofline_{key}_bound": step.bound, f"roofline_{key}_memory_s": step.memory_s,
          f"roofline_{key}_compute_s": step.compute_s,
          f"roofline_{key}_weight_bytes": step.weight_bytes,
          f"roofline_{key}_kv_read_bytes": step.kv_read_bytes,
          f"roofline_{key}_kv_write_bytes": step.kv_write_bytes,
          f"roofline_{key}_matmul_flops": step.matmul_flops,
          f"roofline_{key}_attention_flops": step.attention_flops,
          f"roofline_{key}_seqs": step.seqs, f"roofline_{key}_tokens": step.tokens,
          f"roofline_{key}_tokens_per_s": step.tokens_per_s})
    return out


def predict(cfg: Mapping, *, context_tokens: int = DEFAULT_CONTEXT_TOKENS) -> Roofline:
  """The roofline of config ``cfg`` (configs/*.py, after any ``builder.use_model_dir``):
  a decode step of ``engine.max_seqs_per_shard`` sequences that each hold
  ``context_tokens`` tokens, and a prefill chunk of ``engine.prefill_chunk_pages`` pages
  of one sequence after ``context_tokens`` cached ones, on one device of the mesh, with
  the peaks of the config's ``hardware`` section."""
  from jaxkv.tools import builder  # the config-to-dataclass readers (builder imports the engine)
  if not isinstance(context_tokens, int) or isinstance(context_tokens, bool) or (
      context_tokens < 1):
    raise InputError(f"roofline context_tokens={context_tokens!r} must be an integer >= 1: a "
                     "decode step extends sequences that already hold tokens; give e.g. "
                     f"{DEFAULT_CONTEXT_TOKENS} (launch/plan.py --roofline_context).")
  hardware = Hardware.from_config(cfg)
  model = builder.model_config(cfg)
  cache: CacheConfig = builder.cache_config(cfg)
  engine = EngineConfig(**cfg["engine"]) if "engine" in cfg else EngineConfig()
  mesh = cfg.get("mesh", None) or {}
  data, tp = mesh.get("data", 1), mesh.get("model", 1)
  chunk = engine.prefill_chunk_pages * cache.page_size
  if context_tokens + chunk > cache.max_seq_len:
    raise InputError(f"roofline context_tokens={context_tokens} plus a {chunk}-token prefill "
                     f"chunk exceeds the cache's max_seq_len={cache.max_seq_len} "
                     "(max_pages_per_seq x page_size); give a context of at most "
                     f"{cache.max_seq_len - chunk}.")
  seqs = engine.max_seqs_per_shard
  pages = seqs * -(-(context_tokens + 1) // cache.page_size)
  if pages > cache.pages_per_shard:
    raise InputError(f"roofline decode batch: {seqs} sequences of {context_tokens + 1} tokens "
                     f"need {pages} pages, but a shard has pages_per_shard="
                     f"{cache.pages_per_shard}; give a context of at most "
                     f"{cache.pages_per_shard // seqs * cache.page_size - 1} tokens.")
  kw = dict(kv_dtype=cache.dtype, model_parallel=tp)
  decode = step_cost(model, hardware, seqs=seqs, new_tokens=1, context_tokens=context_tokens,
                     **kw)
  prefill = step_cost(model, hardware, seqs=1, new_tokens=chunk, context_tokens=context_tokens,
                      **kw)
  chunk_kv_bytes = cache.page_bytes * engine.prefill_chunk_pages
  return Roofline(
      name=str(cfg.get("name", "")), hardware=hardware, params=param_counts(model, tp),
      data_shards=data, decode=decode, prefill=prefill, block_bytes=cache.page_bytes,
      block_host_link_s=hardware.host_link_s(cache.page_bytes),
      prefill_kv_host_link_s=hardware.host_link_s(chunk_kv_bytes))

