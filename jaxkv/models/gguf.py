"""GGUF checkpoints (llama.cpp's and Ollama's format) of the Llama family and Gemma 3.

    model = jaxkv.models.from_pretrained("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = jaxkv.Tokenizer.from_dir("/models/SmolLM2-135M-Instruct.Q4_1.gguf")

One ``.gguf`` file holds what a Hugging Face directory spreads over several: the weights,
the model's hyperparameters as metadata (``llama.block_count``, ``llama.rope.freq_base``,
...), and the tokenizer (vocabulary, merges, token types, special ids, chat template: built by
``jaxkv.models.gguf_tokenizer``).
``GGUFCheckpoint`` presents the file as the Hugging Face loader (``jaxkv.models.hf``)
expects a checkpoint: ``config`` is the ``config.json`` the metadata describes (so every
check of that loader applies), and its tensors are read under Hugging Face's names and
orientation. What differs, and is undone here:
- names: ``blk.{i}.attn_q.weight`` is ``model.layers.{i}.self_attn.q_proj.weight``, ...;
- the Q and K projections' rows (architecture ``llama`` only): llama.cpp's converter
  reorders each head's rows from the rotate-half RoPE layout to interleaved pairs (row
  ``2j + half`` of a head was row ``half * head_dim / 2 + j``); they are put back, so
  ``apply_rope`` reads them as it reads a Hugging Face checkpoint. Gemma 3's are stored as
  Hugging Face has them (llama.cpp rotates its heads in halves, as Hugging Face does);
- Gemma 3's norms: the converter stores ``w + 1`` (llama.cpp multiplies by the weight);
  the 1 is taken off, so every norm weight means what Hugging Face's does (``1 + w``
  multiplies; exact in float32 for the file's values, which are bfloat16 numbers + 1);
- quantized types: each tensor is dequantized (the ``gguf`` package's own routines) to
  float32 when it is read, then converted to the compute dtype (``SUPPORTED_TYPES``;
  any other type is refused by name before anything is read).
The weights digest (``jaxkv.identity``) is computed from the model after loading, so it
covers the dequantized weights.

A path is a GGUF checkpoint when it is a ``.gguf`` file, or a directory without
``config.json`` that holds exactly one ``.gguf`` file.
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import struct

import ml_dtypes
import numpy as np

from jaxkv.errors import InputError

# Tensor types read (dequantized to float32 unless stored as a float type).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K",
                   "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Per layer: GGUF's name -> Hugging Face's (``model.layers.{i}.`` prefixed), by architecture.
_LLAMA_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3's four norms: llama.cpp's ``ffn_norm`` is the one before the MLP there.
_GEMMA3_LAYER = {
    **_LLAMA_LAYER,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_LAYER_NAMES = {"llama": _LLAMA_LAYER, "gemma3": _GEMMA3_LAYER}
ARCHITECTURES = tuple(_LAYER_NAMES)
_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight":
          "model.norm.weight", "output.weight": "lm_head.weight"}


class GGUFError(InputError):
  """A GGUF file jaxkv cannot load (the message says what and why)."""


def _gguf():
  try:
    import gguf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise GGUFError("reading a .gguf checkpoint needs the gguf package: pip install "
                    "'gguf>=0.17'.") from None
  return gguf


def find(path: str) -> str | None:
  """The GGUF file that ``path`` names (see the module docstring), or None when ``path`` is
  a Hugging Face checkpoint directory (or names nothing: that loader says what is missing)."""
  if os.path.isfile(path):
    return path if path.endswith(".gguf") else None
  if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
    return None
  files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
  if len(files) > 1:
    raise GGUFError(f"{path!r} holds {len(files)} GGUF files ({', '.join(files[:4])}); pass "
                    "the path of the one to load.")
  return os.path.join(path, files[0]) if files else None


def checkpoint(file: str) -> GGUFCheckpoint:
  """``GGUFCheckpoint(file)``, opened once while the file is unchanged (the config, the
  tokenizer and the weights all read it)."""
  st = os.stat(file)
  return _checkpoint(os.path.realpath(file), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _checkpoint(file: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
  del mtime_ns, size  # the cache's key
  return GGUFCheckpoint(file)


# ---- the file: a header of metadata and tensor descriptions, then aligned tensor data -----
# Every count and length is checked against the bytes that are left before it is used, so
# a corrupt or hostile file is refused in one line and never makes the reader allocate
# more than the file holds.
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
            10: "<u8", 11: "<i8", 12: "<f8"}
_STRUCT = {"<u1": "<B", "<i1": "<b", "<u2": "<H", "<i2": "<h", "<u4": "<I", "<i4": "<i",
           "<f4": "<f", "<u8": "<Q", "<i8": "<q", "<f8": "<d"}
_STRING, _ARRAY, _BOOL = 8, 9, 7
MAX_DIMS = 4


class Header:
  """The metadata (``fields``: key -> value; strings decoded, arrays as lists) and the
  tensors (``tensors``: name -> (GGML type number, shape as GGML lists it, byte offset)) of
  a GGUF file, read with bounds checks; ``data_start``: where tensor offsets count from."""

  def __init__(self, file: str):
    self.file = file
    self._pos = 0
    try:
      with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        self._buf = memoryview(mm)
        try:
          self._parse()
        finally:
          self._buf.release()
    except (ValueError, IndexError, UnicodeDecodeError, OverflowError) as e:
      raise GGUFError(f"{file} is not a GGUF file jaxkv can read ({e} at byte {self._pos}); "
                      "download or convert it again.") from None

  def _parse(self) -> None:
    if bytes(self._take(4)) != b"GGUF":
      raise ValueError("no GGUF magic")
    version = self._int("<u4")
    if version not in (2, 3):
      raise ValueError(f"GGUF version {version} (jaxkv reads 2 and 3)")
    num_tensors, num_fields = self._int("<u8"), self._int("<u8")
    self._bound(num_tensors, 24, "tensor count")
    self._bound(num_fields, 13, "metadata count")
    self.fields = {}
    for _ in range(num_fields):
      key = self._str()
      self.fields[key] = self._value(self._int("<u4"))
    self.tensors = {}
    for _ in range(num_tensors):
      name = self._str()
      dims = self._int("<u4")
      if not 1 <= dims <= MAX_DIMS:
        raise ValueError(f"tensor {name!r} has {dims} dimensions")
      shape = tuple(self._int("<u8") for _ in range(dims))
      kind, offset = self._int("<u4"), self._int("<u8")
      self.tensors[name] = (kind, shape, offset)
    align = self.fields.get("general.alignment", 32)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
      raise ValueError(f"general.alignment={align!r} is not a power of two")
    self.data_start = -(-self._pos // align) * align

  def _take(self, n: int) -> memoryview:
    if n > len(self._buf) - self._pos:
      raise ValueError(f"{n} bytes asked for, {len(self._buf) - self._pos} left")
    out = self._buf[self._pos:self._pos + n]
    self._pos += n
    return out

  def _int(self, fmt: str) -> int:
    code = _STRUCT[fmt]
    return struct.unpack(code, self._take(struct.calcsize(code)))[0]

  def _bound(self, count: int, item_bytes: int, what: str) -> None:
    if count * item_bytes > len(self._buf) - self._pos:
      raise ValueError(f"{what} {count} is more than the file holds")

  def _str(self) -> str:
    n = self._int("<u8")
    return bytes(self._take(n)).decode("utf-8")

  def _value(self, kind: int):
    if kind == _STRING:
      return self._str()
    if kind in _SCALARS:
      value = self._int(_SCALARS[kind])
      return bool(value) if kind == _BOOL else value
    if kind == _ARRAY:
      item, count = self._int("<u4"), self._int("<u8")
      if item == _STRING:
        self._bound(count, 8, "array length")
        return [self._str() for _ in range(count)]
      if item not in _SCALARS:
        raise ValueError(f"an array of value type {item}")
      dt = np.dtype(_SCALARS[item])
      self._bound(count, dt.itemsize, "array length")
      values = np.frombuffer(bytes(self._take(count * dt.itemsize)), dt)
      return values.astype(bool).tolist() if item == _BOOL else values.tolist()
    raise ValueError(f"metadata value type {kind}")


def field(header: Header, key: str, default=None):
  """The value of metadata ``key``, or ``default``."""
  return header.fields.get(key, default)


class GGUFCheckpoint:
  """A GGUF file as the Hugging Face loader reads a checkpoint: ``config`` (a
  ``config.json`` as a dict), and ``keys``/``shape``/``view``/``header`` by Hugging Face's
  tensor names (``view``: float32 for a quantized tensor, else the stored dtype; shapes
  ``[out, in]`` as torch stores them)."""

  def __init__(self, file: str):
    self.file = file
    self.meta = Header(file)
    arch = self.arch = field(self.meta, "general.architecture")
    if arch not in ARCHITECTURES:
      raise GGUFError(f"{file} holds a model of architecture {arch!r}; jaxkv loads GGUF "
                      f"architectures {', '.join(ARCHITECTURES)}.")
    gguf = _gguf()
    size = os.path.getsize(file)
    self._tensors = {}  # HF name -> (GGML type, numpy shape, first byte, bytes)
    for gguf_name, (kind, dims, offset) in self.meta.tensors.items():
      name = self._hf_name(arch, gguf_name)
      if name is None:
        raise GGUFError(f"tensor {gguf_name!r} of {file} is not part of a {arch} model jaxkv "
                        "knows (rope_freqs.weight: Llama 3.1's RoPE scaling is not read from "
                        "GGUF); it computes something else.")
      try:
        qtype = gguf.GGMLQuantizationType(kind)
      except ValueError:
        qtype = None
      type_name = qtype.name if qtype is not None else f"type {kind}"
      if type_name not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor {gguf_name!r} of {file} is stored as {type_name}; jaxkv "
                        f"dequantizes {', '.join(SUPPORTED_TYPES)}: convert the model to one "
                        "of them (llama.cpp's llama-quantize).")
      block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
      nbytes = math.prod(dims) // block * block_bytes  # Python ints: never wraps
      start = self.meta.data_start + offset
      if 0 in dims or dims[0] % block or start + nbytes > size:
        raise GGUFError(f"tensor {gguf_name!r} of {file} ({type_name}, shape {list(dims)}) "
                        f"does not fit the file: truncated or corrupt; download it again.")
      self._tensors[name] = (qtype, tuple(reversed(dims)), start, nbytes)
    self._data = np.memmap(file, np.uint8, "r") if size else None
    self.config = self._config()
    self.header = {name: {"shape": list(self.shape(name))} for name in self._tensors}

  @staticmethod
  def _hf_name(arch: str, name: str) -> str | None:
    if name in _NAMES:
      return _NAMES[name]
    parts, layer = name.split(".", 2), _LAYER_NAMES[arch]
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer:
      return f"model.layers.{parts[1]}.{layer[parts[2]]}"
    return None

  def _meta(self, key: str, kind, default=None):
    key = f"{self.arch}.{key}"
    value = field(self.meta, key, default)
    if value is None:
      raise GGUFError(f"{self.file} has no metadata '{key}'; a {self.arch} GGUF file names "
                      "it: convert the model again.")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
      raise GGUFError(f"metadata '{key}'={value!r} of {self.file} is not an integer.")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise GGUFError(f"metadata '{key}'={value!r} of {self.file} is not a number.")
    return value

  def _config(self) -> dict:
    """The ``config.json`` the metadata describes (``jaxkv.models.hf.model_config`` checks
    it as it checks a Hugging Face one)."""
    heads = self._meta("attention.head_count", int)
    hidden = self._meta("embedding_length", int)
    tokens = field(self.meta, "tokenizer.ggml.tokens")
    vocab = self._meta("vocab_size", int, len(tokens) if tokens is not None else None)
    head_dim = self._meta("attention.key_length", int, self._meta(
        "rope.dimension_count", int, hidden // heads if heads else None))
    value_dim = self._meta("attention.value_length", int, head_dim)
    rope_dim = self._meta("rope.dimension_count", int, head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
      raise GGUFError(f"{self.file} has key length {head_dim}, value length {value_dim} and "
                      f"RoPE dimension {rope_dim}; jaxkv's models rotate whole heads of one "
                      "size.")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden,
        "num_hidden_layers": self._meta("block_count", int),
        "num_attention_heads": heads,
        "num_key_value_heads": self._meta("attention.head_count_kv", int, heads),
        "head_dim": head_dim,
        "intermediate_size": self._meta("feed_forward_length", int),
        "rope_theta": float(self._meta("rope.freq_base", float, 10000.0)),
        "rms_norm_eps": float(self._meta("attention.layer_norm_rms_epsilon", float)),
        "max_position_embeddings": self._meta("context_length", int, 2048),
        "tie_word_embeddings": "lm_head.weight" not in self._tensors,
        "torch_dtype": self._stored_dtype(),
    }
    if self.arch == "gemma3":
      config.update(self._gemma3_config(config))
    scaling = field(self.meta, f"{self.arch}.rope.scaling.type", "none")
    if scaling == "linear":
      config["rope_scaling"] = {"rope_type": "linear",
                                "factor": float(self._meta("rope.scaling.factor", float))}
    elif scaling != "none":
      raise GGUFError(f"{self.file} scales RoPE by {scaling!r}; jaxkv reads linear scaling "
                      "from GGUF (or none).")
    return config

  def _gemma3_config(self, config: dict) -> dict:
    """What a Gemma 3 ``config.json`` adds to the common fields. The local layers' RoPE
    base and the layer pattern are not in the file: llama.cpp (and transformers' GGUF
    reader) take them as published, 10,000 and every 6th layer global. The attention scale
    is llama.cpp's rule: ``head_dim ** -0.5``, but ``(hidden / heads) ** -0.5`` for the
    62-layer (27B) model."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    scalar = config["hidden_size"] // heads if layers == 62 else config["head_dim"]
    return {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
            "hidden_activation": "gelu_pytorch_tanh",
            "rope_theta": float(self._meta("rope.freq_base", float, 1_000_000.0)),
            "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": scalar,
            "sliding_window": self._meta("attention.sliding_window", int),
            "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                            for i in range(layers)]}

  def _stored_dtype(self) -> str:
    kinds = {t[0].name for t in self._tensors.values() if len(t[1]) > 1}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(
        frozenset(kinds), "float32")

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple:
    return self._tensors[name][1]  # numpy order: GGML lists the innermost dimension first

  def view(self, name: str) -> np.ndarray:
    qtype, shape, start, nbytes = self._tensors[name]
    raw = self._data[start:start + nbytes]
    if qtype.name == "F32":
      data = raw.view(np.float32)
    elif qtype.name == "F16":
      data = raw.view(np.float16)
    elif qtype.name == "BF16":
      data = raw.view(ml_dtypes.bfloat16)
    else:  # whole blocks per row (checked at open): [rows, bytes per row] -> float32
      data = _gguf().quants.dequantize(raw.reshape(-1, nbytes // math.prod(shape[:-1])), qtype)
    data = data.reshape(shape)
    c = self.config
    if self.arch == "gemma3":
      return data - np.float32(1) if name.endswith("norm.weight") else data
    if name.endswith("self_attn.q_proj.weight"):
      data = unpermute_rows(data, c["num_attention_heads"])
    elif name.endswith("self_attn.k_proj.weight"):
      data = unpermute_rows(data, c["num_key_value_heads"])
    return data


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """A Q or K projection ``[heads * head_dim, in]`` from GGUF's row order (each head's
  rows as interleaved RoPE pairs) back to the rotate-half order of Hugging Face."""
  rows = w.shape[0]
  return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))

