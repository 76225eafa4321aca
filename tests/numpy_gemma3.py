"""Gemma 3's text decoder as a NumPy float64 forward, written from the published definition
(the Gemma 3 report and Hugging Face's ``Gemma3ForCausalLM``), over weights the ``gguf``
package reads and dequantizes.

Nothing of jaxkv runs here: not its GGUF reader (this file reads the GGUF layout itself,
``_read_gguf``, and the ``gguf`` package's ``quants.dequantize`` dequantizes; the names below
are this file's own), not its
layers, RoPE, windows or pages. The definition, per layer ``i`` (global when ``layer_types``
says ``full_attention``; the published pattern: every 6th layer):

    h = x + norm_post_attn(attention(norm_in(x)))
    x = h + norm_post_ffw(down(gelu_tanh(gate(norm_pre_ffw(h))) * up(norm_pre_ffw(h))))

with ``norm(x) = x / sqrt(mean(x^2) + eps) * (1 + w)``, the embedding times
``sqrt(hidden)``, per-head RMS norms of q and k before rotate-half RoPE (base 10,000 on
local layers, the file's base on global ones), scores scaled by
``query_pre_attn_scalar ** -0.5``, a local layer's query at ``t`` seeing keys at
``t - window < p <= t``, and the output head the embedding. llama.cpp's converter stores
each norm's ``w + 1``: the 1 is taken off here, on this file's own reading.
"""

import math
import struct

import numpy as np

# GGUF per-layer names -> this reference's.
_LAYER = {"attn_norm": "norm_in", "post_attention_norm": "norm_post_attn",
          "ffn_norm": "norm_pre_ffw", "post_ffw_norm": "norm_post_ffw",
          "attn_q_norm": "q_norm", "attn_k_norm": "k_norm", "attn_q": "wq", "attn_k": "wk",
          "attn_v": "wv", "attn_output": "wo", "ffn_gate": "gate", "ffn_up": "up",
          "ffn_down": "down"}


def _read_gguf(path: str) -> tuple[dict, list]:
  """The metadata (tokenizer arrays skipped) and ``(name, dims, type, offset)`` of each
  tensor of a GGUF file, read from its published layout: magic, version, counts, key/value
  pairs, tensor infos, then the data at the next multiple of ``general.alignment``. (The
  ``gguf`` package's ``GGUFReader`` builds a view of every tokenizer string, 12 s for this
  file's 262k; this reads the few fields the forward needs.)"""
  data = np.memmap(path, np.uint8, mode="r")
  buf = memoryview(data)
  pos = 0

  def take(fmt):
    nonlocal pos
    out = struct.unpack_from("<" + fmt, buf, pos)
    pos += struct.calcsize("<" + fmt)
    return out[0] if len(out) == 1 else out

  def text():
    nonlocal pos
    n = take("Q")
    pos += n
    return bytes(buf[pos - n:pos]).decode()

  scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
             12: "d"}

  def value(kind):
    nonlocal pos
    if kind == 8:
      return text()
    if kind == 9:
      item, count = take("I"), take("Q")
      if item in scalars:  # fixed-size items: skipped as one stretch
        pos += count * struct.calcsize("<" + scalars[item])
        return None
      return [value(item) for _ in range(count)]
    return take(scalars[kind])

  assert bytes(buf[:4]) == b"GGUF", bytes(buf[:4])
  pos = 4
  _, n_tensors, n_kv = take("I"), take("Q"), take("Q")
  meta = {}
  for _ in range(n_kv):
    key = text()
    meta[key] = value(take("I"))
  infos = []
  for _ in range(n_tensors):
    name = text()
    dims = [take("Q") for _ in range(take("I"))]
    infos.append((name, dims, take("I"), take("Q")))
  align = meta.get("general.alignment", 32)
  start = -(-pos // align) * align
  return meta, [(name, dims, kind, data[start + offset:]) for name, dims, kind, offset in infos]


def _rms(x, w, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def _gelu_tanh(x):
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _rope(x, theta, factor=1.0):
  """x: [T, heads, d], positions 0..T-1; rotate-half pairs (i, i + d/2)."""
  d = x.shape[-1]
  inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d)) / factor
  ang = np.arange(x.shape[0], dtype=np.float64)[:, None] * inv  # [T, d/2]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class NumpyGemma3:
  """The forward over one set of weights: ``cfg`` (sizes, as below) and ``layers`` (one
  dict per layer of this file's names, matrices ``[out, in]``), ``embed`` ``[vocab,
  hidden]``, ``norm`` (final, ``w``). Matrices stay float32 (the embedding alone is 1.3 GB
  in float64) and are widened where used."""

  def __init__(self, cfg: dict, embed, layers: list, norm):
    self.cfg, self.embed, self.layers, self.norm = cfg, embed, layers, norm

  @classmethod
  def from_hf(cls, config: dict, weights: dict) -> "NumpyGemma3":
    """A Hugging Face ``Gemma3ForCausalLM`` checkpoint's ``config.json`` (legacy spelling:
    ``rope_theta``, ``rope_local_base_freq``, ``layer_types``) and tensors by name."""
    n = config["num_hidden_layers"]
    cfg = dict(hidden=config["hidden_size"], heads=config["num_attention_heads"],
               kv_heads=config["num_key_value_heads"], head_dim=config["head_dim"],
               eps=config["rms_norm_eps"], theta=config["rope_theta"],
               local_theta=config["rope_local_base_freq"], window=config["sliding_window"],
               query_pre_attn_scalar=config["query_pre_attn_scalar"],
               global_layers=[t == "full_attention" for t in config["layer_types"]])
    names = {"norm_in": "input_layernorm.weight", "norm_post_attn": "post_attention_layernorm.weight",
             "norm_pre_ffw": "pre_feedforward_layernorm.weight",
             "norm_post_ffw": "post_feedforward_layernorm.weight",
             "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
             **{f"w{p}": f"self_attn.{p}_proj.weight" for p in "qkvo"},
             **{p: f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}
    layers = [{ours: weights[f"model.layers.{i}.{theirs}"] for ours, theirs in names.items()}
              for i in range(n)]
    return cls(cfg, weights["model.embed_tokens.weight"], layers, weights["model.norm.weight"])

  @classmethod
  def from_gguf(cls, path: str) -> "NumpyGemma3":
    import gguf  # pylint: disable=import-outside-toplevel
    meta, tensors = _read_gguf(path)
    assert meta["general.architecture"] == "gemma3", meta["general.architecture"]
    n = meta["gemma3.block_count"]
    cfg = dict(hidden=meta["gemma3.embedding_length"], heads=meta["gemma3.attention.head_count"],
               kv_heads=meta["gemma3.attention.head_count_kv"],
               head_dim=meta["gemma3.attention.key_length"],
               eps=meta["gemma3.attention.layer_norm_rms_epsilon"],
               theta=meta["gemma3.rope.freq_base"], local_theta=10000.0,
               window=meta["gemma3.attention.sliding_window"],
               global_layers=[(i + 1) % 6 == 0 for i in range(n)])
    cfg["query_pre_attn_scalar"] = cfg["head_dim"]
    layers = [{} for _ in range(n)]
    embed = norm = None
    for name, dims, kind, raw in tensors:
      kind = gguf.GGMLQuantizationType(kind)
      block, size = gguf.GGML_QUANT_SIZES[kind]
      rows, row_bytes = math.prod(dims[1:]), dims[0] // block * size
      w = gguf.quants.dequantize(np.asarray(raw[:rows * row_bytes]).reshape(rows, row_bytes),
                                 kind).astype(np.float32)
      w = w.reshape(list(reversed(dims)))
      if name.endswith("norm.weight"):
        w = w - np.float32(1)  # the converter's w + 1
      if name == "token_embd.weight":
        embed = w
      elif name == "output_norm.weight":
        norm = w
      else:
        _, i, part, _ = name.split(".")
        layers[int(i)][_LAYER[part]] = w
    return cls(cfg, embed, layers, norm)

  def _attention(self, x, p, is_global):
    c = self.cfg
    t, heads, kv, d = x.shape[0], c["heads"], c["kv_heads"], c["head_dim"]
    q = (x @ p["wq"].T.astype(np.float64)).reshape(t, heads, d)
    k = (x @ p["wk"].T.astype(np.float64)).reshape(t, kv, d)
    v = (x @ p["wv"].T.astype(np.float64)).reshape(t, kv, d)
    q, k = _rms(q, p["q_norm"], c["eps"]), _rms(k, p["k_norm"], c["eps"])
    theta, factor = (c["theta"], c.get("factor", 1.0)) if is_global else (c["local_theta"], 1.0)
    q, k = _rope(q, theta, factor), _rope(k, theta, factor)
    k, v = np.repeat(k, heads // kv, axis=1), np.repeat(v, heads // kv, axis=1)
    scores = np.einsum("thd,shd->hts", q, k) / math.sqrt(c["query_pre_attn_scalar"])
    pos = np.arange(t)
    visible = pos[None, :] <= pos[:, None]
    if not is_global:
      visible &= pos[None, :] > pos[:, None] - c["window"]
    scores = np.where(visible[None], scores, -np.inf)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
    out = np.einsum("hts,shd->thd", scores, v).reshape(t, heads * d)
    return out @ p["wo"].T.astype(np.float64)

  def logits(self, tokens, rows=None) -> np.ndarray:
    """[len(rows), vocab] float64: the logits after ``tokens[r]`` for each ``r`` of
    ``rows`` (default: every position)."""
    c = self.cfg
    x = self.embed[np.asarray(tokens)].astype(np.float64) * math.sqrt(c["hidden"])
    for p, is_global in zip(self.layers, c["global_layers"]):
      h = x + _rms(self._attention(_rms(x, p["norm_in"], c["eps"]), p, is_global),
                   p["norm_post_attn"], c["eps"])
      m = _rms(h, p["norm_pre_ffw"], c["eps"])
      m = ((_gelu_tanh(m @ p["gate"].T.astype(np.float64)) * (m @ p["up"].T.astype(np.float64)))
           @ p["down"].T.astype(np.float64))
      x = h + _rms(m, p["norm_post_ffw"], c["eps"])
    rows = np.arange(len(tokens)) if rows is None else np.asarray(rows)
    x = _rms(x[rows], self.norm, c["eps"])
    step = 32768  # the head in slices: a float64 copy of the whole embedding is 1.3 GB
    return np.concatenate([x @ self.embed[i:i + step].T.astype(np.float64)
                           for i in range(0, self.embed.shape[0], step)], axis=-1)
