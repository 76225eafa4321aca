"""Load a Hugging Face checkpoint directory of the Llama family into ``jaxkv.models.Llama``,
or of Gemma 3 into ``jaxkv.models.Gemma3``.

    model = jaxkv.models.from_pretrained("/models/Meta-Llama-3-8B-Instruct", mesh=mesh)

A GGUF file (or a directory holding one, without config.json) loads the same way:
``jaxkv.models.gguf`` presents it as such a checkpoint, its tensors dequantized as read.

Reads ``config.json`` and the weights (``model.safetensors``, or the shards that
``model.safetensors.index.json`` lists). Architectures: ``LlamaForCausalLM`` (Llama 2, 3,
3.1, 3.2: ``rope_scaling`` of type ``llama3``, ``head_dim``, tied or untied embeddings,
``attention_bias``), ``MistralForCausalLM`` and ``Qwen2ForCausalLM`` (q/k/v biases), and
``Gemma3ForCausalLM`` (``gemma3_text``: Gemma 3's text decoder, ``gemma3_config``). The
architecture picks the family (``FAMILIES``: its config reader, model class and tensor
names). The checkpoint's q/k projections are used as they are: Hugging Face stores them
for the rotate-half RoPE that ``jaxkv.models.llama.apply_rope`` applies.

config.json: every field that changes what the model computes is read or refused, in
each spelling transformers writes: ``rope_theta`` top-level or in ``rope_parameters``
(transformers >= 5), RoPE scaling in ``rope_scaling`` or ``rope_parameters``, its type
as ``rope_type`` or the legacy ``type`` (``SUPPORTED_ROPE_TYPES``: default, linear,
llama3; any other refused by name), ``torch_dtype`` or ``dtype``, ``hidden_act`` or
``hidden_activation``, ``sliding_window`` or ``layer_types``. Two spellings present and
disagreeing are refused with both values, never resolved by a default; a count that is
not a positive integer, heads that do not divide, a theta that is not a positive number
are refused by name. The tensors are checked against config.json (names and shapes)
before the model is built, and a tensor the model would not read (a bias config.json
does not declare, a layer past ``num_hidden_layers``) is refused too.

Placement (``mesh`` given): tensor-parallel over the mesh's model axis, the axis that
already splits the KV heads. q/k/v, gate and up projections are split by output columns
(whole heads: a device computes the heads whose pages it holds), o and down projections by
input rows (XLA sums the partial products), the output head by vocabulary; embedding and
norms are replicated, and every tensor is replicated over the data axis. A dimension the
axis does not divide stays whole. Without a mesh: the first device.

Memory: the model is built abstract (no random initialisation); each device's part of a
tensor is read from its memory-mapped file as a slice, converted and placed, so the host
holds at most one tensor's part at a time, never the checkpoint.

Anything the loader does not support (an architecture, an activation, a RoPE scaling type,
a missing or misshapen tensor) is refused with one line naming it. So is what a checkpoint
from elsewhere could use against the host: a safetensors header longer than
``MAX_HEADER_BYTES`` (it is read into memory whole), a header entry whose shape and offsets
disagree (counted in Python integers: ``[2**62, 4]`` does not wrap to 0 bytes), JSON
nested deeper than the parser follows, and an index naming a shard outside
the checkpoint directory (an absolute path, ``..``, or a symlink that leads out of it;
symlinks into a Hugging Face hub cache's ``blobs/`` are how that cache stores files).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv.config import SUPPORTED_DTYPES
from jaxkv.errors import InputError, InvariantError
from jaxkv.models import gguf
from jaxkv.models.gemma3 import LAYER_TYPES as GEMMA3_LAYER_TYPES, Gemma3, Gemma3Config
from jaxkv.models.llama import LinearRopeScaling, Llama, LlamaConfig, RopeScaling

_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"
# The safetensors library's own cap (MAX_HEADER_SIZE): a real header is kilobytes to a few
# megabytes; a larger length is a corrupt or hostile file, not a checkpoint.
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(InputError):
  """A checkpoint directory jaxkv cannot load as it is (the message says what and why)."""


def _load_json(file: str, what: str):
  """The JSON value of ``file``; anything that is not JSON, or nests past what the parser
  follows (a file of ``[`` x 100k), refused in one line."""
  try:
    with open(file, "rb") as f:
      return json.loads(f.read())
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f"{file} is not valid JSON ({e}); {what}.") from None
  except RecursionError:
    raise CheckpointError(f"{file} nests JSON deeper than the parser follows; {what}.") from None


def read_config(path: str | os.PathLike) -> dict:
  """``config.json`` of the checkpoint directory ``path``, as a dict; of a GGUF checkpoint
  (``jaxkv.models.gguf``), the one its metadata describes."""
  path = os.fspath(path)
  gguf_file = gguf.find(path)
  if gguf_file is not None:
    return gguf.checkpoint(gguf_file).config
  file = os.path.join(path, "config.json")
  if not os.path.isdir(path):
    raise CheckpointError(f"model directory {path!r} does not exist; pass a Hugging Face "
                          "checkpoint directory (config.json + *.safetensors) or a .gguf "
                          "file.")
  if not os.path.exists(file):
    raise CheckpointError(f"{file} is missing; {path!r} is not a Hugging Face checkpoint "
                          "directory.")
  config = _load_json(file, "fix it or download the checkpoint again")
  if not isinstance(config, dict):
    raise CheckpointError(f"{file} holds a JSON {type(config).__name__}, not an object of "
                          "settings; fix it or download the checkpoint again.")
  return config


# ---- config.json: every field that changes the numbers is read or refused ----------------
# A field may be written in more than one place (transformers >= 5 writes ``rope_parameters``
# holding ``rope_theta``; older versions a top-level ``rope_theta`` and ``rope_scaling``).
# Each spelling is read; two that disagree are refused with both values, never resolved.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_PARAMETERS = {"default": (), "linear": ("factor",),
                    "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings")}
_ACTIVATIONS = ("silu", "swish")  # one function: transformers' ACT2FN maps both to SiLU
_LAYER_TYPES = ("full_attention", "sliding_attention")
_FIX = "fix config.json or download the checkpoint again"


def _show(value) -> str:
  text = repr(value)
  return text if len(text) <= 80 else text[:77] + "..."


def _refuse(what: str, fix: str = _FIX):
  raise CheckpointError(f"config.json {what}; {fix}.")


def _typed(name: str, value, kind: str):
  """``value`` of field ``name`` if it is a ``kind`` (``count``: a positive integer;
  ``number``: a positive finite number, as a float; ``bool``; ``str``), else refused."""
  number = isinstance(value, (int, float)) and not isinstance(value, bool)
  ok, rule = {
      "count": (number and isinstance(value, int) and value > 0, "a positive integer"),
      "number": (number and math.isfinite(value) and value > 0, "a positive number"),
      "bool": (isinstance(value, bool), "true or false"),
      "str": (isinstance(value, str), "a string"),
  }[kind]
  if not ok:
    _refuse(f"{name}={_show(value)} must be {rule}")
  return float(value) if kind == "number" else value


def _field(hf: dict, name: str, kind: str, default=None):
  """Field ``name`` checked as a ``kind`` (see ``_typed``); ``default`` when it is absent
  or null, refused as missing when there is no default."""
  value = hf.get(name)
  if value is None:
    if default is None:
      _refuse(f"has no {name}")
    return default
  return _typed(name, value, kind)


def _spelled(spellings: list[tuple[str, object]]) -> tuple[str, object] | None:
  """The one ``(name, value)`` among the spellings of a setting that are present (not
  null); None if none is. Two present that disagree are refused, naming both."""
  present = [(name, value) for name, value in spellings if value is not None]
  for name, value in present[1:]:
    first_name, first = present[0]
    if value != first or isinstance(value, bool) != isinstance(first, bool):
      _refuse(f"{first_name}={_show(first)} and {name}={_show(value)} disagree",
              "keep one of them (the value the checkpoint was trained with)")
  return present[0] if present else None


def _rope(hf: dict):
  """``(theta, scaling)`` of the RoPE settings, from ``rope_theta``, ``rope_scaling`` and
  ``rope_parameters`` (and the legacy ``type`` for ``rope_type``)."""
  params, names = {}, {}  # parameter -> value, and where config.json has it
  for table in ("rope_scaling", "rope_parameters"):
    values = hf.get(table)
    if values is None:
      continue
    if not isinstance(values, dict):
      _refuse(f"{table}={_show(values)} must be an object of RoPE parameters or null")
    for key, value in values.items():
      if isinstance(value, dict):
        _refuse(f"{table}.{key} holds RoPE parameters per layer type, which jaxkv does not "
                "compute", f"jaxkv loads one RoPE for every layer; {_FIX}")
      if value is None:
        continue
      param = "rope_type" if key == "type" else key
      found = _spelled([(names.get(param), params.get(param)), (f"{table}.{key}", value)])
      params[param], names[param] = found[1], found[0]
  theta = _spelled([("rope_theta", hf.get("rope_theta")),
                    (names.get("rope_theta"), params.pop("rope_theta", None))])
  theta = 10000.0 if theta is None else _typed(theta[0], theta[1], "number")
  partial = _spelled([("partial_rotary_factor", hf.get("partial_rotary_factor")),
                      (names.get("partial_rotary_factor"),
                       params.pop("partial_rotary_factor", None))])
  if partial is not None and partial[1] != 1:
    _refuse(f"{partial[0]}={_show(partial[1])} is not supported (RoPE over a part of each "
            "head)", "jaxkv rotates whole heads: partial_rotary_factor must be 1")
  kind = params.pop("rope_type", "default")
  where = names.get("rope_type", "rope_scaling").split(".")[0]
  if kind not in SUPPORTED_ROPE_TYPES:
    _refuse(f"{where} type {_show(kind)} is not supported (jaxkv computes RoPE of type "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})", "use a checkpoint of a supported type")
  wanted = _ROPE_PARAMETERS[kind]
  if kind == "llama3":  # transformers also reads a top-level one
    found = _spelled([(names.get("original_max_position_embeddings"),
                       params.pop("original_max_position_embeddings", None)),
                      ("original_max_position_embeddings",
                       hf.get("original_max_position_embeddings"))])
    if found is not None:
      params["original_max_position_embeddings"] = found[1]
      names["original_max_position_embeddings"] = found[0]
  for param in params:
    if param not in wanted:
      _refuse(f"{names[param]}={_show(params[param])} is not a parameter of RoPE type "
              f"{kind!r} (jaxkv reads {', '.join(wanted) or 'none'} for it)",
              f"remove it or {_FIX}")
  for param in wanted:
    if param not in params:
      _refuse(f"{where} of type {kind!r} has no {param}")
  if kind == "default":
    return theta, None
  factor = _typed(names["factor"], params["factor"], "number")
  if kind == "linear":
    return theta, LinearRopeScaling(factor=factor)
  low = _typed(names["low_freq_factor"], params["low_freq_factor"], "number")
  high = _typed(names["high_freq_factor"], params["high_freq_factor"], "number")
  if not high > low:
    _refuse(f"{names['high_freq_factor']}={high} must be greater than "
            f"{names['low_freq_factor']}={low} (llama3 RoPE)")
  old = _typed(names["original_max_position_embeddings"],
               params["original_max_position_embeddings"], "count")
  return theta, RopeScaling(factor=factor, low_freq_factor=low, high_freq_factor=high,
                            original_max_position_embeddings=old)


def _sliding_window(hf: dict, arch: str, num_layers: int) -> int:
  """How far back the checkpoint's own attention reaches (0: no limit): ``sliding_window``
  (for Qwen2 only with ``use_sliding_window``), or where ``layer_types`` names sliding
  layers; the two ways agreeing when both are written."""
  window = hf.get("sliding_window")
  window = 0 if window is None or window == 0 else _typed("sliding_window", window, "count")
  if arch == "Qwen2ForCausalLM" and not _field(hf, "use_sliding_window", "bool", False):
    window = 0
  types = hf.get("layer_types")
  if types is None:
    return window
  if (not isinstance(types, list) or len(types) != num_layers
      or any(t not in _LAYER_TYPES for t in types)):
    _refuse(f"layer_types={_show(types)} must list one of {', '.join(_LAYER_TYPES)} for "
            f"each of the num_hidden_layers={num_layers} layers")
  sliding = "sliding_attention" in types
  if sliding != bool(window):
    _refuse(f"layer_types={_show(types)} and sliding_window={hf.get('sliding_window')!r}"
            + (f" with use_sliding_window={hf.get('use_sliding_window')!r}"
               if arch == "Qwen2ForCausalLM" else "") + " disagree",
            "keep the settings the checkpoint was trained with")
  return window


def architecture(hf: dict) -> str:
  """The architecture a ``config.json`` (as a dict) names, refused unless jaxkv loads it
  (``ARCHITECTURES``) and its weights are unquantized."""
  if not isinstance(hf, dict):
    raise CheckpointError(f"config.json holds {type(hf).__name__}, not an object; {_FIX}.")
  archs = hf.get("architectures")
  if archs is not None and (not isinstance(archs, list)
                            or not all(isinstance(a, str) for a in archs)):
    _refuse(f"architectures={_show(archs)} must be a list of class names")
  arch = archs[0] if archs else None
  if arch not in ARCHITECTURES:
    raise CheckpointError(f"architecture {arch!r} is not supported; jaxkv loads "
                          f"{', '.join(ARCHITECTURES)}.")
  if hf.get("quantization_config") is not None:
    _refuse("has a quantization_config: quantized weights are not supported",
            "load an unquantized checkpoint (bfloat16, float16 or float32)")
  return arch


def model_config(hf: dict, *, dtype: str | None = None):
  """The model config (``LlamaConfig``, ``Gemma3Config``, ...) of a Hugging Face
  ``config.json`` (as a dict), by its architecture (``FAMILIES``)."""
  return FAMILIES[architecture(hf)].config(hf, dtype=dtype)


def _shapes(hf: dict) -> dict:
  """The sizes every family reads the same way, checked: vocab, hidden, layers, heads,
  kv heads (dividing the heads), head_dim (even) and the MLP's width."""
  vocab = _field(hf, "vocab_size", "count")
  hidden = _field(hf, "hidden_size", "count")
  num_layers = _field(hf, "num_hidden_layers", "count")
  heads = _field(hf, "num_attention_heads", "count")
  kv_heads = _field(hf, "num_key_value_heads", "count", heads)
  if heads % kv_heads:
    _refuse(f"num_attention_heads={heads} must be divisible by num_key_value_heads="
            f"{kv_heads} (grouped-query attention)")
  head_dim = hf.get("head_dim")
  if head_dim is None and hidden % heads:
    _refuse(f"has no head_dim and hidden_size={hidden} is not divisible by "
            f"num_attention_heads={heads}")
  head_dim = _field(hf, "head_dim", "count", hidden // heads)
  if head_dim % 2:
    _refuse(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
  _field(hf, "max_position_embeddings", "count", 1)  # checked; no supported RoPE reads it
  return dict(vocab_size=vocab, hidden_size=hidden, num_layers=num_layers, num_heads=heads,
              num_kv_heads=kv_heads, head_dim=head_dim,
              mlp_dim=_field(hf, "intermediate_size", "count"))


def llama_config(hf: dict, *, dtype: str | None = None) -> LlamaConfig:
  """The ``LlamaConfig`` of a Hugging Face ``config.json`` (as a dict). Every field that
  changes what the model computes is read or refused (``CheckpointError``)."""
  arch = architecture(hf)
  if FAMILIES[arch].model is not Llama:
    raise CheckpointError(f"architecture {arch!r} is not of the Llama family; "
                          "jaxkv.models.hf.model_config reads its config.json.")
  act = _spelled([("hidden_act", hf.get("hidden_act")),
                  ("hidden_activation", hf.get("hidden_activation"))]) or ("hidden_act", "silu")
  if act[1] not in _ACTIVATIONS:
    raise CheckpointError(f"{act[0]}={_show(act[1])} is not supported ({arch} with silu "
                          "only).")
  if _field(hf, "mlp_bias", "bool", False):
    raise CheckpointError("mlp_bias=true is not supported (the MLP has no biases).")
  attention_bias = _field(hf, "attention_bias", "bool", False)
  if attention_bias and arch != "LlamaForCausalLM":
    _refuse(f"attention_bias=true is not part of {arch} (transformers ignores it: "
            + ("q/k/v always have biases, the output projection none)" if
               arch == "Qwen2ForCausalLM" else "its projections have no biases)"),
            "remove it, or use LlamaForCausalLM if the checkpoint has those biases")
  shapes = _shapes(hf)
  theta, scaling = _rope(hf)
  stored = checkpoint_dtype(hf)
  qwen = arch == "Qwen2ForCausalLM"
  return LlamaConfig(
      **shapes, rope_theta=theta, norm_eps=_field(hf, "rms_norm_eps", "number", 1e-6),
      dtype=stored if dtype is None else dtype, rope_scaling=scaling,
      qkv_bias=qwen or attention_bias, out_bias=(not qwen) and attention_bias,
      tie_embeddings=_field(hf, "tie_word_embeddings", "bool", False),
      sliding_window=_sliding_window(hf, arch, shapes["num_layers"]))


def _gemma3_rope(hf: dict) -> tuple[tuple, float]:
  """((theta, scaling) of Gemma 3's global layers, theta of its local ones). transformers
  < 5 writes ``rope_theta``, ``rope_scaling`` and ``rope_local_base_freq``; >= 5
  ``rope_parameters`` per layer type (``full_attention``, ``sliding_attention``)."""
  params = hf.get("rope_parameters")
  if isinstance(params, dict) and set(params) & set(GEMMA3_LAYER_TYPES):
    if set(params) - set(GEMMA3_LAYER_TYPES):
      _refuse(f"rope_parameters={_show(params)} mixes RoPE parameters per layer type with "
              f"others; give one set for each of {', '.join(GEMMA3_LAYER_TYPES)}")
    glob = _rope({"rope_theta": hf.get("rope_theta"), "rope_scaling": hf.get("rope_scaling"),
                  "rope_parameters": params.get("full_attention")})
    local = _rope({"rope_theta": hf.get("rope_local_base_freq"),
                   "rope_parameters": params.get("sliding_attention")})
  else:
    glob = _rope(hf)
    local = (_field(hf, "rope_local_base_freq", "number", 10000.0), None)
  if local[1] is not None:
    _refuse(f"scales the local layers' RoPE ({local[1]}), which Gemma 3 does not",
            "keep scaling for the full_attention layers only")
  if glob[1] is not None and not isinstance(glob[1], LinearRopeScaling):
    _refuse(f"scales Gemma 3's RoPE by {glob[1]}; jaxkv's Gemma 3 reads linear scaling only",
            "use a checkpoint with linear or no RoPE scaling")
  return glob, local[0]


def _gemma3_layer_types(hf: dict, num_layers: int) -> tuple[str, ...]:
  """Each layer's attention: ``layer_types``, else every ``sliding_window_pattern``-th
  layer global (6 when unset, as published)."""
  types = hf.get("layer_types")
  if types is None:
    every = _spelled([("sliding_window_pattern", hf.get("sliding_window_pattern")),
                      ("_sliding_window_pattern", hf.get("_sliding_window_pattern"))])
    every = _typed(*every, "count") if every else 6
    return tuple(GEMMA3_LAYER_TYPES[(i + 1) % every == 0] for i in range(num_layers))
  if (not isinstance(types, list) or len(types) != num_layers
      or any(t not in GEMMA3_LAYER_TYPES for t in types)):
    _refuse(f"layer_types={_show(types)} must list one of {', '.join(GEMMA3_LAYER_TYPES)} "
            f"for each of the num_hidden_layers={num_layers} layers")
  return tuple(types)


def gemma3_config(hf: dict, *, dtype: str | None = None) -> Gemma3Config:
  """The ``Gemma3Config`` of a Hugging Face ``config.json`` (``Gemma3ForCausalLM``, model
  type ``gemma3_text``). Every field that changes what the model computes is read or
  refused (``CheckpointError``): logit soft-capping and bidirectional attention (not
  Gemma 3's text decoder), another activation, biases."""
  arch = architecture(hf)
  if FAMILIES[arch].model is not Gemma3:
    raise CheckpointError(f"architecture {arch!r} is not Gemma 3; "
                          "jaxkv.models.hf.model_config reads its config.json.")
  act = _spelled([("hidden_activation", hf.get("hidden_activation")),
                  ("hidden_act", hf.get("hidden_act"))]) or ("hidden_activation",
                                                             "gelu_pytorch_tanh")
  if act[1] != "gelu_pytorch_tanh":
    raise CheckpointError(f"{act[0]}={_show(act[1])} is not supported ({arch} with "
                          "gelu_pytorch_tanh only).")
  for name in ("attn_logit_softcapping", "final_logit_softcapping"):
    if hf.get(name) is not None:
      _refuse(f"{name}={_show(hf[name])} is not supported (jaxkv's Gemma 3 caps no logits)",
              "use a checkpoint without soft-capping")
  if _field(hf, "use_bidirectional_attention", "bool", False):
    _refuse("use_bidirectional_attention=true is not supported (jaxkv's attention is causal)",
            "use a decoder checkpoint")
  for name in ("attention_bias", "mlp_bias"):
    if _field(hf, name, "bool", False):
      _refuse(f"{name}=true is not supported (Gemma 3's projections have no biases)")
  shapes = _shapes(hf)
  (theta, scaling), local = _gemma3_rope(hf)
  stored = checkpoint_dtype(hf)
  return Gemma3Config(
      **shapes, rope_theta=theta, rope_local_theta=local, rope_scaling=scaling,
      norm_eps=_field(hf, "rms_norm_eps", "number", 1e-6),
      query_pre_attn_scalar=_field(hf, "query_pre_attn_scalar", "number",
                                   float(shapes["head_dim"])),
      sliding_window=_field(hf, "sliding_window", "count"),
      layer_types=_gemma3_layer_types(hf, shapes["num_layers"]),
      dtype=stored if dtype is None else dtype,
      tie_embeddings=_field(hf, "tie_word_embeddings", "bool", True))


def checkpoint_dtype(hf: dict) -> str:
  """The dtype a checkpoint says it stores (``torch_dtype``, or ``dtype`` as transformers
  >= 5 writes it; both written must agree); float32 when it names none or one jaxkv does
  not compute in (the tensors' own dtypes are read from the files either way)."""
  found = _spelled([("torch_dtype", hf.get("torch_dtype")), ("dtype", hf.get("dtype"))])
  if found is None:
    return "float32"
  dtype = _typed(*found, "str")
  return dtype if dtype in SUPPORTED_DTYPES else "float32"


def platform_dtype(stored: str, platform: str) -> tuple[str, str]:
  """The dtype a checkpoint storing ``stored`` computes in on ``platform`` ("cpu", "gpu",
  "tpu") when nobody asked for one, and why, as words for the log line at load.

  On CPU: float32. XLA:CPU runs bfloat16 (and float16) dots several times slower than
  float32, though they read half the bytes: ``launch/bench.py --suite=weights`` on a
  2-core host with a Llama-3.2-1B-shaped bfloat16 checkpoint measured decode at 3.46
  tok/s in float32, 0.44 tok/s (0.13x) in bfloat16 as stored, and 0.54 tok/s (0.16x)
  with the weights kept in bfloat16 and computed in float32 — XLA:CPU converts each
  weight to float32 in a pass of its own before the dot, every step, so that reads the
  bfloat16 bytes and then writes and reads float32 ones. So the weights are converted
  once, at load (twice the memory of the stored checkpoint).
  On GPU and TPU: the checkpoint's own dtype (bfloat16 for nearly every one), which their
  matrix units run at full rate."""
  if platform == "cpu" and stored != "float32":
    return "float32", f"platform cpu default; checkpoint stores {stored}"
  if platform == "cpu":
    return "float32", "platform cpu default, as the checkpoint stores it"
  return stored, f"platform {platform} default: the checkpoint's own"


def _projections(cfg, pre: str, i: int) -> Iterator[tuple]:
  """The attention's and the MLP's matrices of layer ``i`` (and q/k/v/o biases where the
  config has them), as ``_tensor_map`` lists them."""
  h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
  qkv_bias, out_bias = getattr(cfg, "qkv_bias", False), getattr(cfg, "out_bias", False)
  for p, (rows, cols) in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q))):
    yield (("layers", i, "attn", f"{p}_proj", "kernel"), f"{pre}self_attn.{p}_proj.weight",
           True, (rows, cols))
    if (qkv_bias and p != "o") or (out_bias and p == "o"):
      yield (("layers", i, "attn", f"{p}_proj", "bias"), f"{pre}self_attn.{p}_proj.bias",
             False, (rows,))
  for ours, theirs, shape in (("gate", "gate_proj", (cfg.mlp_dim, h)),
                              ("up", "up_proj", (cfg.mlp_dim, h)),
                              ("down", "down_proj", (h, cfg.mlp_dim))):
    yield ("layers", i, "mlp", ours, "kernel"), f"{pre}mlp.{theirs}.weight", True, shape


def _ends(cfg) -> tuple[list, list]:
  """The embedding (first), and the final norm and an untied output head (last)."""
  h = cfg.hidden_size
  last = [(("norm", "scale"), "model.norm.weight", False, (h,))]
  if not cfg.tie_embeddings:
    last.append((("lm_head", "kernel"), "lm_head.weight", True, (cfg.vocab_size, h)))
  return [(("embed", "embedding"), "model.embed_tokens.weight", False, (cfg.vocab_size, h))], last


def _tensor_map(cfg: LlamaConfig) -> Iterator[tuple[tuple, str, bool, tuple[int, ...]]]:
  """(path in the NNX model, name in the checkpoint, transposed, shape in the checkpoint)
  for every parameter of a ``Llama``, in checkpoint order: linear layers are stored
  ``[out, in]``."""
  first, last = _ends(cfg)
  yield from first
  h = cfg.hidden_size
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    yield ("layers", i, "attn_norm", "scale"), pre + "input_layernorm.weight", False, (h,)
    yield ("layers", i, "mlp_norm", "scale"), pre + "post_attention_layernorm.weight", False, (h,)
    yield from _projections(cfg, pre, i)
  yield from last


_GEMMA3_NORMS = (("input_norm", "input_layernorm"), ("post_attn_norm", "post_attention_layernorm"),
                 ("pre_mlp_norm", "pre_feedforward_layernorm"),
                 ("post_mlp_norm", "post_feedforward_layernorm"))


def _gemma3_tensor_map(cfg: Gemma3Config) -> Iterator[tuple[tuple, str, bool, tuple[int, ...]]]:
  """``_tensor_map`` of a ``Gemma3``: four norms per layer and the q/k heads' norms."""
  first, last = _ends(cfg)
  yield from first
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    for ours, theirs in _GEMMA3_NORMS:
      yield ("layers", i, ours, "scale"), f"{pre}{theirs}.weight", False, (cfg.hidden_size,)
    for p in ("q", "k"):
      yield (("layers", i, "attn", f"{p}_norm", "scale"), f"{pre}self_attn.{p}_norm.weight",
             False, (cfg.head_dim,))
    yield from _projections(cfg, pre, i)
  yield from last


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family the loader builds: how its ``config.json`` is read (``config(hf,
  dtype=...)``), its model class (``model(cfg, rngs=...)``) and its parameters' names and
  shapes in a checkpoint (``tensors(cfg)``, as ``_tensor_map``)."""
  config: Callable
  model: Callable
  tensors: Callable


_LLAMA = Family(llama_config, Llama, _tensor_map)
# The architecture named first in config.json picks the family.
FAMILIES = {"LlamaForCausalLM": _LLAMA, "MistralForCausalLM": _LLAMA, "Qwen2ForCausalLM": _LLAMA,
            "Gemma3ForCausalLM": Family(gemma3_config, Gemma3, _gemma3_tensor_map)}
ARCHITECTURES = tuple(FAMILIES)


# Tensors a checkpoint may hold that the model rightly does not read: RoPE's frequencies
# as old conversions saved them (computed from config.json instead).
_UNREAD_SUFFIXES = (".rotary_emb.inv_freq",)

_DTYPES = {"BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16),
           "F32": np.dtype(np.float32), "F64": np.dtype(np.float64)}
# Bytes per element of every safetensors dtype, read or not (to check a header's offsets).
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4,
               "U64": 8, "I64": 8, "F64": 8, "C64": 8}


class SafetensorsFile:
  """A safetensors file's tensors as read-only views of one memory map: nothing is read
  until a slice is copied, and a device's slice is copied once, straight to the device.
  (The format: an 8-byte little-endian header length, a JSON header of name -> dtype,
  shape, data offsets, then the data.) Every entry of the header is checked when the file
  is opened: its byte count (Python integers: a shape cannot wrap around) is what its
  offsets hold, within the file."""

  def __init__(self, file: str):
    self.file = file
    size = os.path.getsize(file)
    with open(file, "rb") as f:
      head = f.read(8)
      n = int.from_bytes(head, "little") if len(head) == 8 else -1
      if n > MAX_HEADER_BYTES:  # checked before the file size: nothing of it is read
        raise CheckpointError(
            f"{file} declares a safetensors header of {n:,} bytes; jaxkv reads headers of at "
            f"most {MAX_HEADER_BYTES:,} bytes (as the safetensors library does), so the file "
            "is corrupt or not a safetensors file: download or convert it again.")
      if not 0 < n <= size - 8:
        raise CheckpointError(f"{file} is not a safetensors file (header length {n}, file "
                              f"size {size}): download or convert it again.")
      try:
        self.header = json.loads(f.read(n))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} has an unreadable safetensors header ({e}).") from None
      except RecursionError:
        raise CheckpointError(f"{file} has a safetensors header nesting JSON deeper than the "
                              "parser follows: download or convert it again.") from None
    if not isinstance(self.header, dict):
      raise CheckpointError(f"{file} has a safetensors header that is not a JSON object.")
    self.header.pop("__metadata__", None)
    for name, entry in self.header.items():
      self._check(name, entry, size - 8 - n)
    self._data = np.memmap(file, np.uint8, "r", offset=8 + n) if size > 8 + n else None

  def _check(self, name: str, entry, data_bytes: int) -> None:
    """Refuses header entry ``name`` unless it is a tensor of a known dtype whose bytes
    (shape x item size, exact) are its offsets' span, inside the ``data_bytes`` after the
    header."""
    def is_int(v):
      return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    fields = entry if isinstance(entry, dict) else {}
    dtype, shape, offsets = fields.get("dtype"), fields.get("shape"), fields.get("data_offsets")
    if (dtype not in _ITEM_BYTES or not isinstance(shape, list)
        or not all(is_int(d) for d in shape) or not isinstance(offsets, list)
        or len(offsets) != 2 or not all(is_int(o) for o in offsets)):
      raise CheckpointError(
          f"tensor {name!r} in {self.file} has header entry {_show(entry)}; a safetensors "
          f"entry is {{dtype: one of {', '.join(_ITEM_BYTES)}; shape: [non-negative ints]; "
          "data_offsets: [start, end]}: download or convert it again.")
    nbytes = _ITEM_BYTES[dtype] * math.prod(shape)  # Python ints: never wraps
    start, stop = offsets
    if stop - start != nbytes or not start <= stop <= data_bytes:
      raise CheckpointError(
          f"tensor {name!r} in {self.file} has shape {_show(shape)} {dtype} ({nbytes:,} bytes) "
          f"but offsets {start}..{stop}, and the file holds {data_bytes:,} bytes of data "
          "(truncated?): download or convert it again.")

  def keys(self):
    return self.header.keys()

  def shape(self, name: str) -> tuple:
    return tuple(self.header[name]["shape"])

  def view(self, name: str) -> np.ndarray:
    entry = self.header[name]
    dt = _DTYPES.get(entry["dtype"])
    if dt is None:
      raise CheckpointError(f"tensor {name!r} in {self.file} has dtype {entry['dtype']!r}; "
                            f"jaxkv reads {', '.join(_DTYPES)}.")
    start, stop = entry["data_offsets"]  # checked when the file was opened
    if self._data is None:  # a file of empty tensors only
      return np.zeros(entry["shape"], dt)
    return self._data[start:stop].view(dt).reshape(entry["shape"])


def _weight_files(path: str, handles: dict[str, SafetensorsFile]) -> dict[str, str]:
  """Tensor name -> the safetensors file holding it (a file opened to list it is kept in
  ``handles``)."""
  index = os.path.join(path, _INDEX)
  if os.path.exists(index):
    weight_map = _load_json(index, "fix it or download the checkpoint again")
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict):
      raise CheckpointError(f"{index} has no weight_map.")
    roots, shards = _shard_roots(path), {}
    for name, file in weight_map.items():  # each file checked once, named by its first tensor
      if not isinstance(file, str) or file not in shards:
        shards[file] = _shard_file(path, roots, index, name, file)
    return {name: shards[file] for name, file in weight_map.items()}
  single = os.path.join(path, _SINGLE)
  if not os.path.exists(single):
    raise CheckpointError(f"{path!r} has neither {_SINGLE} nor {_INDEX}; jaxkv reads "
                          "safetensors weights only.")
  handles[single] = SafetensorsFile(single)
  return {name: single for name in handles[single].keys()}


def _checked_tensors(path: str, cfg, files: dict[str, str],
                     handles: dict[str, SafetensorsFile], family: Family) -> list[tuple]:
  """``family.tensors(cfg)``, once every tensor it names is in the checkpoint with the shape
  config.json implies and the checkpoint holds no tensor the model would not read. Checked
  before the model is built: a config.json claiming a million layers is refused at its
  first missing tensor, not after building a million layers."""
  wanted = []
  for entry in family.tensors(cfg):
    _, name, _, shape = entry
    file = files.get(name)
    if file is None:
      layers = {n.split(".")[2] for n in files if n.startswith("model.layers.")}
      raise CheckpointError(
          f"tensor {name!r} is missing from {path!r}; a {cfg.num_layers}-layer checkpoint of "
          f"this architecture needs it (the checkpoint holds tensors of {len(layers)} layers): "
          "fix config.json or download the checkpoint again.")
    if file not in handles:
      if not os.path.exists(file):
        raise CheckpointError(f"{file} (listed for tensor {name!r}) does not exist.")
      handles[file] = SafetensorsFile(file)
    if name not in handles[file].header:
      raise CheckpointError(f"tensor {name!r} is not in {file}, where the index puts it.")
    theirs = handles[file].shape(name)
    if theirs != shape:
      raise CheckpointError(f"tensor {name!r} has shape {theirs}; config.json implies {shape}.")
    wanted.append(entry)
  read = {name for _, name, _, _ in wanted}
  unread = sorted(n for n in files if n not in read and not n.endswith(_UNREAD_SUFFIXES)
                  and not (cfg.tie_embeddings and n == "lm_head.weight"))
  if unread:  # a bias, a norm or a layer config.json does not mention: other numbers
    raise CheckpointError(
        f"tensor {unread[0]!r} in {path!r} is not part of the model config.json describes"
        + (f" (nor {len(unread) - 1} more)" if len(unread) > 1 else "")
        + "; a checkpoint holding it computes something else: fix config.json (e.g. "
        "attention_bias, mlp_bias, num_hidden_layers) or download the checkpoint again.")
  return wanted


def _shard_roots(path: str) -> tuple[str, ...]:
  """Where the shards of checkpoint directory ``path`` may really live: the directory, and
  for a snapshot of a Hugging Face hub cache (``models--org--name/snapshots/<revision>``,
  whose files are symlinks to ``../../blobs/<hash>``) that repository's ``blobs``."""
  root = os.path.realpath(path)
  parent = os.path.dirname(root)
  if os.path.basename(parent) == "snapshots":
    return root, os.path.join(os.path.dirname(parent), "blobs")
  return (root,)


def _shard_file(path: str, roots: tuple[str, ...], index: str, name: str, file) -> str:
  """The path of shard ``file`` (listed for tensor ``name``), refused unless it names a
  file inside the checkpoint directory."""
  if not isinstance(file, str) or not file:
    problem = "not a file name"
  elif os.path.isabs(file) or os.path.splitdrive(file)[0]:
    problem = "an absolute path"
  elif ".." in file.replace("\\", "/").split("/"):
    problem = "a path through '..'"
  else:
    real = os.path.realpath(os.path.join(path, file))
    if any(real != root and os.path.commonpath([real, root]) == root for root in roots):
      return os.path.join(path, file)
    problem = f"it resolves to {real!r}, outside the checkpoint directory"
  raise CheckpointError(
      f"{index} lists {file!r} for tensor {name!r}: {problem}; shards must be files inside "
      f"{path!r}: fix the weight_map or download the checkpoint again.")


def partition_spec(nnx_path: tuple, shape: tuple, model_axis: str, axis_size: int) -> P:
  """Where a parameter of ``Llama`` (or ``Gemma3``: the same module names) lives on a mesh whose model axis has ``axis_size``
  devices (see the module docstring)."""
  leaf, owner = nnx_path[-1], nnx_path[-2]
  if owner in ("q_proj", "k_proj", "v_proj", "gate", "up", "lm_head"):
    dim = len(shape) - 1  # output columns (a q/k/v bias has only those)
  elif owner in ("o_proj", "down") and leaf == "kernel":
    dim = len(shape) - 2  # input rows (after a stack's leading layer axis)
  else:
    return P()
  if axis_size == 1 or shape[dim] % axis_size:
    return P()
  spec = [None] * len(shape)
  spec[dim] = model_axis
  return P(*spec)


def from_pretrained(path: str | os.PathLike, *, dtype: str | None = None, mesh: Mesh | None = None,
                    model_axis: str = "model", scan_layers: bool = True) -> nnx.Module:
  """The model holding the checkpoint in directory ``path`` (or GGUF file): a ``Llama``,
  or a ``Gemma3``, as its architecture says (``FAMILIES``).

  ``dtype``: the weights' and activations' dtype (default: the checkpoint's
  ``torch_dtype``; ``"auto"``: ``platform_dtype``'s choice for the platform of ``mesh``'s
  devices, or of the first device). ``mesh``: where the weights go, split over its
  ``model_axis`` (the ``CacheConfig.model_axis`` of the cache it will serve; default: the
  first device). ``scan_layers``: the layers' weights stacked and run under a scan (one
  layer compiled), or False: a Python loop of layer modules (``LlamaConfig.scan_layers``).
  Weights are read slice by slice (see the module docstring). ``path`` may be any
  path-like (a ``pathlib.Path``)."""
  path = os.fspath(path)
  hf = read_config(path)
  gguf_file = gguf.find(path)
  if dtype == "auto":
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    dtype, _ = platform_dtype(checkpoint_dtype(hf), device.platform)
  family = FAMILIES[architecture(hf)]
  cfg = dataclasses.replace(family.config(hf, dtype=dtype), scan_layers=scan_layers)
  handles: dict = {}  # file -> SafetensorsFile, or the GGUFCheckpoint
  if gguf_file is not None:
    handles[gguf_file] = gguf.checkpoint(gguf_file)
    files = {name: gguf_file for name in handles[gguf_file].keys()}
  else:
    files = _weight_files(path, handles)
  if mesh is not None and model_axis not in mesh.shape:
    raise CheckpointError(f"mesh axes {tuple(mesh.shape)} have no model_axis={model_axis!r}; "
                          "pass the axis the cache splits KV heads over.")
  wanted = _checked_tensors(path, cfg, files, handles, family)
  abstract = nnx.eval_shape(lambda: family.model(cfg, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
  flat = dict(nnx.to_flat_state(params))
  # A scanned model holds layer i's tensor at index i of one stacked parameter.
  groups: dict[tuple, list] = {}
  for nnx_path, name, transposed, shape in wanted:
    key = (nnx_path[:1] + nnx_path[2:] if cfg.scan_layers and nnx_path[0] == "layers"
           else nnx_path)
    groups.setdefault(key, []).append((name, transposed, shape))
  mapped = {}
  for key, entries in groups.items():
    _, transposed, shape = entries[0]
    shape = shape[::-1] if transposed else shape
    mapped[key] = (len(entries), *shape) if cfg.scan_layers and key[0] == "layers" else shape
  built = {p: tuple(v.get_value().shape) for p, v in flat.items()}
  if mapped != built:  # the model and this loader disagree on its parameters: a bug here
    raise InvariantError(
        f"parameters of {type(abstract).__name__} and its tensor map differ: "
        f"{sorted(set(mapped.items()) ^ set(built.items()), key=repr)[:4]}; the map "
        "must name every parameter of the model with its shape.")
  dt = jnp.dtype(cfg.dtype)
  for key, entries in groups.items():
    views = [functools.partial(handles[files[name]].view, name) for name, _, _ in entries]
    if cfg.scan_layers and key[0] == "layers":  # read one layer at a time
      placed = _place_stack(views, mapped[key], entries[0][1], dt, key, mesh, model_axis)
    else:
      placed = _place(views[0](), mapped[key], entries[0][1], dt, key, mesh, model_axis)
    flat[key].set_value(placed)
  handles.clear()  # the memory maps close with their last view
  placed = nnx.from_flat_state(flat)
  rest = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), rest)
  return nnx.merge(graphdef, placed, rest)


def _shardings(nnx_path: tuple, shape: tuple, transposed: bool, mesh: Mesh | None,
               model_axis: str):
  """(where a parameter of ``shape`` lives, where it is placed as stored): a linear layer's
  matrix is stored ``[out, in]`` and transposed on the devices."""
  if mesh is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding, sharding
  spec = partition_spec(nnx_path, shape, model_axis, mesh.shape[model_axis])
  sharding = NamedSharding(mesh, spec)
  spec = tuple(spec) + (None,) * (len(shape) - len(spec))
  return sharding, NamedSharding(mesh, P(*spec[::-1])) if transposed else sharding


def _place(tensor: np.ndarray, shape: tuple, transposed: bool, dt, nnx_path: tuple,
           mesh: Mesh | None, model_axis: str) -> jax.Array:
  """One parameter on its devices, each reading only its slice of the file. A linear
  layer's matrix is placed as stored ([out, in]) and transposed on the devices (XLA's
  transpose is many times faster than a strided copy on the host)."""
  sharding, stored_sharding = _shardings(nnx_path, shape, transposed, mesh, model_axis)
  parts: dict = {}  # devices holding the same slice (data-axis replicas) read it once

  def read(index: tuple) -> np.ndarray:
    key = tuple((i.start, i.stop) for i in index)
    if key not in parts:  # a view when the dtype is the file's: the device copy is the read
      parts[key] = np.asarray(tensor[index], dt)
    return parts[key]

  stored = shape[::-1] if transposed else shape
  array = jax.make_array_from_callback(stored, stored_sharding, read)
  parts.clear()
  if transposed:
    array = _transpose(stored_sharding, sharding)(array)
  return array


def _place_stack(layers: list, shape: tuple, transposed: bool, dt, nnx_path: tuple,
                 mesh: Mesh | None, model_axis: str) -> jax.Array:
  """A stacked parameter ``[layers, ...]`` of a scanned model: ``layers`` returns each
  layer's tensor when called (a GGUF tensor is dequantized then). The stack is made on the
  devices and each layer placed (as ``_place`` does) and written into it in turn, so at
  most one layer stands beside it, on the host or the devices."""
  sharding, _ = _shardings(nnx_path, shape, False, mesh, model_axis)
  stack = _zeros(sharding, shape, jnp.dtype(dt).name)()
  for i, layer in enumerate(layers):  # (a layer's sharding is the stack's after its axis)
    placed = _place(layer(), shape[1:], transposed, dt, nnx_path, mesh, model_axis)
    stack = _write_layer(sharding)(stack, placed, np.int32(i))
  return stack


@functools.lru_cache(maxsize=None)
def _zeros(sharding, shape: tuple, dtype: str):
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _write_layer(sharding):
  return jax.jit(lambda stack, x, i: jax.lax.dynamic_update_index_in_dim(stack, x, i, 0),
                 out_shardings=sharding, donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _transpose(in_sharding, out_sharding):
  return jax.jit(lambda x: x.T, in_shardings=in_sharding, out_shardings=out_sharding,
                 donate_argnums=0)
