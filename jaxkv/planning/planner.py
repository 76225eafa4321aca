"""The decision over the plan: ``SchedulerConfig.decision`` applied to the requests of a step.

``Planner`` answers two questions, in the engine's plain Python types:
- ``splits``: per request, the split point ``s`` of its cached chain. Blocks ``[hot, s)``
  are recomputed, ``[s, end)`` fetched (``hot`` = the leading blocks already on device).
- ``shard_times``: the predicted time of one request on every data shard, when placement
  is not already decided by the longest prefix.

Decisions: ``cost`` runs the jitted ``jaxkv.planning.plan.plan`` on measured costs; ``fetch``,
``recompute``, ``threshold`` and ``split`` (a forced split point) are fixed rules that
need no costs, for comparison and tests.

``choices`` gives the same split points with what the plan predicted each part to take
(``SplitChoice``), so that a split can be timed against its prediction (``observe_split``).

Costs flow one way. The planner never measures: the engine gives it a ``CostModel``
(calibrated, or loaded from ``SchedulerConfig.cost_model_path``) by setting
``planner.costs`` before it plans; a ``cost`` decision without costs is a bug in the
engine, and ``ensure_costs`` raises. What the runner observes comes back as values
(``observe_fetch``, ``observe_recompute``, ``observe_split``) and refines the costs.
"""

from __future__ import annotations

import dataclasses
import time
import typing
from collections.abc import Callable

import jax
import numpy as np
from absl import logging

from jaxkv import buckets
from jaxkv.planning.costs import CostModel
from jaxkv.manager.index import Tier
from jaxkv.planning.plan import Plan, build_inputs, padding_inputs, plan
from jaxkv.scheduling.step import SplitChoice

if typing.TYPE_CHECKING:
  from jaxkv.scheduling.step import FetchReport


def plan_device() -> jax.Device:
  """Where the plan runs: this host's CPU backend. The plan is a few hundred bytes of
  integer work; on an accelerator it would queue behind the model's steps and every
  admission would wait for the device to drain before reading its answer back. Without a
  CPU backend (``JAX_PLATFORMS`` names only an accelerator) it runs on the default device."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return jax.local_devices()[0]


def run_on_host(inputs, arrays) -> Plan:
  """``plan`` on ``plan_device()``, so it compiles and runs on the host backend and its
  answer is read without a device round trip. Its inputs and costs are NumPy arrays, placed
  there by the call itself (``jax.default_device``): an explicit ``device_put`` of them
  first took as long again as the plan (0.27 against 0.19 ms on a 2-core EPYC), on every
  admission of a request with cold blocks."""
  with jax.default_device(plan_device()):
    return plan(inputs, arrays)


def plan_block_buckets(max_blocks: int) -> list[int]:
  """Every chain-length bucket (``buckets.plan_rows``) of chains up to ``max_blocks``."""
  top, m, out = buckets.plan_rows(max_blocks), buckets.MIN_PLAN_ROWS, []
  while m <= top:
    out.append(m)
    m *= 2
  return out


# The link a fetch is charged to: that of the deepest tier it reads (in a pipeline of links,
# the slowest one bounds the time).
_LINK_OF_TIER = ((Tier.REMOTE, "remote_to_host"), (Tier.DISK, "disk_to_host"),
                 (Tier.POOL, "pool_to_host"), (Tier.HOST, "host_to_device"),
                 (Tier.SHARD, "cross_shard"))


def link_of(tiers) -> str | None:
  """The link a fetch of blocks on ``tiers`` is timed on; None for none (device, absent)."""
  present = {int(t) for t in tiers}
  return next((link for tier, link in _LINK_OF_TIER if int(tier) in present), None)


class Planner:
  """Applies ``SchedulerConfig.decision``: which cached blocks of a step's requests are fetched
  and which recomputed, and which shard a request is cheapest on.

  ``costs``: the ``CostModel`` the ``cost`` decision plans with. None until the engine sets
  it (``planner.set_costs``), unless given here or loaded from ``cost_model_path``.
  """

  def __init__(self, config, costs: CostModel | None, *, num_shards: int, page_size: int,
               page_bytes: int, chunk_tokens: int, stats, tail_widths: tuple = (),
               share: Callable[[bytes], bytes] | None = None):
    self.config = config
    # In a multi-process job: process 0's bytes on every process (a collective,
    # ``distributed.broadcast_bytes``). What the plan learns is timed on each process; the
    # job learns process 0's timings, so that its processes keep one set of costs and make
    # the same plans (``agreed``).
    self.share = share
    if costs is None and config.cost_model_path:
      costs = CostModel.load(config.cost_model_path)
    self.costs = costs
    self.num_shards, self.page_size, self.page_bytes = num_shards, page_size, page_bytes
    self.chunk_tokens, self.tail_widths = chunk_tokens, tuple(tail_widths)
    self.stats = stats
    # Per link: requests since it was last timed whose plan recomputed blocks it holds.
    self.untimed: dict[str, int] = {}
    # Links a probe was planned for and not timed since: their next timing replaces the
    # estimate (gone stale while nothing crossed them) instead of averaging with it.
    self.probed: set[str] = set()

  def set_costs(self, costs: CostModel | None) -> None:
    """The costs to plan with from now on (calibrated, loaded or agreed by a job)."""
    self.costs = costs

  def ensure_costs(self) -> CostModel:
    """The costs to plan with. Their absence is the engine's bug (it sets them before any
    ``cost`` decision), not bad input, hence a RuntimeError."""
    if self.costs is None:
      raise RuntimeError(
          f"Planner.costs is None under decision={self.config.decision!r}, which plans from "
          "measured costs: the engine must set planner.costs (calibrate, or load "
          "SchedulerConfig.cost_model_path) before it plans or warms the plan.")
    return self.costs

  def fetch_pays(self, link: str, nbytes: float, tokens: int, context: int) -> bool:
    """Whether moving ``nbytes`` over ``link`` is predicted to take less than prefilling
    ``tokens`` after ``context`` cached (what a window group's blocks loaded from the pool
    save: the recompute of the cut they extend a hit by). Under a fixed decision: whether
    it fetches (``recompute`` never; the others do); with no costs yet, or none for
    ``link``, it fetches."""
    if self.config.decision != "cost":
      return self.config.decision != "recompute"
    costs = self.costs
    if costs is None or link not in costs.links:
      return True
    return costs.link(link).seconds(nbytes) < costs.prefill.seconds(tokens, context)

  def _run(self, requests, num_shards: int, devices=None) -> Plan:
    inputs = build_inputs(requests, num_shards=num_shards, page_size=self.page_size,
                          page_bytes=self.page_bytes, chunk_tokens=self.chunk_tokens,
                          tail_widths=self.tail_widths,
                          inflight_blocks=self.config.inflight_blocks, devices=devices)
    return run_on_host(inputs, self.ensure_costs().arrays())

  def shard_times(self, tiers_by_shard: list[list[Tier]], prompt_tokens: int
                  ) -> np.ndarray | None:
    """Predicted time of one request on every shard (``cost`` decision), or None when the
    longest prefix with the most of it on device decides anyway (no plan is run then).
    Also None while there are no costs yet: placement is a preference, and falls back to
    the longest prefix."""
    if (self.config.decision != "cost" or self.costs is None or self.num_shards == 1
        or all(t == Tier.DEVICE for ts in tiers_by_shard for t in ts)):
      return None
    longest = max(len(ts) for ts in tiers_by_shard)
    on_device = [sum(t == Tier.DEVICE for t in ts) for ts in tiers_by_shard]
    if any(len(ts) == longest and n == max(on_device)
           for ts, n in zip(tiers_by_shard, on_device)):
      return None
    t0 = time.perf_counter()
    out = jax.device_get(self._run([(tiers_by_shard, prompt_tokens)],
                                   self.num_shards).t_pred_s)[0]
    self.stats.add("plan_s", time.perf_counter() - t0)
    return out

  def splits(self, requests: list[tuple[list[Tier], int, int]]) -> list[int]:
    """Split point ``s`` of each request ``(tiers of its cached blocks, prompt tokens, data
    shard it runs on)``: blocks ``[hot, s)`` are recomputed, ``[s, end)`` fetched (``hot``
    = leading DEVICE). Requests on one shard share its compute in the plan."""
    return [c.split for c in self.choices(requests)]

  def choices(self, requests: list[tuple[list[Tier], int, int]]) -> list[SplitChoice]:
    """``splits``, each with what the plan predicted its parts to take."""
    hot = [next((j for j, t in enumerate(ts) if t != Tier.DEVICE), len(ts))
           for ts, _, _ in requests]
    out = [SplitChoice(h) for h in hot]
    cold = [i for i, (ts, _, _) in enumerate(requests) if len(ts) > hot[i]]
    if not cold:
      return out
    sc = self.config
    if sc.decision == "cost":
      t0 = time.perf_counter()
      result = self._run([([requests[i][0]], requests[i][1]) for i in cold], 1,
                         devices=[requests[i][2] for i in cold])
      chosen, rec, fetch, tail = (x[:len(cold), 0] for x in jax.device_get((
          result.split, result.t_recompute_s, result.t_fetch_s, result.t_tail_s)))
      self.stats.add("plan_s", time.perf_counter() - t0)
    for k, i in enumerate(cold):
      h, end = hot[i], len(requests[i][0])
      if sc.decision == "cost":
        s = int(chosen[k])
      elif sc.decision == "fetch":
        s = h
      elif sc.decision == "recompute":
        s = end
      elif sc.decision == "threshold":
        s = h if (end - h) * self.page_size >= sc.threshold_tokens else end
      else:  # "split": forced
        s = min(h + sc.force_split, end)
      probe = sc.decision == "cost" and s == end and self._probes(requests[i][0][h:end])
      if probe:  # (its last blocks: those _probes looked at)
        s = end - min(end - h, sc.probe_blocks, sc.inflight_blocks or sc.probe_blocks)
      out[i] = (SplitChoice(s, float(rec[k]), float(fetch[k]), float(tail[k]))
                if sc.decision == "cost" and not probe else SplitChoice(s))
      outcome = "probe" if probe else "recompute" if s == end else "fetch" if s == h else "split"
      self.stats.add("plans_" + outcome)
      logging.debug("plan (decision %s): %d cold blocks, %s: recompute %d, fetch %d",
                    sc.decision, end - h, outcome, s - h, end - s)
    return out

  def _probes(self, cold: list[Tier]) -> bool:
    """Whether a request whose plan recomputes its ``cold`` blocks fetches its last
    ``probe_blocks`` instead, to time their link again. A link the plan stopped using (it
    was slow once) is timed by nothing else, and a link that got faster would never be used
    again: after ``probe_every`` such requests, one fetches a few of its blocks while it
    recomputes the rest. Counted in requests planned, so every process of a job probes at
    the same request."""
    sc = self.config
    n = min(sc.probe_blocks, sc.inflight_blocks or sc.probe_blocks)
    tail = cold[-n:] if sc.probe_every and n else []
    link = link_of(tail)
    if link is None or any(t in (Tier.DEVICE, Tier.ABSENT) for t in tail):
      return False
    recomputed = self.untimed.get(link, 0)
    if recomputed < sc.probe_every:
      self.untimed[link] = recomputed + 1
      return False
    self.untimed[link] = 0
    self.probed.add(link)
    return True

  def warm(self, max_blocks: int, max_requests: int) -> None:
    """Compiles every bucket the plan can meet: placement (one request on every shard) and
    steps of up to ``max_requests`` requests, for chains of up to ``max_blocks`` blocks
    (every ``buckets.plan_rows`` bucket: a short chain is its own shape)."""
    arrays = self.ensure_costs().arrays()
    ms = plan_block_buckets(max_blocks)
    pad = lambda r, m, d, placed: jax.block_until_ready(run_on_host(padding_inputs(
        r, m, d, page_size=self.page_size, chunk_tokens=self.chunk_tokens, placed=placed,
        tail_widths=self.tail_widths), arrays))
    for m in ms:
      pad(buckets.MIN_PLAN_ROWS, m, self.num_shards, False)
    r = buckets.MIN_PLAN_ROWS
    while True:
      for m in ms:
        pad(r, m, 1, True)
      if r >= max_requests:
        break
      r *= 2

  def agreed(self, *seconds: float) -> tuple[float, ...]:
    """``seconds`` as process 0 timed them, where a job's plan learns from them (``cost``
    with costs; a collective then: every process calls it at the same point of the same
    step, before anything branches on the values); else as given."""
    if self.share is None or self.config.decision != "cost" or self.costs is None:
      return seconds
    got = self.share(np.asarray(seconds, np.float64).tobytes())
    return tuple(np.frombuffer(got, np.float64).tolist())

  def agreed_report(self, report: FetchReport) -> FetchReport:
    """``report`` with its times as process 0 took them (``agreed``)."""
    seconds, latency = self.agreed(report.seconds, report.latency_s)
    return dataclasses.replace(report, seconds=seconds, latency_s=latency)

  def observe_fetch(self, report: FetchReport) -> None:
    """Learns a link's bandwidth from a fetch the runner finished. The whole transfer is
    charged to the link of the deepest tier it read (remote, then disk, then the pool, then host; else
    another shard): in a pipeline of links, the slowest one bounds the time."""
    link = link_of(report.tiers) or "cross_shard"
    # (before the early return: a job's processes see the same fetches, not the same bytes,
    # and must probe at the same request)
    self.untimed.pop(link, None)
    if self.costs is None or not report.bytes or report.seconds <= 0:
      return  # nothing moved, or a transfer that was not timed
    stale = link in self.probed  # (a probe's timing: what was known is from before)
    self.probed.discard(link)
    self.costs.observe_transfer(link, report.bytes, report.seconds,
                                latency_s=report.latency_s or None, weight=1.0 if stale else None)

  def observe_recompute(self, tokens: int, context: int, seconds: float) -> None:
    """Refines the prefill curve from a recompute that was timed (in a job, as process 0
    timed it)."""
    (seconds,) = self.agreed(seconds)
    if self.costs is not None:
      self.costs.observe_prefill(tokens, context, seconds)

  def observe_split(self, choice: SplitChoice, fetch_s: float, seconds: float) -> None:
    """Learns how much of a split's recompute and fetch overlapped, from a split that ran
    alone and fetched every block it planned to: its fetch took ``fetch_s`` (the report's
    time, to when the bytes arrived where the tier says so) and the request ``seconds``
    from its placing to its first token, of which the plan's predicted tail prefill is
    the rest; its recompute is taken as predicted. (The fetch as timed, not as predicted:
    a link slower than its estimate would otherwise be taken for recompute and fetch that
    did not overlap, and the plan would stop splitting, and so stop timing the link, just
    when it needs to learn it. Only a split: a request that recomputed or fetched nothing
    overlapped nothing.) In a job, the times as process 0 took them."""
    fetch_s, seconds = self.agreed(fetch_s, seconds)
    if self.costs is None or choice.recompute_s <= 0 or choice.fetch_s <= 0 or fetch_s <= 0:
      return
    self.costs.observe_split(choice.recompute_s, fetch_s, seconds - choice.tail_s)
    self.stats.add("splits_timed")
