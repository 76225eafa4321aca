"""Choosing the next token: greedy or seeded sampling, per row, inside the jitted steps.

Every row of a step carries its own ``SamplingParams`` as four numbers (``RowSampling``):
temperature (0 = greedy, the argmax), top-k (0 = no limit), top-p (1 = no limit) and a
seed. A sampled token's randomness depends only on the request's seed and the absolute
position the token will take in the sequence (``fold_in(key(seed), position)``): never on
which step, batch or row produced it, nor on whether its prefix came from the cache. So a
seeded request gives the same tokens alone or in a crowd, with or without cache hits.

When every row of a step is greedy, the sort that top-k/top-p need is skipped
(``lax.cond``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.config import MAX_LOGPROBS


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSampling:
  """Per-row sampling parameters of one step (all ``[rows]``)."""

  temperature: jax.Array  # float32, 0 = greedy
  top_k: jax.Array  # int32, 0 = no limit
  top_p: jax.Array  # float32, 1 = no limit
  seed: jax.Array  # uint32

  @staticmethod
  def greedy(num_rows: int) -> "RowSampling":
    return RowSampling(np.zeros((num_rows,), np.float32), np.zeros((num_rows,), np.int32),
                       np.ones((num_rows,), np.float32), np.zeros((num_rows,), np.uint32))


def _sample(logits, rows: RowSampling, positions):
  """logits [B, V] float; positions [B] int32: where each row's new token will sit."""
  vocab = logits.shape[-1]
  logits = logits.astype(jnp.float32)
  scaled = logits / jnp.maximum(rows.temperature, 1e-6)[:, None]
  order = jnp.argsort(-scaled, axis=-1)
  sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
  rank = jnp.arange(vocab)[None, :]
  k = jnp.where(rows.top_k > 0, rows.top_k, vocab)[:, None]
  probs = jax.nn.softmax(jnp.where(rank < k, sorted_logits, -jnp.inf), axis=-1)
  before = jnp.cumsum(probs, axis=-1) - probs  # mass of the tokens ranked above
  keep = (rank < k) & ((before < rows.top_p[:, None]) | (rank == 0))
  masked = jnp.where(keep, sorted_logits, -jnp.inf)

  def draw(seed, pos, row_logits):
    key = jax.random.fold_in(jax.random.key(seed), pos)
    return jax.random.categorical(key, row_logits)

  picked = jax.vmap(draw)(rows.seed, positions, masked)
  sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0]
  greedy = jnp.argmax(logits, axis=-1)
  return jnp.where(rows.temperature > 0, sampled, greedy).astype(jnp.int32)


def next_tokens(logits, rows: RowSampling | None, positions) -> jax.Array:
  """The next token of every row: ``logits [B, V]``, ``positions [B]`` int32 (the position
  the new token takes). ``rows=None``: every row greedy."""
  greedy = lambda: jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if rows is None:
    return greedy()
  return jax.lax.cond(jnp.any(rows.temperature > 0), lambda: _sample(logits, rows, positions),
                      greedy)


# ---- log-probabilities ------------------------------------------------------------------------


def logprobs_of(logits, targets):
  """Log-softmax scores, before any sampling transform: ``logits [..., V]``, ``targets
  [...]`` int32 (a token id; < 0: none). Returns ``(logprob of each target [...], the
  MAX_LOGPROBS most likely ids [..., K], their logprobs [..., K])``, float32, highest first
  (a target < 0 reads token 0's: the caller ignores it)."""
  lsm = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  picked = jnp.take_along_axis(lsm, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]
  top_lp, top_ids = jax.lax.top_k(lsm, min(MAX_LOGPROBS, lsm.shape[-1]))
  return picked, top_ids.astype(jnp.int32), top_lp


logprobs_step = jax.jit(logprobs_of)  # over a step's selected logits and its tokens out


def logprobs_host(logits: np.ndarray, targets: np.ndarray) -> tuple:
  """``logprobs_of`` in NumPy, for logits already on the host (a streamed sequence's)."""
  x = np.asarray(logits, np.float32)
  m = x.max(axis=-1, keepdims=True)
  lsm = x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))
  picked = np.take_along_axis(lsm, np.maximum(targets, 0)[..., None], axis=-1)[..., 0]
  k = min(MAX_LOGPROBS, lsm.shape[-1])
  ids = np.argsort(-lsm, axis=-1, kind="stable")[..., :k].astype(np.int32)
  return picked, ids, np.take_along_axis(lsm, ids, axis=-1)
