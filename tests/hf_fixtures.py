"""Tiny Hugging Face checkpoints and tokenizers written by tests, and an independent NumPy
implementation of the architectures they hold (it calls no jaxkv code).

The reference follows the published architectures as the Hugging Face ``transformers``
implementations define them: RMSNorm, rotate-half RoPE (``inv_freq = theta^(-2i/d)``;
Llama 3 scaling by wavelength band; linear scaling: positions divided by the factor),
grouped-query causal attention with scale
``1/sqrt(head_dim)``, SiLU-gated MLP, q/k/v biases for Qwen2, ``lm_head`` or the tied
embedding.
"""

import json
import math
import os

import numpy as np
from safetensors.numpy import save_file

FAMILIES = {
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama"),
    "llama3": dict(architectures=["LlamaForCausalLM"], model_type="llama",
                   rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                     high_freq_factor=4.0,
                                     original_max_position_embeddings=64)),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=None),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2",
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=4096),
}


def hf_config(family: str, **overrides) -> dict:
  cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
             rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False,
             max_position_embeddings=2048, torch_dtype="float32", bos_token_id=1,
             eos_token_id=2)
  cfg.update(FAMILIES[family])
  cfg.update(overrides)
  return cfg


def transformers5_spelling(cfg: dict) -> dict:
  """``cfg`` as transformers >= 5 writes it: ``rope_theta`` and ``rope_scaling`` moved into
  ``rope_parameters`` (with ``rope_type``), ``torch_dtype`` renamed ``dtype``."""
  out = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
  rope = dict(cfg.get("rope_scaling") or {"rope_type": "default"})
  rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type")
  out["rope_parameters"] = {"rope_theta": cfg["rope_theta"], **rope}
  if "torch_dtype" in cfg:
    out["dtype"] = cfg["torch_dtype"]
  return out


def random_weights(cfg: dict, seed: int) -> dict[str, np.ndarray]:
  """Hugging Face tensor names -> float32 arrays ([out, in] for linear layers)."""
  rng = np.random.default_rng(seed)
  h, v, m = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
  d = cfg["head_dim"]
  nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  qwen = cfg["architectures"][0] == "Qwen2ForCausalLM"
  w = lambda *shape: (rng.standard_normal(shape) / math.sqrt(shape[-1])).astype(np.float32)
  out = {"model.embed_tokens.weight": rng.standard_normal((v, h)).astype(np.float32),
         "model.norm.weight": (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)}
  if not cfg["tie_word_embeddings"]:
    out["lm_head.weight"] = w(v, h)
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    out[p + "post_attention_layernorm.weight"] = (
        1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    for name, rows in (("q", nq * d), ("k", nkv * d), ("v", nkv * d)):
      out[f"{p}self_attn.{name}_proj.weight"] = w(rows, h)
      if qwen:
        out[f"{p}self_attn.{name}_proj.bias"] = (0.5 * rng.standard_normal(rows)).astype(
            np.float32)
    out[p + "self_attn.o_proj.weight"] = w(h, nq * d)
    out[p + "mlp.gate_proj.weight"] = w(m, h)
    out[p + "mlp.up_proj.weight"] = w(m, h)
    out[p + "mlp.down_proj.weight"] = w(h, m)
  return out


def write_checkpoint(path: str, cfg: dict, weights: dict, *, shards: int = 1) -> str:
  """A Hugging Face model directory: config.json and one safetensors file, or ``shards``
  files with an index (tensors split over them in name order)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f)
  names = sorted(weights)
  if shards == 1:
    save_file({n: weights[n] for n in names}, os.path.join(path, "model.safetensors"))
    return path
  weight_map = {}
  for s in range(shards):
    file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
    part = names[s::shards]
    save_file({n: weights[n] for n in part}, os.path.join(path, file))
    weight_map.update({n: file for n in part})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  return path


# ---- the NumPy reference ------------------------------------------------------------------
def _rms(x, w, eps):
  return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope_type(cfg):
  """The reference reads only the legacy spelling: ``rope_theta`` and ``rope_scaling``."""
  rs = cfg.get("rope_scaling")
  kind = (rs.get("rope_type", rs.get("type")) if rs else None) or "default"
  assert kind in ("default", "linear", "llama3"), kind
  return kind, rs


def _inv_freq(cfg):
  d = cfg["head_dim"]
  inv = 1.0 / (cfg["rope_theta"] ** (np.arange(0, d, 2) / d))
  kind, rs = _rope_type(cfg)
  if kind == "llama3":
    old = rs["original_max_position_embeddings"]
    out = []
    for f in inv:
      wavelen = 2 * math.pi / f
      if wavelen < old / rs["high_freq_factor"]:
        out.append(f)
      elif wavelen > old / rs["low_freq_factor"]:
        out.append(f / rs["factor"])
      else:
        smooth = (old / wavelen - rs["low_freq_factor"]) / (
            rs["high_freq_factor"] - rs["low_freq_factor"])
        out.append((1 - smooth) * f / rs["factor"] + smooth * f)
    inv = np.array(out)
  return inv


def _rope(x, cfg):  # x: [T, heads, d]
  kind, rs = _rope_type(cfg)
  positions = np.arange(x.shape[0]) / (rs["factor"] if kind == "linear" else 1.0)
  t = positions[:, None] * _inv_freq(cfg)[None, :]  # [T, d/2]
  emb = np.concatenate([t, t], axis=-1)[:, None, :]
  half = x.shape[-1] // 2
  rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * np.cos(emb) + rotated * np.sin(emb)


def reference_logits(cfg: dict, weights: dict, tokens) -> np.ndarray:
  """[T, vocab] float64 logits of the full causal forward over ``tokens``."""
  w = {k: v.astype(np.float64) for k, v in weights.items()}
  d, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
  eps = cfg["rms_norm_eps"]
  x = w["model.embed_tokens.weight"][np.asarray(tokens)]
  t = x.shape[0]
  causal = np.tril(np.ones((t, t), bool))
  for i in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{i}."
    h = _rms(x, w[p + "input_layernorm.weight"], eps)
    proj = lambda n: h @ w[f"{p}self_attn.{n}_proj.weight"].T + w.get(
        f"{p}self_attn.{n}_proj.bias", 0.0)
    q = _rope(proj("q").reshape(t, nq, d), cfg)
    k = _rope(proj("k").reshape(t, nkv, d), cfg)
    v = proj("v").reshape(t, nkv, d)
    heads = []
    for hq in range(nq):
      kv = hq // (nq // nkv)
      s = q[:, hq] @ k[:, kv].T / math.sqrt(d)
      s = np.where(causal, s, -np.inf)
      s = np.exp(s - s.max(-1, keepdims=True))
      heads.append((s / s.sum(-1, keepdims=True)) @ v[:, kv])
    x = x + np.concatenate(heads, axis=-1) @ w[p + "self_attn.o_proj.weight"].T
    h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
    gate = h @ w[p + "mlp.gate_proj.weight"].T
    x = x + ((gate / (1 + np.exp(-gate))) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"].T
  x = _rms(x, w["model.norm.weight"], eps)
  head = w["model.embed_tokens.weight"] if cfg["tie_word_embeddings"] else w["lm_head.weight"]
  return x @ head.T


def reference_greedy(cfg, weights, prompt, n) -> tuple[list[int], np.ndarray]:
  """``n`` greedy tokens after ``prompt`` and the logits each was chosen from."""
  tokens, chosen_from = list(prompt), []
  for _ in range(n):
    logits = reference_logits(cfg, weights, tokens)[-1]
    chosen_from.append(logits)
    tokens.append(int(np.argmax(logits)))
  return tokens[len(prompt):], np.stack(chosen_from)


CORPUS = ["the cache keeps keys and values of every token it has seen",
          "a block is fetched back or computed again, whichever is cheaper",
          "hello world, the quick brown fox jumps over the lazy dog",
          "pages of the cache live on the device, in host memory and on disk"] * 4

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
                 "<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def text_checkpoint(path: str, seed: int = 0):
  """A Llama 3 checkpoint with a tokenizer at ``path``; its eos ids are the tokenizer's.
  Returns ``(path, hf config, weights, special token ids)``."""
  ids = write_tokenizer(path)
  cfg = hf_config("llama3", vocab_size=320, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"])
  weights = random_weights(cfg, seed=seed)
  write_checkpoint(path, cfg, weights)
  return path, cfg, weights, ids


def write_tokenizer(path: str, vocab_size: int = 300) -> dict:
  """A byte-level BPE tokenizer trained here on ``CORPUS``: ``<s>`` (BOS, added by the
  post-processor), ``</s>`` (EOS), ``<|end|>`` (end of turn, the generation config's second
  EOS) and a chat template. Returns the special tokens' ids."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
  os.makedirs(path, exist_ok=True)
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<s>", "</s>", "<|end|>", "<|user|>", "<|system|>", "<|assistant|>"]
  tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=specials,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
  ids = {s: tok.token_to_id(s) for s in specials}
  tok.post_processor = processors.TemplateProcessing(
      single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", ids["<s>"])])
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": {"content": "</s>"},
               "chat_template": CHAT_TEMPLATE}, f)
  with open(os.path.join(path, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": [ids["</s>"], ids["<|end|>"]]}, f)
  return ids
