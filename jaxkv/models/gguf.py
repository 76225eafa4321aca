"""GGUF checkpoints (llama.cpp's and Ollama's format) of the Llama family.

    model = jaxkv.models.from_pretrained("/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = jaxkv.Tokenizer.from_dir("/models/SmolLM2-135M-Instruct.Q4_1.gguf")

One ``.gguf`` file holds what a Hugging Face directory spreads over several: the weights,
the model's hyperparameters as metadata (``llama.block_count``, ``llama.rope.freq_base``,
...), and the tokenizer (vocabulary, merges, token types, special ids, chat template).
``GGUFCheckpoint`` presents the file as the Hugging Face loader (``jaxkv.models.hf``)
expects a checkpoint: ``config`` is the ``config.json`` the metadata describes (so every
check of that loader applies), and its tensors are read under Hugging Face's names and
orientation. What differs, and is undone here:
- names: ``blk.{i}.attn_q.weight`` is ``model.layers.{i}.self_attn.q_proj.weight``, ...;
- the Q and K projections' rows: llama.cpp's converter reorders each head's rows from the
  rotate-half RoPE layout to interleaved pairs (row ``2j + half`` of a head was row
  ``half * head_dim / 2 + j``); they are put back, so ``apply_rope`` reads them as it
  reads a Hugging Face checkpoint;
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
import os

import ml_dtypes
import numpy as np

from jaxkv.errors import InputError

# Tensor types read (dequantized to float32 unless stored as a float type).
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
ARCHITECTURES = ("llama",)
# Per layer: GGUF's name -> Hugging Face's (``model.layers.{i}.`` prefixed).
_LAYER_NAMES = {
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
  """``GGUFCheckpoint(file)``, opened once while the file is unchanged (reading a file's
  metadata takes seconds: its vocabulary is tens of thousands of strings)."""
  st = os.stat(file)
  return _checkpoint(os.path.realpath(file), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _checkpoint(file: str, mtime_ns: int, size: int) -> GGUFCheckpoint:
  del mtime_ns, size  # the cache's key
  return GGUFCheckpoint(file)


def open_reader(file: str):
  """The ``gguf.GGUFReader`` of ``file`` (memory-mapped: nothing is read until used)."""
  gguf = _gguf()
  try:
    return gguf.GGUFReader(file, "r")
  except (ValueError, OSError, IndexError, KeyError) as e:
    raise GGUFError(f"{file} is not a GGUF file jaxkv can read ({type(e).__name__}: {e}); "
                    "download or convert it again.") from None


def field(reader, key: str, default=None):
  """The value of metadata ``key`` (strings decoded, arrays as lists), or ``default``."""
  f = reader.fields.get(key)
  if f is None:
    return default
  try:
    return f.contents()
  except (ValueError, IndexError, UnicodeDecodeError) as e:
    raise GGUFError(f"metadata {key!r} of {reader.path} cannot be read ({e}); download or "
                    "convert the file again.") from None


class GGUFCheckpoint:
  """A GGUF file as the Hugging Face loader reads a checkpoint: ``config`` (a
  ``config.json`` as a dict), and ``keys``/``shape``/``view``/``header`` by Hugging Face's
  tensor names (``view``: float32 for a quantized tensor, else the stored dtype; shapes
  ``[out, in]`` as torch stores them)."""

  def __init__(self, file: str):
    self.file = file
    self.reader = open_reader(file)
    arch = field(self.reader, "general.architecture")
    if arch not in ARCHITECTURES:
      raise GGUFError(f"{file} holds a model of architecture {arch!r}; jaxkv loads GGUF "
                      f"architectures {', '.join(ARCHITECTURES)}.")
    self._tensors = {}
    for t in self.reader.tensors:
      name = self._hf_name(t.name)
      if name is None:
        raise GGUFError(f"tensor {t.name!r} of {file} is not part of a Llama model jaxkv "
                        "knows (rope_freqs.weight: Llama 3.1's RoPE scaling is not read from "
                        "GGUF); it computes something else.")
      if t.tensor_type.name not in SUPPORTED_TYPES:
        raise GGUFError(f"tensor {t.name!r} of {file} is stored as {t.tensor_type.name}; jaxkv "
                        f"dequantizes {', '.join(SUPPORTED_TYPES)}: convert the model to one "
                        "of them (llama.cpp's llama-quantize).")
      self._tensors[name] = t
    self.config = self._config()
    self.header = {name: {"shape": list(self.shape(name))} for name in self._tensors}

  @staticmethod
  def _hf_name(name: str) -> str | None:
    if name in _NAMES:
      return _NAMES[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
      return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    return None

  def _meta(self, key: str, kind, default=None):
    value = field(self.reader, f"llama.{key}", default)
    if value is None:
      raise GGUFError(f"{self.file} has no metadata 'llama.{key}'; a Llama GGUF file names "
                      "it: convert the model again.")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
      raise GGUFError(f"metadata 'llama.{key}'={value!r} of {self.file} is not an integer.")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
      raise GGUFError(f"metadata 'llama.{key}'={value!r} of {self.file} is not a number.")
    return value

  def _config(self) -> dict:
    """The ``config.json`` the metadata describes (``jaxkv.models.hf.llama_config`` checks
    it as it checks a Hugging Face one)."""
    heads = self._meta("attention.head_count", int)
    hidden = self._meta("embedding_length", int)
    tokens = field(self.reader, "tokenizer.ggml.tokens")
    vocab = self._meta("vocab_size", int, len(tokens) if tokens is not None else None)
    head_dim = self._meta("attention.key_length", int, self._meta(
        "rope.dimension_count", int, hidden // heads if heads else None))
    value_dim = self._meta("attention.value_length", int, head_dim)
    rope_dim = self._meta("rope.dimension_count", int, head_dim)
    if value_dim != head_dim or rope_dim != head_dim:
      raise GGUFError(f"{self.file} has key length {head_dim}, value length {value_dim} and "
                      f"RoPE dimension {rope_dim}; jaxkv's Llama rotates whole heads of one "
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
    scaling = field(self.reader, "llama.rope.scaling.type", "none")
    if scaling == "linear":
      config["rope_scaling"] = {"rope_type": "linear",
                                "factor": float(self._meta("rope.scaling.factor", float))}
    elif scaling != "none":
      raise GGUFError(f"{self.file} scales RoPE by {scaling!r}; jaxkv reads linear scaling "
                      "from GGUF (or none).")
    return config

  def _stored_dtype(self) -> str:
    kinds = {t.tensor_type.name for name, t in self._tensors.items() if len(t.shape) > 1}
    return {frozenset({"F16"}): "float16", frozenset({"BF16"}): "bfloat16"}.get(
        frozenset(kinds), "float32")

  def keys(self):
    return self._tensors.keys()

  def shape(self, name: str) -> tuple:
    return tuple(int(d) for d in reversed(self._tensors[name].shape))  # GGML lists dims inner first

  def view(self, name: str) -> np.ndarray:
    t = self._tensors[name]
    kind = t.tensor_type.name
    if kind in ("F32", "F16"):
      data = np.asarray(t.data)
    elif kind == "BF16":
      data = np.asarray(t.data).view(ml_dtypes.bfloat16)
    else:
      data = _gguf().quants.dequantize(t.data, t.tensor_type)
    data = data.reshape(self.shape(name))
    c = self.config
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


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of ``unpermute_rows``: a Hugging Face Q or K projection in GGUF's order
  (what llama.cpp's converter writes)."""
  rows = w.shape[0]
  return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


# ---- the tokenizer -------------------------------------------------------------------------
# ``tokenizer.ggml.pre`` names how llama.cpp splits text before BPE; these are the splits
# of the names jaxkv reads (as regular expressions over Unicode classes, applied in order,
# each piece kept), followed by GPT-2's byte-level split.
_PRE_SPLITS = {"gpt2": (), "smollm": (r"\p{N}",), "starcoder": (r"\p{N}",),
               "refact": (r"\p{N}",)}
# Control tokens that end a turn, by their text, for files whose metadata names only one
# end-of-sequence id (llama.cpp finds these the same way).
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                "<|endoftext|>", "</s>")
_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


def tokenizer_parts(file: str) -> dict:
  """What ``jaxkv.Tokenizer`` reads from a GGUF file: ``json`` (a ``tokenizers`` library
  tokenizer, serialised), ``bos_token``/``eos_token`` (their text or None),
  ``eos_token_ids`` and ``chat_template`` (or None)."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
  from tokenizers import processors
  reader = checkpoint(file).reader
  kind = field(reader, "tokenizer.ggml.model")
  tokens = field(reader, "tokenizer.ggml.tokens")
  if kind != "gpt2" or tokens is None:
    raise GGUFError(f"{file} has a tokenizer of kind {kind!r}; jaxkv reads GGUF's byte-level "
                    "BPE tokenizers ('gpt2'); pass token ids instead.")
  pre = field(reader, "tokenizer.ggml.pre", "gpt2")
  if pre not in _PRE_SPLITS:
    raise GGUFError(f"{file} splits text as {pre!r} (tokenizer.ggml.pre); jaxkv reads "
                    f"{', '.join(_PRE_SPLITS)}; pass token ids instead.")
  merges = field(reader, "tokenizer.ggml.merges", [])
  types = field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
  if len(types) != len(tokens):
    raise GGUFError(f"{file} has {len(tokens)} tokens but {len(types)} token types.")
  vocab = {t: i for i, t in enumerate(tokens)}
  pairs = []
  for m in merges:
    left, sep, right = m.partition(" ")
    if not sep or left not in vocab or right not in vocab:
      raise GGUFError(f"merge {m!r} of {file} does not join two tokens of its vocabulary.")
    pairs.append((left, right))
  tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
  splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _PRE_SPLITS[pre]]
  tok.pre_tokenizer = pre_tokenizers.Sequence(
      splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
  tok.decoder = decoders.ByteLevel()
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                          for t, kind in zip(tokens, types) if kind == _CONTROL])
  tok.add_tokens([AddedToken(t, special=False, normalized=False)
                  for t, kind in zip(tokens, types) if kind == _USER_DEFINED])

  def token(key):
    i = field(reader, f"tokenizer.ggml.{key}_token_id")
    if i is not None and not 0 <= i < len(tokens):
      raise GGUFError(f"tokenizer.ggml.{key}_token_id={i} of {file} is not a token id "
                      f"(0..{len(tokens) - 1}).")
    return i

  bos, eos = token("bos"), token("eos")
  single = ["$A"]
  if field(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
    single = [tokens[bos]] + single
  if field(reader, "tokenizer.ggml.add_eos_token", False) and eos is not None:
    single = single + [tokens[eos]]
  if len(single) > 1:
    used = sorted({(t, vocab[t]) for t in single if t != "$A"})
    tok.post_processor = processors.TemplateProcessing(single=" ".join(single),
                                                       special_tokens=used)
  ends = [i for i in (eos, token("eot"), token("eom")) if i is not None]
  ends += [i for i, (t, kind) in enumerate(zip(tokens, types))
           if kind == _CONTROL and t in _END_OF_TURN]
  return {"json": tok.to_str(), "bos_token": tokens[bos] if bos is not None else None,
          "eos_token": tokens[eos] if eos is not None else None,
          "eos_token_ids": tuple(dict.fromkeys(ends)),
          "chat_template": field(reader, "tokenizer.chat_template")}
