"""Costs measured on this machine, and the jitted plan that decides fetch / recompute / split.

The decision (per request r and candidate data shard d)
  A request's first ``h`` blocks are hot on the shard's device pool; blocks ``[h, e)`` are
  cached in lower tiers (host, disk, remote); anything after ``e`` must be computed anyway.
  For a split point ``s`` in ``[h, e]`` jaxkv recomputes blocks ``[h, s)`` while it fetches
  blocks ``[s, e)``, in parallel, then prefills the rest:

    t(s) = max(t_recompute(h..s), t_fetch(s..e)) + t_prefill(rest | e)
    s*   = argmin_s t(s)         (s = h: fetch everything; s = e: recompute everything)

  so a plan is never predicted worse than either pure policy.
- ``t_recompute(h..s)`` is the measured prefill curve for ``n = (s-h)*page_size`` tokens
  on a cached context of ``c = h*page_size`` tokens:
  ``t0 + a*n + b*n*(c + (n-1)/2)`` — attention makes it grow faster than linearly.
- ``t_fetch(s..e)`` charges every link the bytes it carries (host->device carries every
  fetched block; disk->host the disk ones; remote->host the remote ones) and takes the
  slowest link: the links form a pipeline, not a sum. A link shared by several requests
  (one host's PCIe) splits its bandwidth between the requests that use it.
- Capacity: a shard fetches at most ``min(in-flight budget, free staging pages)`` blocks;
  the rest is recomputed (``s >= e - budget``).

Costs come from ``CostModel``: calibrated on the machine (``calibrate``), saved/loaded as
JSON, and updated from observed transfers and prefills (EWMA). No cost is a constant in
code. ``plan`` is one ``jax.jit`` function over padded arrays (vmapped over requests and
shards, fixed shapes by bucket): no Python loop over blocks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from jaxkv import buckets
from jaxkv.distributed import to_host
from jaxkv.index import Tier
from jaxkv.errors import InputError

# Tier codes in plan inputs: ``jaxkv.Tier`` values (HOT = on this shard's device pool).
HOT, HOST, DISK, REMOTE, SHARD, ABSENT = (int(t) for t in (
    Tier.DEVICE, Tier.HOST, Tier.DISK, Tier.REMOTE, Tier.SHARD, Tier.ABSENT))
LINKS = ("host_to_device", "disk_to_host", "remote_to_host", "cross_shard")
DECISIONS = ("fetch", "recompute", "split")


@dataclasses.dataclass(frozen=True)
class LinkCost:
  latency_s: float
  bytes_per_s: float

  def __post_init__(self):
    if not (self.latency_s >= 0 and self.bytes_per_s > 0):
      raise InputError(f"LinkCost latency_s={self.latency_s} must be >= 0 and bytes_per_s="
                       f"{self.bytes_per_s} > 0.")

  def seconds(self, nbytes: float) -> float:
    return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class PrefillCurve:
  """``t(n, c) = t0 + a*n + b*n*(c + (n-1)/2)`` seconds for n > 0 tokens after c cached."""

  t0_s: float
  per_token_s: float
  per_token_context_s: float

  def seconds(self, n: float, c: float) -> float:
    if n <= 0:
      return 0.0
    return self.t0_s + self.per_token_s * n + self.per_token_context_s * n * (c + (n - 1) / 2)

  @staticmethod
  def fit(samples: list[tuple[float, float, float]]) -> "PrefillCurve":
    """Least-squares fit to ``(n, c, seconds)`` samples (coefficients kept >= 0)."""
    a = np.array([[1.0, n, n * (c + (n - 1) / 2)] for n, c, _ in samples])
    y = np.array([t for _, _, t in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    if coef[1] == 0 and coef[2] == 0:  # degenerate: fall back to a pure per-token rate
      coef[1] = float(np.sum(y) / max(np.sum(a[:, 1]), 1.0))
    return PrefillCurve(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclasses.dataclass
class CostModel:
  """Link costs and the prefill curve for one machine, model and config."""

  links: dict  # name -> LinkCost
  prefill: PrefillCurve
  ewma: float = 0.2  # weight of a new observation
  source: str = "calibrated"

  def __post_init__(self):
    unknown = set(self.links) - set(LINKS)
    if unknown:
      raise InputError(f"CostModel links {sorted(unknown)} are not among {LINKS}.")
    if not 0 < self.ewma <= 1:
      raise InputError(f"CostModel.ewma={self.ewma} must be in (0, 1].")

  def link(self, name: str) -> LinkCost:
    if name not in self.links:
      raise InputError(f"CostModel has no cost for link {name!r}; calibrate it or set it "
                       f"(links known: {sorted(self.links)}).")
    return self.links[name]

  # ---- learning from what happened -----------------------------------------------------------
  def observe_transfer(self, name: str, nbytes: float, seconds: float) -> None:
    """EWMA update of a link's bandwidth from one observed transfer."""
    if nbytes <= 0 or seconds <= 0:
      return
    if name not in self.links:
      self.links[name] = LinkCost(0.0, nbytes / seconds)
      return
    old = self.links[name]
    rate = nbytes / max(seconds - old.latency_s, seconds * 0.1)
    new_rate = (1 - self.ewma) * old.bytes_per_s + self.ewma * rate
    self.links[name] = LinkCost(old.latency_s, new_rate)

  def observe_prefill(self, n: float, c: float, seconds: float) -> None:
    """EWMA update of the prefill curve's scale from one observed prefill."""
    predicted = self.prefill.seconds(n, c)
    if n <= 0 or seconds <= 0 or predicted <= 0:
      return
    scale = (1 - self.ewma) + self.ewma * (seconds / predicted)
    p = self.prefill
    self.prefill = PrefillCurve(p.t0_s * scale, p.per_token_s * scale,
                                p.per_token_context_s * scale)

  # ---- persistence ---------------------------------------------------------------------------
  def to_json(self) -> str:
    return json.dumps({
        "links": {k: dataclasses.asdict(v) for k, v in sorted(self.links.items())},
        "prefill": dataclasses.asdict(self.prefill), "ewma": self.ewma, "source": self.source,
    }, indent=2, sort_keys=True)

  @staticmethod
  def from_json(text: str) -> "CostModel":
    d = json.loads(text)
    return CostModel(links={k: LinkCost(**v) for k, v in d["links"].items()},
                     prefill=PrefillCurve(**d["prefill"]), ewma=d.get("ewma", 0.2),
                     source=d.get("source", "file"))

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @staticmethod
  def load(path: str) -> "CostModel":
    try:
      with open(path) as f:
        return CostModel.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise InputError(f"cannot read a CostModel from {path!r}: {e}") from None

  # ---- for the jitted plan -------------------------------------------------------------------
  def arrays(self) -> "CostArrays":
    lat, rate = [], []
    for name in LINKS:
      link = self.links.get(name)
      if link is None and name in ("remote_to_host", "cross_shard"):
        # Until a transfer over this link has been observed, a block over it is assumed
        # to cost what a host block does; the first observation replaces this.
        link = self.links.get("host_to_device")
      lat.append(link.latency_s if link else 0.0)
      rate.append(link.bytes_per_s if link else 1.0)  # absent link: unused (no bytes)
    p = self.prefill
    return CostArrays(latency_s=jnp.asarray(lat, jnp.float32),
                      bytes_per_s=jnp.asarray(rate, jnp.float32),
                      prefill=jnp.asarray([p.t0_s, p.per_token_s, p.per_token_context_s],
                                          jnp.float32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CostArrays:
  latency_s: jax.Array  # [links]
  bytes_per_s: jax.Array  # [links]
  prefill: jax.Array  # [3]: t0, per token, per token x context


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
  fetch_blocks: jax.Array  # [R, D, 6] int32 blocks fetched, indexed by tier code
  t_pred_s: jax.Array  # [R, D] predicted time of the chosen plan (incl. the tail prefill)
  t_fetch_all_s: jax.Array  # [R, D] fetch everything cached (s = hot), plus tail
  t_recompute_all_s: jax.Array  # [R, D] recompute everything (s = cached_end), plus tail
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
              for t in (HOST, DISK, REMOTE, SHARD)]
  # suffix[s] = bytes of blocks [s, m) (zeros outside the cold range already)
  suffix = lambda x: jnp.concatenate([jnp.cumsum(x[::-1])[::-1], jnp.zeros((1,), x.dtype)])
  host_b, disk_b, remote_b, shard_b = (suffix(x) for x in per_tier)
  link_bytes = jnp.stack([host_b + disk_b + remote_b, disk_b, remote_b, shard_b])
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
  cost = jnp.where(feasible, jnp.maximum(t_rec + others[0], t_fetch), jnp.inf)
  s = jnp.argmin(cost).astype(jnp.int32)  # first minimum: ties fetch more, compute less
  at = lambda x, i: x[jnp.clip(i, 0, m)]
  t_fetch_all = jnp.where((end - hot <= budget) & (at(absent, hot) == 0),
                          jnp.maximum(at(t_fetch, hot), others[0]), jnp.inf)
  counts = jnp.stack([jnp.sum((blk >= s) & (blk < end) & (tiers == t)).astype(jnp.int32)
                      if t in (HOST, DISK, REMOTE, SHARD) else jnp.int32(0)
                      for t in range(6)])
  decision = jnp.where(s >= end, 1, jnp.where(s <= hot, 0, 2)).astype(jnp.int32)
  # What this request adds to the shard's compute at its split (one fixed step overhead
  # t0 is shared, so only the marginal part counts).
  marginal = lambda t: jnp.where(t > 0, t - costs.prefill[0], 0.0)
  work = jnp.stack([marginal(at(t_rec, s)), marginal(t_tail)])
  tail = t_tail + others[1]
  return (s, counts, at(cost, s) + tail, t_fetch_all + tail, at(t_rec, end) + others[0] + tail,
          decision, work)


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
  s, counts, t_pred, _, _, _, work = _plan_all(inputs, costs, ones,
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
  uses = jnp.stack([fetches[:, HOST] + fetches[:, DISK] + fetches[:, REMOTE] > 0,
                    fetches[:, DISK] > 0, fetches[:, REMOTE] > 0, fetches[:, SHARD] > 0],
                   axis=1) & inputs.valid[:, None]  # [R, links]
  group_of_req = inputs.link_group[best]  # [R]
  same = group_of_req[:, None] == inputs.link_group[None, :]  # [R, D]
  users = jnp.einsum("rd,rl->dl", same.astype(jnp.float32), uses.astype(jnp.float32))  # [D, L]
  share = jnp.broadcast_to(jnp.maximum(users, 1.0)[None], (r, d, len(LINKS)))
  s, counts, t_pred, t_fetch_all, t_rec_all, decision, _ = _plan_all(inputs, costs, share,
                                                                      others)
  t_pred_masked = jnp.where(inputs.valid[:, None], t_pred, jnp.inf)
  return Plan(split=s, fetch_blocks=counts, t_pred_s=t_pred, t_fetch_all_s=t_fetch_all,
              t_recompute_all_s=t_rec_all, decision=decision,
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
  """All-padding inputs of one bucket (to compile it ahead of traffic)."""
  z = lambda *shape: np.zeros(shape, np.int32)
  return PlanInputs(
      tiers=np.full((r_pad, num_shards, m_pad), ABSENT, np.int32),
      block_bytes=np.zeros((r_pad, num_shards, m_pad), np.float32), hot=z(r_pad, num_shards),
      cached_end=z(r_pad, num_shards), tail_tokens=z(r_pad), free_pages=z(num_shards),
      inflight_blocks=z(num_shards), link_group=z(num_shards),
      valid=np.zeros((r_pad,), bool), page_size=page_size, chunk_tokens=chunk_tokens,
      tail_widths=tuple(tail_widths), compute_group=np.full((r_pad,), -1, np.int32) if placed else None)


class Planner:
  """Applies ``SchedulerConfig.policy`` to the requests of a step: which of their cached
  blocks are fetched and which recomputed, and which shard a request is cheapest on.

  The ``cost`` policy runs ``plan`` on costs measured on this machine: calibrated on first
  use (``calibrate``, a callable the engine gives) unless a ``CostModel`` was given or
  loaded, then refined by what the executor observes.
  """

  def __init__(self, config, costs: "CostModel | None", *, num_shards: int, page_size: int,
               page_bytes: int, chunk_tokens: int, stats, calibrate,
               tail_widths: tuple = ()):
    self.config = config
    if costs is None and config.cost_model_path:
      costs = CostModel.load(config.cost_model_path)
    self.costs = costs
    self.num_shards, self.page_size, self.page_bytes = num_shards, page_size, page_bytes
    self.chunk_tokens, self.tail_widths = chunk_tokens, tuple(tail_widths)
    self.stats = stats
    self._calibrate = calibrate

  def ensure_costs(self) -> CostModel:
    if self.costs is None:
      t0 = time.perf_counter()
      self.costs = self._calibrate()
      self.stats.add("calibration_s", time.perf_counter() - t0)
    return self.costs

  def _run(self, requests, num_shards: int, devices=None) -> Plan:
    inputs = build_inputs(requests, num_shards=num_shards, page_size=self.page_size,
                          page_bytes=self.page_bytes, chunk_tokens=self.chunk_tokens,
                          tail_widths=self.tail_widths, inflight_blocks=self.config.inflight_blocks, devices=devices)
    return plan(inputs, self.costs.arrays())

  def shard_times(self, tiers_by_shard: list[list[Tier]], prompt_tokens: int
                  ) -> np.ndarray | None:
    """Predicted time of one request on every shard (``cost`` policy), or None when the
    longest prefix with the most of it on device decides anyway (no plan is run then)."""
    if (self.config.policy != "cost" or self.costs is None or self.num_shards == 1
        or all(t == Tier.DEVICE for ts in tiers_by_shard for t in ts)):
      return None
    longest = max(len(ts) for ts in tiers_by_shard)
    on_device = [sum(t == Tier.DEVICE for t in ts) for ts in tiers_by_shard]
    if any(len(ts) == longest and n == max(on_device)
           for ts, n in zip(tiers_by_shard, on_device)):
      return None
    t0 = time.perf_counter()
    out = to_host(self._run([(tiers_by_shard, prompt_tokens)], self.num_shards).t_pred_s)[0]
    self.stats.add("plan_s", time.perf_counter() - t0)
    return out

  def splits(self, requests: list[tuple[list[Tier], int, int]]) -> list[int]:
    """Split point ``s`` of each request ``(tiers of its cached blocks, prompt tokens, data
    shard it runs on)``: blocks ``[hot, s)`` are recomputed, ``[s, end)`` fetched (``hot``
    = leading DEVICE). Requests on one shard share its compute in the plan."""
    hot = [next((j for j, t in enumerate(ts) if t != Tier.DEVICE), len(ts))
           for ts, _, _ in requests]
    out = list(hot)
    cold = [i for i, (ts, _, _) in enumerate(requests) if len(ts) > hot[i]]
    if not cold:
      return out
    pol = self.config
    if pol.policy == "cost":
      self.ensure_costs()
      t0 = time.perf_counter()
      result = self._run([([requests[i][0]], requests[i][1]) for i in cold], 1,
                         devices=[requests[i][2] for i in cold])
      chosen = to_host(result.split)[:len(cold), 0]
      self.stats.add("plan_s", time.perf_counter() - t0)
    for k, i in enumerate(cold):
      h, end = hot[i], len(requests[i][0])
      if pol.policy == "cost":
        s = int(chosen[k])
      elif pol.policy == "fetch":
        s = h
      elif pol.policy == "recompute":
        s = end
      elif pol.policy == "threshold":
        s = h if (end - h) * self.page_size >= pol.threshold_tokens else end
      else:  # "split": forced
        s = min(h + pol.force_split, end)
      out[i] = s
      decision = "recompute" if s == end else "fetch" if s == h else "split"
      self.stats.add("plans_" + decision)
      logging.debug("plan (%s): %d cold blocks, %s: recompute %d, fetch %d", pol.policy,
                    end - h, decision, s - h, end - s)
    return out

  def warm(self, block_counts: list[int], max_requests: int) -> None:
    """Compiles the plan's buckets: placement (one request on every shard) and steps of up
    to ``max_requests`` requests, for chains of ``block_counts`` blocks."""
    self.ensure_costs()
    ms = sorted({buckets.plan_rows(m) for m in block_counts})
    arrays = self.costs.arrays()
    pad = lambda r, m, d, placed: jax.block_until_ready(plan(padding_inputs(
        r, m, d, page_size=self.page_size, chunk_tokens=self.chunk_tokens, placed=placed,
        tail_widths=self.tail_widths),
        arrays))
    for m in ms:
      pad(buckets.MIN_PLAN_ROWS, m, self.num_shards, False)
    r = buckets.MIN_PLAN_ROWS
    while True:
      for m in ms:
        pad(r, m, 1, True)
      if r >= max_requests:
        break
      r *= 2

  def observe_fetch(self, last_fetch: dict) -> None:
    """Learns a link's bandwidth from the fetch the executor just finished."""
    if self.costs is None or not last_fetch.get("bytes"):
      return
    tiers = last_fetch["tiers"]
    link = ("remote_to_host" if int(Tier.REMOTE) in tiers else
            "disk_to_host" if int(Tier.DISK) in tiers else
            "host_to_device" if int(Tier.HOST) in tiers else "cross_shard")
    self.costs.observe_transfer(link, last_fetch["bytes"], last_fetch["seconds"])

  def observe_recompute(self, tokens: int, context: int, seconds: float) -> None:
    if self.costs is not None:
      self.costs.observe_prefill(tokens, context, seconds)


def brute_force(tiers, block_bytes, hot, end, tail_tokens, budget, share, cost_model: CostModel,
                page_size: int, chunk_tokens: int = 0, others=(0.0, 0.0),
                tail_widths: tuple = ()) -> tuple[int, float]:
  """The same decision for one (request, shard) by trying every split in Python (tests).
  ``others``: seconds of the other requests' recompute and tail on the shard."""

  def rounded(n):  # whole chunks, then the narrowest step holding the rest
    if not chunk_tokens:
      return n
    full, rest = (n // chunk_tokens) * chunk_tokens, n % chunk_tokens
    return full + (min([w for w in tail_widths if w >= rest] + [chunk_tokens]) if rest else 0)
  link_names = LINKS
  best_s, best_t = None, math.inf
  for s in range(hot, end + 1):
    if end - s > budget or any(int(tiers[b]) == ABSENT for b in range(s, end)):
      continue
    link_bytes = dict.fromkeys(link_names, 0.0)
    for b in range(s, end):
      t = int(tiers[b])
      if t in (HOST, DISK, REMOTE):
        link_bytes["host_to_device"] += float(block_bytes[b])
      if t == DISK:
        link_bytes["disk_to_host"] += float(block_bytes[b])
      if t == REMOTE:
        link_bytes["remote_to_host"] += float(block_bytes[b])
      if t == SHARD:
        link_bytes["cross_shard"] += float(block_bytes[b])
    t_fetch = 0.0
    for i, name in enumerate(link_names):
      if link_bytes[name] > 0:
        link = cost_model.links[name]
        t_fetch = max(t_fetch, link.latency_s
                      + link_bytes[name] / (link.bytes_per_s / max(share[i], 1.0)))
    t_rec = cost_model.prefill.seconds(rounded((s - hot) * page_size), hot * page_size)
    t = max(t_rec + others[0], t_fetch)
    if t < best_t - 1e-12 * max(1.0, t):
      best_s, best_t = s, t
  tail = cost_model.prefill.seconds(rounded(tail_tokens), end * page_size)
  return best_s, best_t + tail + others[1]


def capacity_plan(*, kv_bytes: float, tokens: int, costs: CostModel, requests: int = 1,
                  page_size: int = 16, context_tokens: int = 0, tier: int = HOST) -> dict:
  """What ``plan`` decides for ``requests`` equal requests in one step, sharing one host's
  links and one device's compute, each with ``tokens / requests`` cold tokens
  (``kv_bytes / requests`` bytes) after ``context_tokens`` hot ones. Returns the figures
  ``launch/plan.py`` reports: the step's time if every request fetched everything, if
  every one recomputed everything, and with the plan's split (``t_split_s``)."""
  if requests < 1 or tokens < requests or kv_bytes <= 0:
    raise InputError(f"need requests >= 1, tokens >= requests and kv_bytes > 0; got "
                     f"requests={requests}, tokens={tokens}, kv_bytes={kv_bytes}.")
  per_tokens = tokens // requests
  blocks = max(1, -(-per_tokens // page_size))
  hot = context_tokens // page_size
  m = hot + blocks
  tiers = np.full((requests, 1, m), tier, np.int32)
  tiers[:, :, :hot] = HOT
  bytes_per_block = kv_bytes / requests / blocks
  inputs = PlanInputs(
      tiers=tiers, block_bytes=np.full(tiers.shape, bytes_per_block, np.float32),
      hot=np.full((requests, 1), hot, np.int32), cached_end=np.full((requests, 1), m, np.int32),
      tail_tokens=np.zeros((requests,), np.int32), free_pages=np.full((1,), m, np.int32),
      inflight_blocks=np.full((1,), m, np.int32), link_group=np.zeros((1,), np.int32),
      valid=np.ones((requests,), bool), page_size=page_size)
  out = jax.tree.map(np.asarray, plan(inputs, costs.arrays()))
  split_blocks = int(out.split[0, 0]) - hot
  # The two pure policies for the whole step: every request fetches everything (each link
  # carries all of their bytes) or recomputes everything (one device computes all).
  t_one = costs.prefill.seconds(blocks * page_size, hot * page_size)
  t_recompute = t_one + (requests - 1) * max(t_one - costs.prefill.t0_s, 0.0)
  links = ["host_to_device"] + {DISK: ["disk_to_host"], REMOTE: ["remote_to_host"]}.get(tier, [])
  t_fetch = max((costs.links.get(name) or costs.link("host_to_device")).seconds(kv_bytes)
                for name in links)
  return {
      "t_fetch_s": t_fetch,
      "t_recompute_s": t_recompute,
      "t_split_s": float(out.t_pred_s[0, 0]),
      "decision": DECISIONS[int(out.decision[0, 0])],
      "split_tokens": split_blocks * page_size,
      "fetch_tokens": (blocks - split_blocks) * page_size,
      "requests": requests, "tokens_per_request": per_tokens,
      "bytes_per_request": kv_bytes / requests,
  }


def stream_step_s(costs: CostModel, *, cold_pages: int, page_bytes: int, compute_s: float,
                  overlap: float = 1.0) -> float:
  """Predicted decode step of a streamed sequence: the attention compute and the transfer
  of its cold pages (host -> device) in parallel (``overlap=1``) or in series (0)."""
  link = costs.link("host_to_device")
  transfer = link.seconds(cold_pages * page_bytes)
  return max(compute_s, transfer) + (1.0 - overlap) * min(compute_s, transfer)


def choose_window(costs: CostModel, *, context_pages: int, device_pages: int, sink_pages: int,
                  page_bytes: int, compute_s: float, overlap: float = 1.0) -> dict:
  """Which window (pages kept on device) makes a streamed decode step fastest, within
  ``device_pages``. More window means fewer cold pages to stream each step."""
  best = None
  options = {}
  for window in range(1, max(1, device_pages - sink_pages) + 1):
    cold = max(0, context_pages - sink_pages - window)
    t = stream_step_s(costs, cold_pages=cold, page_bytes=page_bytes, compute_s=compute_s,
                      overlap=overlap)
    options[window] = t
    if best is None or t < options[best] - 1e-12:
      best = window
  return {"window_pages": best, "step_s": options[best],
          "all_streamed_s": options[min(options)], "options": options}
