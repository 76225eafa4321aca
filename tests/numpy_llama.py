"""A jaxkv ``Llama``'s weights run by the NumPy reference of ``hf_fixtures``.

The only thing taken from jaxkv is the weights (read out of the nnx model as NumPy arrays)
and the config's numbers. They are renamed and laid out as a Hugging Face Llama checkpoint
holds them (``[out, in]`` matrices), and ``hf_fixtures.reference_logits`` computes the
forward in float64 from the published architecture: its own embedding lookup, RMSNorm,
rotate-half RoPE, grouped-query causal attention, SwiGLU MLP and output head. None of
jaxkv's layers, RoPE, attention or pages run, so a bug in any of them shows as a
difference from this reference, where a reference built of jaxkv's own modules would
share it.
"""

import dataclasses

import numpy as np

import hf_fixtures


def _array(param) -> np.ndarray:
  return np.asarray(param.get_value(), np.float64)


def hf_config(cfg) -> dict:
  """The Hugging Face config (legacy spelling, as the reference reads it) of a
  ``jaxkv.models.LlamaConfig``."""
  out = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
             intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
             num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,
             tie_word_embeddings=cfg.tie_embeddings)
  # (The reference has no output-projection bias: refuse rather than drop one.)
  assert not cfg.out_bias, "hf_fixtures.reference_logits has no o_proj bias"
  scaling = cfg.rope_scaling
  if scaling is not None:
    fields = dataclasses.asdict(scaling)
    kind = "llama3" if "low_freq_factor" in fields else "linear"
    out["rope_scaling"] = {"rope_type": kind, **fields}
  return out


def _layer(model, i: int):
  """(layer module, index into its weights): the loop form's ``i``-th module, or the
  scanned form's one module whose weights are stacked on a leading layer axis."""
  if model.cfg.scan_layers:
    return model.layers, i
  return model.layers[i], ...


def hf_weights(model) -> dict[str, np.ndarray]:
  """Hugging Face tensor names -> float64 weights of a ``jaxkv.models.Llama`` (either
  layer form)."""
  w = {"model.embed_tokens.weight": _array(model.embed.embedding),
       "model.norm.weight": _array(model.norm.scale)}
  if not model.cfg.tie_embeddings:
    w["lm_head.weight"] = _array(model.lm_head.kernel).T
  for i in range(model.cfg.num_layers):
    layer, at = _layer(model, i)
    p = f"model.layers.{i}."
    w[p + "input_layernorm.weight"] = _array(layer.attn_norm.scale)[at]
    w[p + "post_attention_layernorm.weight"] = _array(layer.mlp_norm.scale)[at]
    for name in ("q", "k", "v", "o"):
      proj = getattr(layer.attn, f"{name}_proj")
      w[f"{p}self_attn.{name}_proj.weight"] = _array(proj.kernel)[at].T
      if proj.bias is not None:
        w[f"{p}self_attn.{name}_proj.bias"] = _array(proj.bias)[at]
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
      w[f"{p}mlp.{theirs}.weight"] = _array(getattr(layer.mlp, ours).kernel)[at].T
  return w


class NumpyLlama:
  """The reference forward over one jaxkv model's weights (read once, when made)."""

  def __init__(self, model):
    self.cfg = hf_config(model.cfg)
    self.weights = hf_weights(model)

  def logits(self, tokens) -> np.ndarray:
    """[T, vocab] float64: row t is the logits of the token after ``tokens[t]``."""
    return hf_fixtures.reference_logits(self.cfg, self.weights, list(tokens))

  def log_softmax(self, tokens) -> np.ndarray:
    """[T, vocab] float64 log-probabilities of the token after each position."""
    return log_softmax(self.logits(tokens))


def log_softmax(x) -> np.ndarray:
  x = np.asarray(x, np.float64)
  m = x.max(-1, keepdims=True)
  return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
