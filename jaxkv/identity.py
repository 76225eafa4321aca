"""What a model's KV depends on, as one digest: its structure and its weights.

A cached block is only valid for the weights that computed it. ``CacheConfig.fingerprint``
covers the cache's shapes and the model's name; ``weights_digest`` adds the model itself,
so a store, checkpoint or remote peer written under other weights is never hit (its
records fail the fingerprint check, its keys differ).

The rule, cheap for any size of model (one small gather per tensor):
- every ``nnx.Param``-like variable that is not the cache's own pages: its path, shape,
  dtype and ``SAMPLE`` values at evenly spaced positions of the flattened tensor (always
  the first and the last), hashed bit for bit;
- every module's type and its plain settings (numbers, strings, flags and dataclass
  configs such as ``LlamaConfig``: RoPE base, norm epsilon, ...), which change the KV
  without changing a weight.
The weights are digested as the model holds them, after any conversion at load, so the
dtype they compute in is part of the digest twice over (each tensor's dtype, and the
model config's ``dtype`` among its settings): one checkpoint loaded in float32 (the CPU
default) and in bfloat16 gives two digests, and blocks computed in one are never served
to the other.
A change that leaves every sampled value of every tensor bit-identical goes unnoticed
(e.g. editing a few rows of one matrix); pass ``CacheConfig.weights_digest`` explicitly
(e.g. a hash published beside the checkpoint) where that matters. Random-initialised
models differ by their seed through their values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import jax
import numpy as np
from flax import nnx

SAMPLE = 1024  # values read from each tensor


def _settings(module) -> dict:
  out = {}
  for name, value in sorted(vars(module).items()):
    if name.startswith("_") or name in ("k_index", "v_index"):
      continue
    if value is None or isinstance(value, (bool, int, float, str)):
      out[name] = value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
      out[name] = {"type": type(value).__name__,
                   **{k: repr(v) for k, v in sorted(dataclasses.asdict(value).items())}}
  return out


def _sample(x) -> np.ndarray:
  from jaxkv.distributed import to_host
  n = int(np.prod(x.shape))
  if n == 0:
    return np.zeros((0,), np.uint8)
  idx = np.unique(np.linspace(0, n - 1, min(n, SAMPLE)).astype(np.int64))
  # A gather at the sampled coordinates: no reshape, so a tensor split over devices is
  # never assembled whole on one of them.
  return to_host(x[np.unravel_index(idx, x.shape)] if x.ndim else x.reshape(1))


def weights_digest(model: nnx.Module, weights=None) -> str:
  """The hex SHA-256 of ``model``'s structure and weights by the rule above. ``weights``:
  the model's state without its KV pages when already split off (as the cache has it)."""
  from jaxkv.nnx import KVPages
  if weights is None:
    weights = nnx.state(model, nnx.Not(KVPages))
  h = hashlib.sha256(b"jaxkv-weights-v1\0")
  structure = [[".".join(map(str, path)), type(m).__name__, _settings(m)]
               for path, m in nnx.iter_modules(model)]
  h.update(json.dumps(structure, sort_keys=True, default=repr).encode())
  leaves = jax.tree_util.tree_leaves_with_path(weights)
  for path, leaf in sorted(leaves, key=lambda pl: jax.tree_util.keystr(pl[0])):
    if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
      continue
    head = json.dumps([jax.tree_util.keystr(path), list(leaf.shape), str(leaf.dtype)])
    h.update(head.encode())
    h.update(np.ascontiguousarray(_sample(leaf)).tobytes())
  return h.hexdigest()
