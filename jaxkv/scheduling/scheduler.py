"""The step loop: every request, of every kind, advances through ``schedule`` and ``update``.

A request is submitted once (``add``) and from then on moves only through steps. Each step
the scheduler decides, and decides alone, what runs; the runner executes that decision and
reports back; the scheduler then updates its own state from the report:

  ``schedule()``  -> ``StepPlan``    (frozen: what to fetch, compute, verify this step)
  ``runner.execute(plan)`` -> ``StepResult``  (frozen: tokens, fetch outcomes, times)
  ``update(plan, result)`` -> ``[StepOutput]``  (per request: new tokens, finished?)

Nothing else crosses between them (``jaxkv.scheduling.step`` holds both types): the runner never
reads the scheduler's state, and the scheduler never touches device arrays, pools or
tiers. It sees the cache through its host-side manager (``jaxkv.manager``: the index,
pins, allocation), and every piece of tier work it decides is an order in a plan.

What ``schedule`` does
- Admission. Waiting requests are placed (``admission``) on the shard where their cached
  prefix makes them cheapest, each into a free row of ``max_seqs_per_shard``; the planner
  picks each one's split point ``s`` (blocks ``[hot, s)`` recomputed, ``[s, cached)``
  fetched) and the fetches of the step's admissions form one *fetch group*, issued by the
  runner at the start of the step. ``batching="waves"`` (``EngineConfig(batching="static")``)
  admits only into an empty batch: the same loop, run as static batches.
- Prefill. Every prefilling request gets one chunk per step: first its planned recompute
  ``[hot, s)``, then, once its fetch group is verified, the rest of its prompt. Chunks are
  block-aligned, so a block's KV is the same bits however it was computed. The chunk that
  reaches the prompt's end selects the first token.
- Decode. Every request past its prompt decodes one token.
- Verification. A fetch group whose requests have no recompute left after this step's
  chunks is settled this step: the runner waits for it (with the read deadline) after it
  dispatched the step's compute, so the wait overlaps the device work.
- Orders (``TierOrders``). The disk records of chains the last update forgot, the blocks
  this step's admissions evicted (their write-back copies), the write-through copies of
  what the last update published, and the disk journal's pump once a request completed.
  The manager chooses every copy's destination as the plan is made (``resolve``: host and
  disk slots, the host blocks those evict read out to the disk and the pool); the cache
  worker carries them out before the step writes any page and chooses nothing. A step with no request
  left to carry them is a plan of orders alone (``has_orders``; the engine runs it).

What ``update`` does (the only place each of these happens)
- settles verified groups: the fetches' pins are released, a failed block ends its
  request's hit there (its bad copy and the chain after it are forgotten, their disk
  records are the next plan's ``drop``), verified blocks in the hit are published, prompt
  counters are taken, the planner learns the link's speed, the rest of the prompt is queued;
- publishes the full blocks this step's chunks wrote (their write-through copies are
  orders of the next plan);
- hands each request its token, takes TTFT, ends requests on a stop token or their length:
  their answer's blocks are published, their pages released, completion counted.

A request whose prompt shares blocks being computed by a running request on the shard it
would run on waits until they are published and then reuses them (a shared new document is
prefilled once per device). A sequence longer than a device pool (``StreamConfig``) runs
alone: admissions pause until the batch is empty, then it is one step of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import time
import warnings
from collections.abc import Callable

from absl import logging

from jaxkv import buckets
from jaxkv.scheduling.admission import Placement, Request
from jaxkv.manager import windows as windows_lib
from jaxkv.scheduling.publishing import Publishing
from jaxkv.manager.index import TIER_NAMES, Tier
from jaxkv.scheduling.step import (DecodeRow, FetchGroup, FetchReport, PrefillChunk, SeqRows,
                                   SplitChoice, StepPlan, StepResult, TierOrders)

__all__ = ["BATCHING", "DecodeRow", "FetchGroup", "POLICIES", "PrefillChunk", "RequestHandle", "Scheduler",
           "SeqRows", "StepOutput", "StepPlan", "StepResult", "TierOrders"]

BATCHING = ("continuous", "waves")
POLICIES = BATCHING  # its former name


class RequestHandle:
  """One submitted request as its caller sees it: tokens so far, whether it finished, why.

  The scheduler delivers into it (``tokens``, ``finished``, ``finish_reason``, ``ttft_s``);
  the caller reads. Iterating yields tokens as they arrive and ``result()`` waits for the
  last: a handle waits through its ``wait`` (given by the engine: it runs the engine's next
  step, every running request advancing meanwhile). Handles, like the engine, belong to
  one thread."""

  def __init__(self, request: Request, wait: Callable[[], object],
               on_token: Callable[[int], None] | None = None, want_logits: bool = False):
    self.request = request
    self.id = request.id
    self.tokens: list[int] = []
    self.logits: list | None = [] if want_logits else None
    # With ``SamplingParams.logprobs`` / ``prompt_logprobs``: per generated token, and per
    # prompt token after the first, ``(logprob, ((id, logprob), ...))`` with the most
    # likely tokens asked for.
    sp = request.sampling
    self.logprobs: list | None = [] if sp.logprobs is not None else None
    self.prompt_logprobs: list | None = [] if sp.prompt_logprobs is not None else None
    self.finished = False
    self.finish_reason: str | None = None  # "stop", "length", "abort" or "error"
    self.ttft_s: float | None = None
    self.cached_tokens = 0  # prompt tokens reused from the cache (known once it is placed)
    self.t_submit = time.perf_counter()
    self._wait, self._on_token = wait, on_token

  def deliver(self, tokens, logits=None, finish_reason: str | None = None,
              logprobs=None) -> None:
    """The scheduler's: a step's tokens (and their logits, and log-probabilities as
    ``(logprobs [n], top ids [n, K], top logprobs [n, K])``) for this request; with
    ``finish_reason``, its end."""
    for i, token in enumerate(tokens):
      self.tokens.append(int(token))
      if self.logits is not None and logits is not None:
        self.logits.append(logits[i])
    if self.logprobs is not None and logprobs is not None:
      self.logprobs += _scored(logprobs, self.request.sampling.logprobs)
    if finish_reason is not None:
      self.finished, self.finish_reason = True, finish_reason

  def notify(self, tokens) -> None:
    """The scheduler's: calls the caller's ``on_token`` (after its own bookkeeping: a
    callback that raises fails the step, never the accounts)."""
    if self._on_token is not None:
      for token in tokens:
        self._on_token(int(token))

  def __iter__(self):
    sent = 0
    while True:
      while sent < len(self.tokens):
        sent += 1
        yield self.tokens[sent - 1]
      if self.finished:
        return
      self._wait()

  def result(self) -> list[int]:
    """Waits until this request has finished; returns its tokens."""
    while not self.finished:
      self._wait()
    return list(self.tokens)


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one step produced for one request."""

  handle: RequestHandle
  new_tokens: tuple
  finished: bool


@dataclasses.dataclass
class _Seq:
  """A running request (the scheduler's own, mutable state: it advances every step)."""

  handle: RequestHandle
  placement: Placement
  row: int  # its slot: shard * rows_per_shard + i
  split: int
  spans: collections.deque  # prefill spans [a, b) still to run, in order
  rows: SeqRows
  recompute_end: int  # token position where its planned recompute ends
  decoding: bool = False
  pos: int = 0  # position of the next token fed to decode
  fetches: bool = False  # it waits for blocks from a lower tier
  t_admitted: float = 0.0  # time.perf_counter() when it was placed
  choice: SplitChoice | None = None  # the plan's split and its predicted parts
  # How long its fetch group took (FetchReport.seconds), once settled with every block of it
  # verified; 0 until then, or when some block failed.
  fetch_s: float = 0.0


def waiting_for_prefix(queue, free: list[list[int]], running, index, num_shards: int
                       ) -> set[int]:
  """The ids of the requests in ``queue`` that wait this step because blocks of their
  prompt are being computed, cached nowhere yet, on the shard they would run on: by a
  running sequence on a shard with a free row (as many as it has free rows), or, with one
  data shard, by a request ahead of them in the queue. Once the blocks are published they
  reuse them there instead of computing them a second time on the same device. (On another
  shard, computing them costs no wait: they run in parallel.) Block keys are chained, so
  sharing block ``j`` means sharing the whole prefix up to it."""
  computing: dict = {}  # key -> shard computing it (None: a request ahead in the queue)
  for s in running:
    if not s.decoding and free[s.placement.shard]:
      computing.update(dict.fromkeys(s.placement.request.keys, s.placement.shard))
  one_shard = num_shards == 1
  room = [len(f) for f in free]  # requests that can still join each shard
  held = set()
  for req in queue:
    if req.sampling.prompt_logprobs is not None:  # computes its whole prompt anyway
      continue
    shared = 0
    while shared < len(req.keys) and req.keys[shared] in computing:
      shared += 1
    last = req.keys[shared - 1] if shared else None
    there = None if last is None else computing[last]
    if last is not None and (one_shard or (there is not None and room[there] > 0)) and all(
        index.slot_of(s, last, t) is None for s in range(num_shards)
        for t in (Tier.DEVICE, Tier.HOST, Tier.DISK) if index.has_tier(t)):
      held.add(req.id)
      if there is not None:
        room[there] -= 1
    else:  # it computes its own blocks: on one shard, requests behind it may wait
      computing.update(dict.fromkeys(req.keys[shared:], None))
  return held


class Scheduler:
  """Runs submitted requests step by step over one cache."""

  def __init__(self, manager, planner, admission, *, max_seqs_per_shard: int,
               prefix_reuse: bool, cache_decode_blocks: bool, chunk_tokens: int,
               batching: str = "continuous", policy: str | None = None):
    """``manager``: the cache's host side (``jaxkv.manager.CacheManager``); the scheduler
    touches no pool and no tier, and asks for tier work only through its plans' orders.
    ``batching``: ``continuous`` or ``waves`` (``policy`` is its former name; the
    fetch-or-recompute decision is ``SchedulerConfig.decision``)."""
    if policy is not None:
      warnings.warn("Scheduler(policy=) is deprecated: it is Scheduler(batching=) "
                    "('continuous' or 'waves').", DeprecationWarning, stacklevel=2)
      batching = policy
    if batching not in BATCHING:
      raise ValueError(f"batching={batching!r} must be one of {BATCHING}.")
    self.manager, self.planner, self.admission = manager, planner, admission
    self.index, self.stats, self.page = manager.index, manager.stats, manager.page_size
    self.prefix_reuse, self.cache_decode_blocks = prefix_reuse, cache_decode_blocks
    self.batching, self.chunk_tokens = batching, chunk_tokens
    self.rows_per_shard = buckets.pow2_at_least(max_seqs_per_shard)  # slots per shard
    self.max_seqs_per_shard = max_seqs_per_shard
    self.waiting: collections.deque = collections.deque()  # Requests not yet placed
    self.handles: dict[int, RequestHandle] = {}
    self.running: dict[int, _Seq] = {}  # by row slot
    # Fetch groups not yet settled: group -> (its requests, its fetches).
    self.groups: dict[int, tuple[list[_Seq], tuple]] = {}
    self._step = 0
    self._held_once: set[int] = set()  # requests counted in stats' shared_prefix_waits
    # Request ids to end at the next step that can -> "abort", or "error" (its callback raised).
    self._aborting: dict[int, str] = {}
    self._orders = TierOrders()  # tier work decided since the last plan, for the next one
    self.publishing = Publishing(manager, self.page, prefix_reuse=prefix_reuse,
                                 cache_decode_blocks=cache_decode_blocks)

  # ---- the queue -------------------------------------------------------------------------------
  def add(self, handle: RequestHandle) -> RequestHandle:
    self.handles[handle.id] = handle
    self.waiting.append(handle.request)
    return handle

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  def has_orders(self) -> bool:
    """Whether tier work waits for a plan (none left to carry it: a plan of orders alone)."""
    return (not self._orders.empty or bool(self.publishing.window_copies)
            or (self.manager.windows is not None and self.manager.windows.has_moves()))

  def _take_orders(self, *more: TierOrders) -> TierOrders:
    """The orders decided since the last plan (and ``more``), with every copy's
    destination chosen by the manager: what this plan's worker carries out."""
    orders = sum(more, self._orders)
    self._orders = TierOrders()
    return self.manager.resolve(orders)

  def _window_moves(self) -> dict:
    """The window group's moves this plan carries out (``windows.WindowMoves``), as the
    ``StepPlan`` fields that carry them (each named ``window_`` and the move's name)."""
    if self.manager.windows is None:
      return {}
    return {f"window_{k}": v for k, v in self.manager.windows.take_moves()._asdict().items()}

  def _window_failures(self, failed) -> None:
    """Window blocks loaded from host memory, the disk or the pool whose bytes failed their
    check (or did not come): kept nowhere now (no request was placed on them yet: the one
    they were loaded for is admitted at the next step, with what is kept then); a disk
    record that failed is forgotten."""
    for shard, key, tier in failed:
      self.manager.windows.drop_loaded(shard, key, disk=tier == Tier.DISK)

  def _release(self, p: Placement) -> None:
    """Gives back what a placed request holds: its device pages, its window ring and pins."""
    self.manager.release(p.shard, p.pages)
    if self.manager.windows is not None:
      self.manager.windows.release_placement(p)

  def abort(self, request_id: int, reason: str = "abort") -> None:
    """Ends a request (its caller went away) at the start of the next step that can: a
    waiting one leaves the queue; a running one leaves the batch and its pages are
    released (blocks it published stay cached) once no fetch of its group is still in
    flight. Its handle finishes with ``finish_reason="abort"``. Unknown or finished ids
    are ignored (the request may have ended meanwhile). ``reason="error"``: it ends with
    that ``finish_reason`` (its own failure, not its caller's leaving)."""
    if request_id in self.handles:
      self._aborting.setdefault(request_id, reason)

  def _apply_aborts(self) -> tuple:
    """Ends the aborted requests that can end now; returns their ids."""
    ended = []
    if any(r.id in self._aborting for r in self.waiting):
      kept = [r for r in self.waiting if r.id not in self._aborting]
      ended = [r.id for r in self.waiting if r.id in self._aborting]
      self.waiting = collections.deque(kept)
    in_flight = {s.handle.id for seqs, _ in self.groups.values() for s in seqs}
    for s in list(self.running.values()):
      if s.handle.id in self._aborting and s.handle.id not in in_flight:
        self._release(s.placement)
        del self.running[s.row]
        ended.append(s.handle.id)
    self.manager.forget_peer_lookups(ended)
    self.admission.forget(ended)
    for request in ended:
      self._held_once.discard(request)
      reason = self._aborting.pop(request)
      self.handles[request].deliver([], None, reason)
      self.stats.add("aborted_requests" if reason == "abort" else "failed_requests")
    return tuple(ended)

  # ---- deciding a step -------------------------------------------------------------------------
  def schedule(self) -> StepPlan:
    """Admits what fits and lays out this step (advances the scheduler's own state)."""
    self._step += 1
    aborted = self._apply_aborts()
    self.manager.agree_peer_answers()  # (a job's: the same on every process)
    if self.waiting and self.waiting[0].streamed and not self.running:
      request = self.waiting.popleft()
      return StepPlan(step=self._step, streamed=request, aborted=aborted,
                      orders=self._take_orders(), window_copies=self.publishing.take_copies(),
                      **self._window_moves(),
                      block_bytes=self.manager.page_bytes,
                      want_logits=(self.handles[request.id].logits is not None
                                   or self.handles[request.id].logprobs is not None))
    admitted, fetch, evicted = self._admit()
    copies = self.publishing.take_copies()
    moves = self._window_moves()
    decoding = [s for s in self.running.values() if s.decoding]
    prefill = [self._next_chunk(s) for s in self.running.values()
               if not s.decoding and s.spans]
    settle = tuple(sorted(g for g, (seqs, _) in self.groups.items()
                          if not any(s.spans for s in seqs)))
    first = {c.seq.request for c in prefill if c.last}
    finishing = tuple(s.handle.id for s in decoding
                      if len(s.handle.tokens) + 1 >= s.placement.request.max_new_tokens)
    finishing += tuple(s.handle.id for s in self.running.values()
                       if s.handle.id in first and s.placement.request.max_new_tokens == 1)
    return StepPlan(
        step=self._step, aborted=aborted, admitted=admitted, fetch=fetch,
        orders=self._take_orders(TierOrders(demote=evicted)), window_copies=copies,
        **moves,
        block_bytes=self.manager.page_bytes,
        decode=tuple(DecodeRow(s.rows, s.handle.tokens[-1], s.pos) for s in decoding),
        prefill=tuple(prefill), settle=settle, finishing=finishing,
        # Every decoding row decodes again next step (none reaches its length with this
        # step's token, nobody joins): the runner may dispatch that step now. A stop token
        # is seen only after the readback; its row of the early step is then dropped.
        decode_again=bool(decoding) and not first and not finishing,
        want_logits=any(s.handle.logits is not None for s in self.running.values()),
        want_logprobs=any(s.handle.logprobs is not None for s in self.running.values()))

  def _next_chunk(self, s: _Seq) -> PrefillChunk:
    a, b = s.spans[0]
    end = min(a + self.chunk_tokens, b)
    prompt = s.placement.request.tokens
    if end == b:
      s.spans.popleft()
    else:
      s.spans[0] = (end, b)
    return PrefillChunk(seq=s.rows, tokens=prompt[a:end], start=a, last=end == len(prompt),
                        recompute=end <= s.recompute_end,
                        targets=prompt[a + 1:end + 1] if s.handle.prompt_logprobs is not None
                        else None)

  def _free_rows(self) -> list[list[int]]:
    return [[s * self.rows_per_shard + i for i in range(self.max_seqs_per_shard)
             if s * self.rows_per_shard + i not in self.running]
            for s in range(self.manager.num_shards)]

  def _admit(self) -> tuple[tuple, FetchGroup | None, tuple]:
    """Places what fits. Returns ``(admitted ids, fetch group, evicted blocks)``: the
    blocks whose device pages the placements took, for this step's demote orders."""
    if self.batching == "waves" and self.running:
      return (), None, ()
    ordinary = collections.deque()
    while self.waiting and not self.waiting[0].streamed:
      ordinary.append(self.waiting.popleft())
    if not ordinary:
      return (), None, ()
    free = self._free_rows()
    running = [self.max_seqs_per_shard - len(f) for f in free]
    # Nothing is admitted without a free row: then nobody needs to be held back either.
    held = (self._held_for_shared_prefix(ordinary, free)
            if any(free) and self.batching == "continuous" else set())
    candidates = collections.deque(r for r in ordinary if r.id not in held)
    try:
      placed = (self.admission.admit(candidates, running=running,
                                     wait_for_own_shard=self.batching == "continuous")
                if any(free) else [])
    except BaseException:
      self.waiting.extendleft(reversed(ordinary))  # still queued: fail_all ends them
      raise
    left = held | {r.id for r in candidates}
    self.waiting.extendleft(reversed([r for r in ordinary if r.id in left]))
    if not placed:
      return (), None, ()
    # Evicted blocks are gone from the index already: their write-back copies are ordered
    # whatever happens to the placements (their pages are reused only by a later step).
    evicted = tuple(b for p in placed for b in p.evicted)
    if self.batching == "waves":
      self.stats.add("waves")
    try:
      choices = self.planner.choices([(list(p.hit_tiers), len(p.request.tokens), p.shard)
                                      for p in placed])
    except BaseException:  # placed, not running: give back what placing took
      for p in placed:
        self._release(p)
        for f in p.fetches:
          self.manager.release_pin(f)
      self.waiting.extendleft(reversed([p.request for p in placed]))
      self._orders += TierOrders(demote=evicted)
      raise
    group, fetches, seqs, page = self._step, [], [], self.page
    for p, choice in zip(placed, choices):
      s = choice.split
      self._held_once.discard(p.request.id)
      for f in p.fetches:
        if f.block < s:  # cached below, but recomputing it is the plan
          self.manager.release_pin(f)
      mine = tuple(f for f in p.fetches if f.block >= s)
      fetches.extend(mine)
      req = p.request
      seq = _Seq(handle=self.handles[req.id], placement=p, row=free[p.shard].pop(0),
                 split=s, spans=collections.deque(), recompute_end=s * page,
                 fetches=bool(mine), t_admitted=time.perf_counter(), choice=choice,
                 rows=SeqRows(req.id, p.shard, p.pages, req.num_pages_needed, req.sampling,
                              window_pages=windows_lib.placement_row(p, s, p.cached_blocks)))
      if s > p.hot_blocks:
        seq.spans.append((p.hot_blocks * page, s * page))
      seqs.append(seq)
      self.running[seq.row] = seq
    if fetches:
      self.groups[group] = (seqs, tuple(fetches))
    else:  # nothing to wait for: the rest of each prompt follows its recompute at once
      self._settle(seqs, None)
    return (tuple(p.request.id for p in placed),
            FetchGroup(group, tuple(fetches)) if fetches else None, evicted)

  def _held_for_shared_prefix(self, queue, free: list[list[int]]) -> set[int]:
    """Requests that wait this step for a prefix being computed (``waiting_for_prefix``);
    each is counted once."""
    if not self.prefix_reuse:
      return set()
    held = waiting_for_prefix(queue, free, self.running.values(), self.index,
                              self.manager.num_shards)
    self.stats.add("shared_prefix_waits", len(held - self._held_once))
    self._held_once |= held
    return held

  # ---- learning from a step ----------------------------------------------------------------------
  def update(self, plan: StepPlan, result: StepResult | None) -> list[StepOutput]:
    """Takes a step's result into the scheduler's state; returns what each request got
    (``result`` is None for an empty plan: then only its aborted requests end)."""
    aborted = [StepOutput(self.handles.pop(r), (), True) for r in plan.aborted]
    if result is None:
      return aborted
    self._window_failures(result.window_failures)
    for report in result.window_fetched:
      self.planner.observe_fetch(self.planner.agreed_report(report))
    if plan.streamed is not None:
      tokens, logits, t_first = result.streamed
      handle = self.handles[plan.streamed.id]
      self._first_token(handle, t_first)
      scores = None if result.logprobs is None else result.logprobs[plan.streamed.id]
      # The streamer ran it to a stop token or its length.
      handle.deliver(tokens, logits if handle.logits is not None else None,
                     _finish_reason(tokens[-1], len(tokens), plan.streamed) or "length",
                     scores)
      self._complete(handle, result.t_tokens)
      out = StepOutput(handle, tuple(tokens), True)
      self._notify(out)
      return aborted + [out]
    by_id = {s.handle.id: s for s in self.running.values()}
    self._orders += self.publishing.chunks(plan.prefill, by_id)
    for request, scores in (result.prompt_logprobs or {}).items():
      handle = by_id[request].handle
      handle.prompt_logprobs += _scored(scores, handle.request.sampling.prompt_logprobs)
    for group, report in result.fetched:
      self._settle(self.groups.pop(group)[0], report)
    if plan.decode or plan.prefill:
      self.stats.add("steps")
    outputs = aborted
    for request, token in result.tokens.items():
      s = by_id[request]
      if not s.decoding:  # its prompt ended: the first token exists
        self._first_token(s.handle, result.t_tokens)
        if not s.fetches and len(self.running) == 1:  # computed alone: a prefill's real cost
          cached = s.handle.cached_tokens
          self.planner.observe_recompute(len(s.placement.request.tokens) - cached, cached,
                                         result.t_tokens - s.t_admitted)
        elif s.fetch_s and len(self.running) == 1:  # fetched alone (and recomputed, if a split)
          self.planner.observe_split(s.choice, s.fetch_s, result.t_tokens - s.t_admitted)
        s.decoding, s.pos = True, len(s.placement.request.tokens)
      else:
        s.pos += 1
      done = _finish_reason(token, len(s.handle.tokens) + 1, s.placement.request)
      logits = None if result.logits is None else [result.logits[request]]
      scores = (None if result.logprobs is None or s.handle.logprobs is None
                else tuple(a[None] for a in result.logprobs[request]))
      if done is not None:
        self._leave(s)
      s.handle.deliver([token], logits, done, scores)
      if done is not None:
        self._complete(s.handle, result.t_tokens)
      outputs.append(StepOutput(s.handle, (token,), done is not None))
    for out in outputs:
      self._notify(out)
    return outputs

  def _notify(self, out: StepOutput) -> None:
    """Hands a request's new tokens to its caller's ``on_token``. A callback that raises
    fails its own request (it ends with "error" at the next step, its pages released),
    never the step, the accounts or another request."""
    try:
      out.handle.notify(out.new_tokens)
    except Exception:  # the caller's code: logged with its traceback, kept to its request
      logging.exception("on_token of request %d raised; the request ends with "
                        "finish_reason='error'", out.handle.id)
      if not out.finished:
        self.abort(out.handle.id, "error")

  def _first_token(self, handle: RequestHandle, t: float) -> None:
    handle.ttft_s = t - handle.t_submit
    self.stats.ttft_s.append(handle.ttft_s)

  def _settle(self, seqs: list[_Seq], report: FetchReport | None) -> None:
    """A verified (or failed) fetch group: pins released and failed chains forgotten (their
    disk records: the next orders' drop), each request's hit and counters, the rest of its
    prompt queued."""
    outcomes = collections.defaultdict(list)  # request id -> [(fetch, failure or None)]
    if report is not None:  # (the worker counted each failure)
      report = self.planner.agreed_report(report)  # (its times: a job's, process 0's)
      self._orders += TierOrders(drop=self.manager.fetched(report.fetches, report.failures))
      for f, why in zip(report.fetches, report.failures):
        outcomes[f.request].append((f, why))
      self.planner.observe_fetch(report)
    for s in seqs:
      p = s.placement
      mine = outcomes[s.handle.id]
      # Recompute from the first bad block on.
      hit = min([p.cached_blocks] + [f.block for f, why in mine if why is not None])
      if p.window_ring and hit < p.cached_blocks:
        # The window group has the window before the split (the recompute's ring, or the
        # kept window before the blocks on device), not before the bad block: from there.
        hit = min(hit, s.split)
        s.rows = dataclasses.replace(s.rows,
                                     window_pages=windows_lib.placement_row(p, s.split, hit))
      for f, why in mine:  # verified and still part of the hit: the copy is good
        if why is None and f.block < hit:
          self.publishing.block(p.shard, f.page, p.request.keys, f.block, [])
      if hit == p.cached_blocks and report is not None:
        s.fetch_s = report.seconds
      _count_prompt(s, hit, self.page, self.stats, self.manager)
      s.spans.append((max(hit, s.split) * self.page, len(p.request.tokens)))

  # ---- leaving -----------------------------------------------------------------------------------
  def _leave(self, s: _Seq) -> None:
    """A request's last token: its answer's blocks are published, its pages released."""
    self._orders += self.publishing.answer(s)
    self._release(s.placement)
    del self.running[s.row]

  def _complete(self, handle: RequestHandle, t_done: float) -> None:
    """Completion counters (every request, streamed or not, ends here once)."""
    self.handles.pop(handle.id, None)
    self._aborting.pop(handle.id, None)  # asked for while its last step ran: it finished
    self.stats.add("requests")
    self.stats.add("generated_tokens", len(handle.tokens))
    if handle.ttft_s is not None:
      e2e = t_done - handle.t_submit
      self.stats.e2e_s.append(e2e)
      if len(handle.tokens) > 1:
        self.stats.tpot_s.append((e2e - handle.ttft_s) / (len(handle.tokens) - 1))
    self._orders += TierOrders(pump=True)  # disk writes that committed get published

  def fail_all(self) -> dict[int, tuple]:
    """After a failed step: every running and waiting request ends (``finish_reason``
    "error") and every page reference the running ones held is released. Returns the
    fetch groups never settled (group -> fetches): their transfers and the pins on their
    sources are the runner's to abandon."""
    self.manager.forget_peer_lookups(r.id for r in self.waiting)
    self.admission.forget([r.id for r in self.waiting])
    self.waiting.clear()
    self._held_once.clear()
    self._aborting.clear()
    # Orders not carried out are dropped: the failed step may have consumed the pools (a
    # lost copy is a miss later, a copy of bytes no longer the blocks' a wrong hit).
    self._orders, self.publishing.window_copies = TierOrders(), []
    if self.manager.windows is not None:  # kept blocks whose copies were dropped
      self.manager.windows.forget()
    unsettled = {g: fetches for g, (_, fetches) in self.groups.items()}
    self.groups.clear()
    for s in self.running.values():
      self._release(s.placement)
    self.running.clear()
    handles, self.handles = self.handles, {}
    for handle in handles.values():  # waiting, running, or taken off the queue by the step
      if not handle.finished:
        handle.deliver([], None, "error")
    return unsettled


def _count_prompt(s: _Seq, hit: int, page: int, stats, manager) -> None:
  """A placed request's prompt in the counters: hits by tier, reused and computed tokens,
  recomputed and split blocks; its ``cached_tokens``."""
  p = s.placement
  hot, cached = p.hot_blocks, p.cached_blocks
  reused = hot + (hit - s.split if hit > s.split else 0)
  for j in list(range(hot)) + list(range(s.split, hit)):
    stats.hits[TIER_NAMES[p.hit_tiers[j]]] += 1
  manager.record_hits(p.request.keys[:hit])
  n = len(p.request.tokens)
  s.handle.cached_tokens = reused * page
  stats.add("hit_tokens", reused * page)
  stats.add("prompt_tokens", n)
  stats.add("computed_tokens", n - reused * page)
  stats.add("blocks_recomputed", n // page - reused)
  stats.add("blocks_split", (s.split - hot) if hot < s.split < cached else 0)


def _scored(scores, k: int) -> list:
  """``(logprobs [n], top ids [n, K], top logprobs [n, K])`` as ``n`` entries
  ``(logprob, ((id, logprob), ...))`` with the ``k`` most likely tokens."""
  lp, ids, top = scores
  return [(float(lp[i]), tuple(zip(ids[i, :k].tolist(), top[i, :k].tolist())))
          for i in range(len(lp))]


def _finish_reason(token: int, count: int, request: Request) -> str | None:
  """Whether a request ends with ``token``, its ``count``-th: the one place stop and
  length are decided."""
  if token in request.sampling.stop_token_ids:
    return "stop"
  return "length" if count >= request.max_new_tokens else None

