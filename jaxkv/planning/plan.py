"""The jitted decision: per request, which cached blocks to fetch and which to recompute.

The rule (per request r and candidate data shard d)
  A request's first ``h`` blocks are hot on the shard's device pool; blocks ``[h, e)`` are
  cached in lower tiers (host, pool, disk, remote) or on another shard; anything after ``e`` must
  be computed anyway. For a split point ``s`` in ``[h, e]`` jaxkv recomputes blocks
  ``[h, s)`` while it fetches blocks ``[s, e)``, in parallel, then prefills the rest:

    t(s) = both(t_recompute(h..s), t_fetch(s..e)) + t_prefill(rest | e)
    both(r, f) = max(r, f) + (1 - overlap) * min(r, f)
    s*   = argmin_s t(s)         (s = h: fetch everything; s = e: recompute everything)

  so a plan is never predicted worse than either pure decision (all fetch, all recompute).
  ``overlap`` (``CostModel.overlap``, learned from timed splits) is how much of the shorter
  of the two the longer hides: 1 where they share nothing, less where the fetch's receiving
  takes cycles the recompute needs (a CPU), so that a split is chosen only where it pays.
- ``t_recompute`` and ``t_fetch`` come from ``jaxkv.planning.costs``: the measured prefill curve on a
  cached context of ``h*page_size`` tokens (rounded up to the prefill's chunks), and the
  slowest link the fetched bytes cross.
- Sharing: requests of one step share their device's compute (their recompute runs in the
  same batched steps) and their host's links (each link's bandwidth is split between the
  requests that use it). ``plan`` finds both in a first pass and charges them in a second.
- Capacity: a shard fetches at most ``min(in-flight budget, free staging pages)`` blocks;
  the rest is recomputed (``s >= e - budget``). A block cached nowhere (``ABSENT``) can only
  be recomputed, so ``s`` lies past it.

``plan`` is one ``jax.jit`` function over padded arrays (vmapped over requests and shards,
fixed shapes by bucket): no Python loop over blocks. ``build_inputs`` and ``padding_inputs``
are the only builders of its inputs. The package re-exports the function as ``jaxkv.planning.plan``,
which hides this module behind it there: import names from it
(``from jaxkv.planning.plan import plan, build_inputs``), not the module from the package.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import buckets
from jaxkv.planning.costs import LINKS, CostArrays
from jaxkv.manager.index import Tier

# Tier codes in plan inputs: ``jaxkv.Tier`` values (HOT = on this shard's device pool).
HOT, HOST, DISK, REMOTE, SHARD, ABSENT, POOL = (int(t) for t in (
    Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE, Tier.SHARD, Tier.ABSENT, Tier.POOL))
NUM_TIERS = len(Tier)
DECISIONS = ("fetch", "recompute", "split")  # Plan.decision indexes this


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PlanInputs:
  """Padded inputs: R requests x D candidate shards x M blocks (a bucket)."""

  tiers: jax.Array  # [R, D, M] int32: a jaxkv.Tier per block (DEVICE = hot, ABSENT = nowhere)
  block_bytes: jax.Array  # [R, D, M] float32 bytes a fetch of the block moves
  hot: jax.Array  # [R, D] int32 leading blocks resident on the shard's device pool
  cached_end: jax.Array  # [R, D] int32 end of the cached chain (hot <= cached_end)
  tail_tokens: jax.Array  # [R] int32 tokens computed after the cached chain in any case
  free_pages: jax.Array  # [D] int32 device pages free for staging fetched blocks
  inflight_blocks: jax.Array  # [D] int32 most blocks a shard may have in flight
  link_group: jax.Array  # [D] int32 shards with equal values share one host's links
  valid: jax.Array  # [R] bool, False for padding requests
  page_size: int = dataclasses.field(metadata=dict(static=True))
  # Prefill runs in chunks of this many tokens: n tokens cost ceil(n / chunk) chunks
  # (0: no rounding). Recomputing one block can cost a whole chunk.
  chunk_tokens: int = dataclasses.field(default=0, metadata=dict(static=True))
  # Narrower steps a partial last chunk runs in (``buckets.prefill_widths``): n tokens
  # cost their whole chunks plus the narrowest of these (or a chunk) holding the rest.
  tail_widths: tuple = dataclasses.field(default=(), metadata=dict(static=True))
  # [R] int32: the data shard whose device computes the request when that is already
  # decided (a step's plan over placed requests), -1 (or None for all) when the plan
  # chooses it among the D candidates. Requests share compute only on one device.
  compute_group: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Plan:
  split: jax.Array  # [R, D] int32 s*: blocks [hot, s*) recomputed, [s*, cached_end) fetched
  fetch_blocks: jax.Array  # [R, D, NUM_TIERS] int32 blocks fetched, indexed by tier code
  t_pred_s: jax.Array  # [R, D] predicted time of the chosen plan (incl. the tail prefill)
  t_fetch_all_s: jax.Array  # [R, D] fetch everything cached (s = hot), plus tail
  t_recompute_all_s: jax.Array  # [R, D] recompute everything (s = cached_end), plus tail
  # [R, D] the chosen plan's parts: its recompute of [hot, s*) (with the other requests'
  # recompute on the shard), its fetch of [s*, cached_end), and the tail prefill after them
  # (t_pred_s = both(recompute, fetch) + tail).
  t_recompute_s: jax.Array
  t_fetch_s: jax.Array
  t_tail_s: jax.Array
  decision: jax.Array  # [R, D] int32 index into DECISIONS
  best_shard: jax.Array  # [R] int32 shard with the lowest predicted time
  # [R, D, 2] seconds of compute the other requests placed on the shard add: their
  # recompute (runs beside this request's recompute) and their tail prefill.
  others_s: jax.Array
  link_users: jax.Array  # [D, links] requests whose fetches share each link of the shard


def _charged(n, chunk_tokens, tail_widths):
  """Tokens a prefill of ``n`` pays for: whole chunks, and the narrowest step that holds
  what is left."""
  full = jnp.floor(n / chunk_tokens) * chunk_tokens
  rest = n - full
  step = jnp.full_like(rest, chunk_tokens)
  for w in sorted(set(tail_widths), reverse=True):  # the narrowest that holds the rest
    step = jnp.where(rest <= w, jnp.float32(w), step)
  return full + jnp.where(rest > 0, step, 0.0)


def _prefill_s(prefill, n, c, chunk_tokens=0, tail_widths=()):
  if chunk_tokens:
    n = _charged(n, chunk_tokens, tail_widths)
  t = prefill[0] + prefill[1] * n + prefill[2] * n * (c + (n - 1.0) / 2.0)
  return jnp.where(n > 0, t, 0.0)


def _plan_one(tiers, block_bytes, hot, end, tail_tokens, budget, share, others, costs,
              page_size, chunk_tokens, tail_widths):
  """One (request, shard): every split point at once. share: [links] users of each link;
  others: [2] seconds of the other requests' recompute and tail prefill on this shard."""
  m = tiers.shape[0]
  idx = jnp.arange(m + 1, dtype=jnp.int32)  # candidate split points s
  blk = jnp.arange(m, dtype=jnp.int32)
  in_cold = (blk >= hot) & (blk < end)
  per_tier = [jnp.where(in_cold & (tiers == t), block_bytes, 0.0)
              for t in (HOST, DISK, REMOTE, SHARD, POOL)]
  # suffix[s] = bytes of blocks [s, m) (zeros outside the cold range already)
  suffix = lambda x: jnp.concatenate([jnp.cumsum(x[::-1])[::-1], jnp.zeros((1,), x.dtype)])
  host_b, disk_b, remote_b, shard_b, pool_b = (suffix(x) for x in per_tier)
  link_bytes = jnp.stack([host_b + disk_b + remote_b + pool_b, disk_b, remote_b, shard_b,
                          pool_b])
  rate = costs.bytes_per_s[:, None] / jnp.maximum(share[:, None], 1.0)
  link_t = jnp.where(link_bytes > 0, costs.latency_s[:, None] + link_bytes / rate, 0.0)
  t_fetch = jnp.max(link_t, axis=0)  # pipeline: the slowest link decides
  ps = jnp.float32(page_size)
  t_rec = _prefill_s(costs.prefill, (idx - hot).astype(jnp.float32) * ps,
                     hot.astype(jnp.float32) * ps, chunk_tokens, tail_widths)
  t_tail = _prefill_s(costs.prefill, tail_tokens.astype(jnp.float32),
                      end.astype(jnp.float32) * ps, chunk_tokens, tail_widths)
  # A block cached nowhere (ABSENT) inside the range can only be recomputed: every
  # split point before it is infeasible.
  absent = suffix(jnp.where(in_cold & (tiers == ABSENT), 1.0, 0.0))
  feasible = (idx >= hot) & (idx <= end) & (end - idx <= budget) & (absent == 0)
  # The shard's compute is shared like a link: this request's recompute runs in the same
  # batched steps as the other requests' recompute, and its tail prefill with their tails.
  # Both at once: the longer hides ``overlap`` of the shorter (the module's rule).
  both = lambda a, b: jnp.maximum(a, b) + (1.0 - costs.overlap) * jnp.minimum(a, b)
  cost = jnp.where(feasible, both(t_rec + others[0], t_fetch), jnp.inf)
  s = jnp.argmin(cost).astype(jnp.int32)  # first minimum: ties fetch more, compute less
  at = lambda x, i: x[jnp.clip(i, 0, m)]
  t_fetch_all = jnp.where((end - hot <= budget) & (at(absent, hot) == 0),
                          both(at(t_fetch, hot), others[0]), jnp.inf)
  counts = jnp.stack([jnp.sum((blk >= s) & (blk < end) & (tiers == t)).astype(jnp.int32)
                      if t in (HOST, DISK, REMOTE, SHARD, POOL) else jnp.int32(0)
                      for t in range(NUM_TIERS)])
  decision = jnp.where(s >= end, 1, jnp.where(s <= hot, 0, 2)).astype(jnp.int32)
  # What this request adds to the shard's compute at its split (one fixed step overhead
  # t0 is shared, so only the marginal part counts).
  marginal = lambda t: jnp.where(t > 0, t - costs.prefill[0], 0.0)
  work = jnp.stack([marginal(at(t_rec, s)), marginal(t_tail)])
  tail = t_tail + others[1]
  parts = jnp.stack([at(t_rec, s) + others[0], at(t_fetch, s), tail])
  return (s, counts, at(cost, s) + tail, t_fetch_all + tail, at(t_rec, end) + others[0] + tail,
          decision, work, parts)


def _plan_all(inputs: PlanInputs, costs: CostArrays, share, others):
  """share: [R, D, links]; others: [R, D, 2]."""
  budget = jnp.minimum(inputs.inflight_blocks, inputs.free_pages)  # [D]
  f = jax.vmap(jax.vmap(_plan_one, in_axes=(0, 0, 0, 0, None, 0, 0, 0, None, None, None, None)),
               in_axes=(0, 0, 0, 0, 0, None, 0, 0, None, None, None, None))
  return f(inputs.tiers, inputs.block_bytes, inputs.hot, inputs.cached_end, inputs.tail_tokens,
           budget, share, others, costs, inputs.page_size, inputs.chunk_tokens,
           inputs.tail_widths)


@jax.jit
def plan(inputs: PlanInputs, costs: CostArrays) -> Plan:
  """Chooses, per request and candidate shard, how to bring a cached prefix back.

  Two passes: the first assumes every link and every shard's compute is free; the
  requests that would fetch over a host's links (at their best shard) are counted, and the
  compute each request would add to its best shard is summed; the second divides each
  link's bandwidth between its users and charges every request, on every shard, the
  compute the other requests placed there need (recompute and tail prefill run in the
  same batched steps, so R requests' recompute costs what their total tokens cost).
  """
  r, d, _ = inputs.tiers.shape
  ones = jnp.ones((r, d, len(LINKS)), jnp.float32)
  s, counts, t_pred, _, _, _, work, _ = _plan_all(inputs, costs, ones,
                                                  jnp.zeros((r, d, 2), jnp.float32))
  t_pred = jnp.where(inputs.valid[:, None], t_pred, jnp.inf)
  best = jnp.argmin(t_pred, axis=1)
  group = (jnp.full((r,), -1, jnp.int32) if inputs.compute_group is None
           else inputs.compute_group)
  runs_on = jnp.where(group >= 0, group, best)  # [R] the device each request computes on
  device = jnp.where(group[:, None] >= 0, group[:, None], jnp.arange(d)[None, :])  # [R, D]
  work_best = jnp.take_along_axis(work, best[:, None, None], axis=1)[:, 0]  # [R, 2]
  same = ((runs_on[None, None, :] == device[:, :, None]) & inputs.valid[None, None, :]
          & ~jnp.eye(r, dtype=bool)[:, None, :])  # [R, D, R]: j shares i's device at d
  others = jnp.einsum("rdj,jk->rdk", same.astype(jnp.float32), work_best)  # [R, D, 2]
  fetches = jnp.take_along_axis(counts, best[:, None, None], axis=1)[:, 0]  # [R, 4]
  uses = jnp.stack([fetches[:, HOST] + fetches[:, DISK] + fetches[:, REMOTE]
                    + fetches[:, POOL] > 0, fetches[:, DISK] > 0, fetches[:, REMOTE] > 0,
                    fetches[:, SHARD] > 0, fetches[:, POOL] > 0],
                   axis=1) & inputs.valid[:, None]  # [R, links]
  group_of_req = inputs.link_group[best]  # [R]
  same = group_of_req[:, None] == inputs.link_group[None, :]  # [R, D]
  users = jnp.einsum("rd,rl->dl", same.astype(jnp.float32), uses.astype(jnp.float32))  # [D, L]
  share = jnp.broadcast_to(jnp.maximum(users, 1.0)[None], (r, d, len(LINKS)))
  s, counts, t_pred, t_fetch_all, t_rec_all, decision, _, parts = _plan_all(
      inputs, costs, share, others)
  t_pred_masked = jnp.where(inputs.valid[:, None], t_pred, jnp.inf)
  return Plan(split=s, fetch_blocks=counts, t_pred_s=t_pred, t_fetch_all_s=t_fetch_all,
              t_recompute_all_s=t_rec_all, t_recompute_s=parts[..., 0],
              t_fetch_s=parts[..., 1], t_tail_s=parts[..., 2], decision=decision,
              best_shard=jnp.argmin(t_pred_masked, axis=1).astype(jnp.int32),
              others_s=others, link_users=jnp.maximum(users, 1.0))


# ---- the only builders of PlanInputs ----------------------------------------------------------
def build_inputs(requests: Sequence[tuple[Sequence[Sequence[int]], int]], *, num_shards: int,
                 page_size: int, page_bytes: int, chunk_tokens: int = 0,
                 inflight_blocks: int = 0, devices: Sequence[int] | None = None,
                 tail_widths: tuple = ()) -> PlanInputs:
  """Plan inputs for requests, each ``(tiers_by_shard, prompt_tokens)``: the tier of every
  cached block of its chain on each candidate shard (``Tier.DEVICE`` = hot there; blocks
  after a shard's list are cached nowhere on it). A request's cached chain ends where its
  longest list ends; the tokens after it are prefilled whatever the plan.

  Padded to the plan's buckets (``buckets.plan_rows``); the staging and in-flight budgets
  are the padded block count unless ``inflight_blocks`` caps them. ``devices``: the data
  shard each request computes on when placement is done (requests on one shard share its
  compute); None when the plan chooses among the candidate shards.
  """
  r_pad = buckets.plan_rows(len(requests))
  ends = [max((len(t) for t in by_shard), default=0) for by_shard, _ in requests]
  m_pad = buckets.plan_rows(max(ends, default=0))
  tiers = np.full((r_pad, num_shards, m_pad), ABSENT, np.int32)
  hot = np.zeros((r_pad, num_shards), np.int32)
  end = np.zeros((r_pad, num_shards), np.int32)
  tail = np.zeros((r_pad,), np.int32)
  for i, ((by_shard, prompt_tokens), e) in enumerate(zip(requests, ends)):
    for s, ts in enumerate(by_shard):
      tiers[i, s, :len(ts)] = [int(t) for t in ts]
      hot[i, s] = next((j for j, t in enumerate(ts) if t != HOT), len(ts))
    end[i, :] = e
    tail[i] = prompt_tokens - e * page_size
  return PlanInputs(
      tiers=tiers, block_bytes=np.full(tiers.shape, page_bytes, np.float32), hot=hot,
      cached_end=end, tail_tokens=tail, free_pages=np.full((num_shards,), m_pad, np.int32),
      inflight_blocks=np.full((num_shards,), inflight_blocks or m_pad, np.int32),
      link_group=np.zeros((num_shards,), np.int32), valid=np.arange(r_pad) < len(requests),
      page_size=page_size, chunk_tokens=chunk_tokens, tail_widths=tuple(tail_widths),
      compute_group=None if devices is None else np.pad(
          np.asarray(devices, np.int32), (0, r_pad - len(requests)), constant_values=-1))


def padding_inputs(r_pad: int, m_pad: int, num_shards: int, *, page_size: int,
                   chunk_tokens: int = 0, placed: bool = False,
                   tail_widths: tuple = ()) -> PlanInputs:
  """All-padding inputs of one bucket (to compile it ahead of traffic). ``placed``: the
  bucket of a step's plan over placed requests (``compute_group`` set), not placement's."""
  z = lambda *shape: np.zeros(shape, np.int32)
  group = np.full((r_pad,), -1, np.int32) if placed else None
  return PlanInputs(
      tiers=np.full((r_pad, num_shards, m_pad), ABSENT, np.int32),
      block_bytes=np.zeros((r_pad, num_shards, m_pad), np.float32), hot=z(r_pad, num_shards),
      cached_end=z(r_pad, num_shards), tail_tokens=z(r_pad), free_pages=z(num_shards),
      inflight_blocks=z(num_shards), link_group=z(num_shards),
      valid=np.zeros((r_pad,), bool), page_size=page_size, chunk_tokens=chunk_tokens,
      tail_widths=tuple(tail_widths), compute_group=group)
