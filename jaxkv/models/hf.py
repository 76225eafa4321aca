"""Load a Hugging Face checkpoint directory of the Llama family into ``jaxkv.models.Llama``.

    model = jaxkv.models.from_pretrained("/models/Meta-Llama-3-8B-Instruct", mesh=mesh)

Reads ``config.json`` and the weights (``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists). Architectures: ``LlamaForCausalLM`` (Llama 2, 3,
3.1, 3.2: ``rope_scaling`` of type ``llama3``, ``head_dim``, tied or untied embeddings,
``attention_bias``), ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (q/k/v biases). The
checkpoint's q/k projections are used as they are: Hugging Face stores them for the
rotate-half RoPE that ``jaxkv.models.llama.apply_rope`` applies.

Memory: the model is built abstract (no random initialisation), then each tensor is read
from its file (memory-mapped), converted, placed on the mesh (replicated, as the engine
runs the weights) and dropped from host memory before the next: the host holds about one
tensor at a time, never the checkpoint.

Anything the loader does not support (an architecture, an activation, a RoPE scaling type,
a missing or misshapen tensor) is refused with one line naming it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv.config import SUPPORTED_DTYPES
from jaxkv.models.llama import Llama, LlamaConfig, RopeScaling

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
  """A checkpoint directory jaxkv cannot load as it is (the message says what and why)."""


def read_config(path: str) -> dict:
  """``config.json`` of the checkpoint directory ``path``, as a dict."""
  file = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise CheckpointError(f"model directory {path!r} does not exist; pass a Hugging Face "
                          "checkpoint directory (config.json + *.safetensors).")
  if not os.path.exists(file):
    raise CheckpointError(f"{file} is missing; {path!r} is not a Hugging Face checkpoint "
                          "directory.")
  with open(file) as f:
    try:
      return json.load(f)
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{file} is not valid JSON ({e}).") from None


def llama_config(hf: dict, *, dtype: str | None = None) -> LlamaConfig:
  """The ``LlamaConfig`` of a Hugging Face ``config.json`` (as a dict)."""
  archs = hf.get("architectures") or []
  arch = archs[0] if archs else None
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"architecture {arch!r} is not supported; jaxkv loads "
                          f"{', '.join(ARCHITECTURES)}.")
  act = hf.get("hidden_act", "silu")
  if act != "silu":
    raise CheckpointError(f"hidden_act={act!r} is not supported ({arch} with silu only).")
  if hf.get("mlp_bias"):
    raise CheckpointError("mlp_bias=true is not supported (the MLP has no biases).")
  heads = hf["num_attention_heads"]
  rope = hf.get("rope_scaling")
  scaling = None
  if rope:
    kind = rope.get("rope_type", rope.get("type"))
    if kind == "llama3":
      scaling = RopeScaling(
          factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
          high_freq_factor=float(rope["high_freq_factor"]),
          original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    elif kind != "default":
      raise CheckpointError(f"rope_scaling type {kind!r} is not supported (llama3 only).")
  window = hf.get("sliding_window") or 0
  if arch == "Qwen2ForCausalLM" and not hf.get("use_sliding_window", False):
    window = 0
  if dtype is None:
    dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype not in SUPPORTED_DTYPES:
      dtype = "float32"
  qwen = arch == "Qwen2ForCausalLM"
  return LlamaConfig(
      vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
      num_layers=hf["num_hidden_layers"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
      mlp_dim=hf["intermediate_size"], rope_theta=float(hf.get("rope_theta", 10000.0)),
      norm_eps=float(hf.get("rms_norm_eps", 1e-6)), dtype=dtype, rope_scaling=scaling,
      qkv_bias=qwen or bool(hf.get("attention_bias", False)),
      out_bias=(not qwen) and bool(hf.get("attention_bias", False)),
      tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
      sliding_window=int(window))


def _tensor_map(cfg: LlamaConfig) -> Iterator[tuple[tuple, str, bool]]:
  """(path in the NNX model, name in the checkpoint, transposed) for every parameter."""
  yield ("embed", "embedding"), "model.embed_tokens.weight", False
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    yield ("layers", i, "attn_norm", "scale"), pre + "input_layernorm.weight", False
    yield ("layers", i, "mlp_norm", "scale"), pre + "post_attention_layernorm.weight", False
    for p in ("q", "k", "v", "o"):
      yield ("layers", i, "attn", f"{p}_proj", "kernel"), f"{pre}self_attn.{p}_proj.weight", True
      if (cfg.qkv_bias and p != "o") or (cfg.out_bias and p == "o"):
        yield ("layers", i, "attn", f"{p}_proj", "bias"), f"{pre}self_attn.{p}_proj.bias", False
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
      yield ("layers", i, "mlp", ours, "kernel"), f"{pre}mlp.{theirs}.weight", True
  yield ("norm", "scale"), "model.norm.weight", False
  if not cfg.tie_embeddings:
    yield ("lm_head", "kernel"), "lm_head.weight", True


def _weight_files(path: str) -> dict[str, str]:
  """Tensor name -> the safetensors file holding it."""
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index} has no weight_map.")
    return {name: os.path.join(path, file) for name, file in weight_map.items()}
  single = os.path.join(path, _SINGLE)
  if not os.path.exists(single):
    raise CheckpointError(f"{path!r} has neither {_SINGLE} nor {_INDEX}; jaxkv reads "
                          "safetensors weights only.")
  from safetensors import safe_open
  with safe_open(single, framework="np") as f:
    return {name: single for name in f.keys()}


def from_pretrained(path: str, *, dtype: str | None = None, mesh: Mesh | None = None) -> Llama:
  """A ``Llama`` holding the checkpoint in directory ``path``.

  ``dtype``: the weights' and activations' dtype (default: the checkpoint's
  ``torch_dtype``). ``mesh``: where the weights go (replicated over it; default: the
  first device). Weights are read tensor by tensor (see the module docstring)."""
  from safetensors import safe_open
  cfg = llama_config(read_config(path), dtype=dtype)
  files = _weight_files(path)
  sharding = (NamedSharding(mesh, P()) if mesh is not None
              else jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  flat = dict(nnx.to_flat_state(params))
  wanted = list(_tensor_map(cfg))
  missing = [name for _, name, _ in wanted if name not in files]
  if missing:
    raise CheckpointError(f"tensor {missing[0]!r} is missing from {path!r}"
                          + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
                          + f"; a {cfg.num_layers}-layer checkpoint of this architecture needs it.")
  unknown = set(flat) - {p for p, _, _ in wanted}
  if unknown:  # the model has a parameter this loader does not fill: a bug here
    raise AssertionError(f"parameters without a checkpoint tensor: {sorted(unknown)}")
  dt = jnp.dtype(cfg.dtype)
  handles: dict[str, object] = {}
  try:
    for nnx_path, name, transposed in wanted:
      file = files[name]
      if file not in handles:
        handles[file] = safe_open(file, framework="np").__enter__()
      value = handles[file].get_tensor(name)
      if transposed:
        value = value.T
      want = flat[nnx_path].get_value().shape
      if tuple(value.shape) != tuple(want):
        raise CheckpointError(
            f"tensor {name!r} has shape {tuple(value.shape if not transposed else value.T.shape)}"
            f"; config.json implies {tuple(want if not transposed else want[::-1])}.")
      flat[nnx_path].set_value(jax.device_put(np.asarray(value, dt), sharding))
      del value
  finally:
    for h in handles.values():
      h.__exit__(None, None, None)
  placed = nnx.from_flat_state(flat)
  rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest)
  return nnx.merge(graphdef, placed, rest)
