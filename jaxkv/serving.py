"""Continuous batching: every step runs whatever sequences are running, nobody waits for a wave.

Each data shard has ``max_seqs_per_shard`` rows (bucketed to a power of two). A request
submitted to the engine waits in a queue until a row and its pages are free on some shard;
admission places it (``admission``), the planner picks its split point, its fetches are
issued at once, and from the next step on it advances one prefill chunk per step: first
the planned recompute ``[hot, s)``, then, once its fetches are verified (``TierMover``,
with the read deadline), the rest of the prompt. Each chunk's full blocks are published
(and, under write-through, copied down) as soon as its step is dispatched. The chunk that
reaches the prompt's end yields its first token. From then on it decodes one token per
step until it has ``max_new_tokens`` or produced a stop token; that step it leaves: the
blocks its answer filled are published, its pages are released, and its row takes the
next request at the following step.

A request whose prompt shares blocks that are being computed on the shard it would run on
(by a running sequence there, or by one ahead of it in the queue when there is one data
shard), cached nowhere yet, waits until they are published and then reuses them: a shared
new document is prefilled once per device.

A step is at most two jitted calls, each over compact rows (a power of two per shard, as
many as the busiest shard needs): the decode step for the decoding sequences and the
prefill step for one chunk of each prefilling sequence. The decode step's inputs stay on
device while the set of decoding sequences is unchanged: it returns the next step's
positions and lengths, its tokens feed the next step directly, and only the tokens are
read back (every step: stops and streaming need them). A sequence joining or leaving
rebuilds the rows from the host's copy (each row's last token and position).

Shapes are the static engine's: rows and page-table widths come from ``buckets``, prefill
chunks are block-aligned, so a block's KV is the same whether it was computed here, in a
wave, or reused, and arrivals never trigger a compile beyond the warmed buckets.

A sequence longer than a device pool (``StreamConfig``) runs alone: new admissions pause
until the running sequences have left, then it runs to its end in one step.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable

import numpy as np

from jaxkv import buckets
from jaxkv.admission import Placement, Request
from jaxkv.distributed import to_host
from jaxkv.executor import PlannedRow
from jaxkv.index import Tier


class RequestHandle:
  """One submitted request: its tokens so far, whether it finished and why.

  Iterating over a handle yields its tokens as they are generated, running engine steps
  as needed (every running request advances meanwhile)."""

  def __init__(self, request: Request, step: Callable[[], object],
               on_token: Callable[[int], None] | None):
    self.request = request
    self.id = request.index
    self.tokens: list[int] = []
    self.logits: list | None = None
    self.finished = False
    self.finish_reason: str | None = None  # "length" or "stop"
    self.ttft_s: float | None = None
    self.t_submit: float | None = None
    self._step, self._on_token = step, on_token

  def _emit(self, token: int, logits=None) -> None:
    self.tokens.append(token)
    if self.logits is not None and logits is not None:
      self.logits.append(logits)
    if self._on_token is not None:
      self._on_token(token)

  def __iter__(self):
    sent = 0
    while True:
      while sent < len(self.tokens):
        sent += 1
        yield self.tokens[sent - 1]
      if self.finished:
        return
      self._step()

  def result(self) -> list[int]:
    """Runs steps until this request has finished; returns its tokens."""
    while not self.finished:
      self._step()
    return list(self.tokens)


@dataclasses.dataclass(frozen=True)
class StepOutput:
  """What one step produced for one request."""

  handle: RequestHandle
  new_tokens: tuple
  finished: bool


@dataclasses.dataclass
class _Seq:
  """A running sequence (mutable: it advances every step)."""

  handle: RequestHandle
  placement: Placement
  row: int
  split: int
  fetches: tuple
  spans: collections.deque  # prefill spans [a, b) still to run, in order
  t_submit: float
  hit: int = -1  # known once its fetches were verified
  decoding: bool = False
  pos: int = 0  # position of the next token fed to decode


class ContinuousBatcher:
  """Runs submitted requests step by step over one cache."""

  def __init__(self, cache, runner, planner, admission, executor, *, max_seqs_per_shard: int,
               prefix_reuse: bool, cache_decode_blocks: bool, streamer=None):
    self.cache, self.runner, self.planner = cache, runner, planner
    self.admission, self.executor, self.streamer = admission, executor, streamer
    self.prefix_reuse, self.cache_decode_blocks = prefix_reuse, cache_decode_blocks
    self.stats = cache.stats
    self.rows_per_shard = buckets.pow2_at_least(max_seqs_per_shard)  # slots, for capacity
    self.max_seqs_per_shard = max_seqs_per_shard
    self.waiting: collections.deque = collections.deque()  # Requests not yet placed
    self.handles: dict[int, RequestHandle] = {}
    self.submitted_at: dict[int, float] = {}
    self.running: dict[int, _Seq] = {}  # by row
    self.groups: list[tuple[list, object]] = []  # (sequences, pending fetches) unverified
    # The decoding rows as the last decode step left them on device: (which sequence in
    # which row, rows, table, next batch, next carry). Reused while the set is unchanged.
    self._resident = None
    self._ahead = None  # (key, rows, tokens, logits) of a decode step dispatched early
    self._held_once: set[int] = set()  # requests counted in stats' shared_prefix_waits

  # ---- the queue -------------------------------------------------------------------------------
  def add(self, request: Request, step: Callable[[], object], on_token=None,
          want_logits: bool = False) -> RequestHandle:
    """Queues ``request``; its handle runs ``step`` (the engine's) when iterated."""
    handle = RequestHandle(request, step, on_token)
    if want_logits:
      handle.logits = []
    self.handles[request.index] = handle
    self.submitted_at[request.index] = handle.t_submit = time.perf_counter()
    self.waiting.append(request)
    return handle

  def has_work(self) -> bool:
    return bool(self.waiting or self.running)

  # ---- one step --------------------------------------------------------------------------------
  def step(self) -> list[StepOutput]:
    """Admits what fits, advances every running sequence by one chunk or one token."""
    if self.waiting and self.waiting[0].streamed:
      if self.running:  # a long sequence runs alone: let the others finish first
        return self._advance()
      return [self._run_streamed(self.waiting.popleft())]
    self._admit()
    return self._advance()

  def _run_streamed(self, request: Request) -> StepOutput:
    handle = self.handles.pop(request.index)
    t0 = self.submitted_at.pop(request.index)
    tokens, logits = self.streamer.run(request, t0, handle.logits is not None)
    for i, t in enumerate(tokens):
      handle._emit(int(t), None if logits is None else logits[i])
    self._finish_handle(handle, request, counted=True)  # the streamer counted it
    return StepOutput(handle, tuple(tokens), True)

  def _free_rows(self) -> list[list[int]]:
    used = {row for row in self.running}
    return [[s * self.rows_per_shard + i for i in range(self.max_seqs_per_shard)
             if s * self.rows_per_shard + i not in used] for s in range(self.cache.num_shards)]

  def _admit(self) -> None:
    ordinary = collections.deque()
    while self.waiting and not self.waiting[0].streamed:
      ordinary.append(self.waiting.popleft())
    if not ordinary:
      return
    free = self._free_rows()
    running = [self.max_seqs_per_shard - len(f) for f in free]
    # Nothing is admitted without a free row: then nobody needs to be held back either.
    held = self._held_for_shared_prefix(ordinary, free) if any(free) else set()
    candidates = collections.deque(r for r in ordinary if r.index not in held)
    placed = self.admission.admit(candidates, running=running) if any(free) else []
    left = held | {r.index for r in candidates}
    self.waiting.extendleft(reversed([r for r in ordinary if r.index in left]))
    if not placed:
      return
    splits = self.planner.splits([(list(p.hit_tiers), len(p.request.tokens), p.shard)
                                  for p in placed])
    group: list[_Seq] = []
    page = self.cache.config.page_size
    for p, s in zip(placed, splits):
      self._held_once.discard(p.request.index)
      for f in p.fetches:
        if f.block < s:  # cached below, but recomputing it is the plan
          self.cache.mover.release_pin(f)
      row = free[p.shard].pop(0)
      seq = _Seq(handle=self.handles[p.request.index], placement=p, row=row, split=s,
                 fetches=tuple(f for f in p.fetches if f.block >= s),
                 spans=collections.deque(), t_submit=self.submitted_at.pop(p.request.index))
      if s > p.hot_blocks:
        seq.spans.append((p.hot_blocks * page, s * page))
      group.append(seq)
      self.running[row] = seq
    fetches = [f for seq in group for f in seq.fetches]
    pending = None
    if fetches:
      pools, pending = self.cache.mover.start_promote(self.cache.pools, fetches)
      self.cache.set_pools(pools)
    self.groups.append((group, pending))

  def _held_for_shared_prefix(self, queue, free: list[list[int]]) -> set[int]:
    """Requests that wait this step because blocks of their prompt are being computed,
    cached nowhere yet, on the shard they would run on: by a running sequence on a shard
    with a free row (as many as it has free rows), or, with one data shard, by a request
    ahead of them in the queue.
    Once the blocks are published they reuse them there instead of computing them a second
    time on the same device. (On another shard, computing them costs no wait: they run in
    parallel.) Block keys are chained, so sharing block ``j`` means sharing the whole
    prefix up to it."""
    if not self.prefix_reuse:
      return set()
    computing: dict = {}  # key -> shard computing it (None: a request ahead in the queue)
    for s in self.running.values():
      if not s.decoding and free[s.placement.shard]:
        computing.update(dict.fromkeys(s.placement.request.keys, s.placement.shard))
    one_shard = self.cache.num_shards == 1
    room = [len(f) for f in free]  # requests that can still join each shard
    index, held = self.cache.index, set()
    for req in queue:
      shared = 0
      while shared < len(req.keys) and req.keys[shared] in computing:
        shared += 1
      last = req.keys[shared - 1] if shared else None
      there = None if last is None else computing[last]
      if last is not None and (one_shard or (there is not None and room[there] > 0)) and all(
          index.slot_of(s, last, t) is None for s in range(self.cache.num_shards)
          for t in (Tier.DEVICE, Tier.HOST, Tier.DISK) if index.has_tier(t)):
        held.add(req.index)
        if there is not None:
          room[there] -= 1
        if req.index not in self._held_once:
          self._held_once.add(req.index)
          self.stats.add("shared_prefix_waits")
      else:  # it computes its own blocks: on one shard, requests behind it may wait
        computing.update(dict.fromkeys(req.keys[shared:], None))
    return held

  def _settle_groups(self) -> None:
    """Verifies the fetches of groups whose planned recompute has been dispatched, and
    gives their sequences the rest of their prompt to prefill."""
    still = []
    for group, pending in self.groups:
      if any(seq.spans for seq in group):
        still.append((group, pending))
        continue
      rows = [PlannedRow(seq.placement, seq.row, seq.split, seq.fetches) for seq in group]
      if pending is not None:
        t_end = time.monotonic() + self.cache.tiers.read_deadline_s
        self.cache.set_pools(self.cache.mover.finish_promote(self.cache.pools, pending, t_end))
        hits = self.executor.settle(rows)
        self.planner.observe_fetch(self.cache.mover.last_fetch)
      else:
        hits = [seq.placement.cached_blocks for seq in group]
      page = self.cache.config.page_size
      for seq, r, hit in zip(group, rows, hits):
        seq.hit = hit
        self.executor.count_prompt(r, hit)
        n = len(seq.placement.request.tokens)
        seq.spans.append((max(hit, seq.split) * page, n))
    self.groups = still

  def _layout(self, seqs: list[_Seq]):
    """Compact batch rows for ``seqs`` (rows per shard bucketed to what they need, so a
    step with one prefilling sequence does not pay for every row): ``(num_rows, row of
    each sequence, page table on device, sampling)``."""
    per_shard = collections.Counter(s.placement.shard for s in seqs)
    rows_per_shard = buckets.pow2_at_least(max(per_shard.values()))
    num_rows = self.cache.num_shards * rows_per_shard
    slot, row = collections.Counter(), {}
    width = buckets.table_width(max(s.placement.request.num_pages_needed for s in seqs),
                                self.cache.config)
    table = np.zeros((num_rows, width), np.int32)
    for s in seqs:
      shard = s.placement.shard
      row[s.handle.id] = shard * rows_per_shard + slot[shard]
      slot[shard] += 1
      table[row[s.handle.id], :len(s.placement.pages)] = s.placement.pages
    sampling = self.runner.row_sampling(
        {row[s.handle.id]: s.placement.request.sampling for s in seqs
         if s.placement.request.sampling.temperature > 0}, num_rows)
    return num_rows, row, self.cache.put_rows(table), sampling

  def _decode(self, decoding: list[_Seq], key: tuple):
    """Dispatches one decode step of ``decoding``: from the last step's outputs on device
    when the set is unchanged, else from the host's copy (each row's last token).
    Returns ``(row of each sequence, tokens out, selected logits)``."""
    if self._resident is not None and self._resident[0] == key:
      _, row, table, batch, carry = self._resident
    else:
      num_rows, row, table, sampling = self._layout(decoding)
      carry = np.zeros((num_rows,), np.int32)
      for s in decoding:
        carry[row[s.handle.id]] = s.handle.tokens[-1]
      batch = self.runner.decode_batch([(row[s.handle.id], s.pos) for s in decoding],
                                       num_rows, sampling)
      carry = self.cache.put_rows(carry)
    out, sel, batch = self.runner.decode(batch, table, carry)
    self._resident = (key, row, table, batch, out)
    return row, out, sel

  def _advance(self) -> list[StepOutput]:
    if not self.running:
      return []
    self._settle_groups()
    want_logits = any(s.handle.logits is not None for s in self.running.values())
    decoding = [s for s in self.running.values() if s.decoding]
    prefilling = [s for s in self.running.values() if not s.decoding and s.spans]
    dispatched = []  # (sequences, their rows, carry out, selected logits)
    ahead, self._ahead = self._ahead, None
    key = tuple(s.handle.id for s in decoding)
    if decoding:
      if ahead is not None and set(key) <= set(ahead[0]):  # dispatched last step
        _, row, out, sel = ahead
        if key != ahead[0]:  # some left (a stop token): their rows are dropped
          self._resident = None
      else:
        row, out, sel = self._decode(decoding, key)
      dispatched.append((decoding, row, out, sel))
    finishing = []
    if prefilling:
      num_rows, row, table, sampling = self._layout(prefilling)
      chunk, rows = self.runner.chunk_tokens, []
      for s in prefilling:
        a, b = s.spans[0]
        end = min(a + chunk, b)
        prompt = s.placement.request.tokens
        last = end == len(prompt)  # only the rest span (after verification) reaches it
        rows.append((row[s.handle.id], prompt[a:end], a, last))
        if end == b:
          s.spans.popleft()
        else:
          s.spans[0] = (end, b)
        if last:
          finishing.append(s)
      batch = self.runner.prefill_batch(rows, num_rows, sampling)
      out, sel = self.runner.prefill(batch, table, self.runner.zero_carry(num_rows))
      if finishing:
        dispatched.append((finishing, row, out, sel))
      self._publish_chunks(prefilling, rows, row)
    if decoding or prefilling:
      self.stats.add("steps")
    if (decoding and not finishing and self._resident is not None
        and self._resident[0] == key
        and all(len(s.handle.tokens) + 1 < s.placement.request.max_new_tokens
                for s in decoding)):
      # Every decoding sequence decodes again next step (none can reach its length with
      # this step's token; a stop token is seen only after the readback): dispatch that
      # step now, from this one's outputs on device, so the device runs it while the
      # host reads this step's tokens and prepares the next. A sequence that stops here
      # drops its row of it; the token written for it lies past what it publishes.
      self._ahead = (key, *self._decode(decoding, key))
    now = None
    result = []
    for seqs, row, out, sel in dispatched:
      tokens = to_host(out)
      if now is None:
        now = time.perf_counter()
      logits = to_host(sel) if want_logits else None
      for s in seqs:
        if not s.decoding:  # its prompt ended: the first token exists
          s.handle.ttft_s = now - s.t_submit
          self.stats.ttft_s.append(s.handle.ttft_s)
          s.decoding, s.pos = True, len(s.placement.request.tokens)
        else:
          s.pos += 1
        token = int(tokens[row[s.handle.id]])
        s.handle._emit(token, None if logits is None else logits[row[s.handle.id]])
        result.append(self._maybe_finish(s, token))
    return result

  def _maybe_finish(self, s: _Seq, token: int) -> StepOutput:
    req = s.placement.request
    stopped = token in req.sampling.stop_token_ids
    done = stopped or len(s.handle.tokens) >= req.max_new_tokens
    if done:
      s.handle.finish_reason = "stop" if stopped else "length"
      self._leave(s)
    return StepOutput(s.handle, (token,), done)

  def _publish_chunks(self, seqs: list[_Seq], rows: list, row: dict) -> None:
    """Publishes the full blocks each sequence's chunk of this step writes, as soon as
    the step is dispatched: any later read of those pages (another request's step, a
    copy down) runs after it on the device, so a request waiting for a shared prefix can
    start once its blocks are written, not once the writer's whole prompt is done."""
    if not self.prefix_reuse:
      return
    page, published = self.cache.config.page_size, []
    chunk_of = {r: (start, len(toks)) for r, toks, start, _ in rows}
    for s in seqs:
      start, n = chunk_of[row[s.handle.id]]
      p = s.placement
      for j in range(start // page, (start + n) // page):
        self.executor.publish(p.shard, p.pages[j], p.request.keys, j, published)
    self.executor.write_through(published)

  def _leave(self, s: _Seq) -> None:
    p = s.placement
    if self.prefix_reuse and self.cache_decode_blocks:
      written = np.concatenate([p.request.tokens, np.asarray(s.handle.tokens[:-1], np.int32)])
      keys = self.cache.index.block_keys(written, p.request.tenant)
      published = []
      for j in range(len(p.request.tokens) // self.cache.config.page_size, len(keys)):
        self.executor.publish(p.shard, p.pages[j], keys, j, published)
      self.executor.write_through(published)
    self.cache.index.release(p.shard, p.pages)
    del self.running[s.row]
    self._finish_handle(s.handle, p.request)

  def _finish_handle(self, handle: RequestHandle, request: Request, *,
                     counted: bool = False) -> None:
    handle.finished = True
    if handle.finish_reason is None:
      handle.finish_reason = ("stop" if handle.tokens and handle.tokens[-1]
                              in request.sampling.stop_token_ids else "length")
    self.handles.pop(request.index, None)
    if not counted:
      self.stats.add("requests")
      self.stats.add("generated_tokens", len(handle.tokens))
      if handle.t_submit is not None and handle.ttft_s is not None:
        e2e = time.perf_counter() - handle.t_submit
        self.stats.e2e_s.append(e2e)
        if len(handle.tokens) > 1:
          self.stats.tpot_s.append((e2e - handle.ttft_s) / (len(handle.tokens) - 1))
    self.cache.mover.pump()

  def abort_all(self) -> None:
    """After a failed step: every running and waiting request ends (``finish_reason``
    "error") and every reference the running ones held is released."""
    for request in self.waiting:
      handle = self.handles.pop(request.index, None)
      if handle is not None:
        handle.finished, handle.finish_reason = True, "error"
    self.waiting.clear()
    self.submitted_at.clear()
    self._held_once.clear()
    for group, pending in self.groups:
      if pending is not None:
        for f in pending[0]:
          self.cache.mover.release_pin(f)
    self.groups = []
    self._resident = self._ahead = None
    for s in list(self.running.values()):
      self.cache.index.release(s.placement.shard, s.placement.pages)
      s.handle.finished, s.handle.finish_reason = True, "error"
      self.handles.pop(s.handle.id, None)
    self.running.clear()
    if not self.cache.pools_alive():
      self.cache.reset_pools()

