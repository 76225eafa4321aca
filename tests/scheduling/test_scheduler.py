"""The scheduler on its own: no model, no mesh, no device.

The scheduler and admission see the cache only through its host-side manager
(``jaxkv.manager.CacheManager``: the real ``PrefixIndex``, pins, allocation). Each test
builds one over a real index, submits requests, and plays the runner's part by hand: it
reads each ``StepPlan`` and feeds back the ``StepResult`` a runner would give (tokens for
the rows that produce one, a ``FetchReport`` per settled group, failures where the test
wants them). What is asserted is the next plan and the index: admission under page
pressure, aborts at every stage, a failed or late fetch becoming a recompute, evictions
and write-through copies as orders in the plan, pins that no eviction touches.
"""

import collections
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from jaxkv.scheduling.admission import Admission
from jaxkv.config import CacheConfig, SamplingParams, SchedulerConfig
from jaxkv.errors import CapacityError
from jaxkv.manager.index import PrefixIndex, Tier
from jaxkv.manager import CacheManager
from jaxkv.planning.planner import Planner
from jaxkv.scheduling.scheduler import RequestHandle, Scheduler
from jaxkv.stats import Stats
from jaxkv.scheduling.step import StepResult
from jaxkv.scheduling.step import Failure, FetchReport

PAGE = 4
VOCAB = 97
import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT


class Loop:
  """A scheduler over a real index, with this test as its runner."""

  def __init__(self, *, shards=1, pages=16, host_pages=0, disk_pages=0, seqs=2, chunk_pages=2,
               decision="fetch", force_split=0, batching="continuous", write_through=True,
               cache_decode_blocks=True, prefix_reuse=True, share_answers=None,
               asks_peers=True, probe_every=8, probe_blocks=4):
    self.config = CacheConfig(model_name="seam", num_layers=2, num_kv_heads=2, head_dim=8,
                              page_size=PAGE, pages_per_shard=pages,
                              max_pages_per_seq=min(16, pages),
                              attention_impl="jnp", weights_digest="seam")
    self.index = PrefixIndex(num_shards=shards, pages_per_shard=pages, page_size=PAGE,
                             fingerprint=self.config.fingerprint(),
                             host_pages_per_shard=host_pages, disk_slots=disk_pages)
    self.stats = Stats()
    self.manager = CacheManager(self.index, stats=self.stats,
                                page_bytes=self.config.page_bytes, write_through=write_through,
                                has_disk=bool(disk_pages), share_answers=share_answers,
                                asks_peers=asks_peers)
    chunk = chunk_pages * PAGE
    self.planner = Planner(SchedulerConfig(decision=decision, force_split=force_split,
                                           probe_every=probe_every, probe_blocks=probe_blocks),
                           None,
                           num_shards=shards,
                           page_size=PAGE, page_bytes=self.config.page_bytes,
                           chunk_tokens=chunk, stats=self.stats)
    self.admission = Admission(self.manager, self.config, max_seqs_per_shard=seqs,
                               prefix_reuse=prefix_reuse, vocab_size=VOCAB,
                               planner=self.planner)
    self.scheduler = Scheduler(self.manager, self.planner, self.admission,
                               max_seqs_per_shard=seqs, prefix_reuse=prefix_reuse,
                               cache_decode_blocks=cache_decode_blocks, chunk_tokens=chunk,
                               batching=batching)
    self.next_id = 0
    self.failures = {}  # block key -> the Failure its fetch reports
    self.plans = []
    self.groups_issued = {}  # fetch group -> its fetches, as the runner keeps them
    # When the runner says a step's tokens came, and how long a fetch group took.
    self.clock = lambda: 0.0
    self.fetch_seconds = 0.0

  def submit(self, prompt, max_new_tokens=3, *, on_token=None, stop=()):
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop))
    request, = self.admission.validate([list(prompt)], sampling, "default",
                                       first_id=self.next_id)
    self.next_id += 1
    return self.scheduler.add(RequestHandle(request, self.step, on_token))

  @staticmethod
  def token(request: int, position: int) -> int:
    """The token a row produces: a fixed function of the request and position."""
    return 1 + (7 * request + 3 * position) % (VOCAB - 1)

  def step(self):
    """One step: the scheduler's plan, this test's result for it, the scheduler's update."""
    plan = self.scheduler.schedule()
    self.plans.append(plan)
    # As the worker does: every copy goes where the manager chose, and is reported.
    assert plan.orders.resolved
    for c in plan.orders.to_host:
      self.manager.copied(c.shard, c.dst, c.key, Tier.HOST)
    for key, slot in plan.orders.to_disk:
      self.manager.copied(0, slot, key, Tier.DISK)
    if plan.empty:
      return plan, self.scheduler.update(plan, None)
    tokens = {c.seq.request: self.token(c.seq.request, c.start + len(c.tokens))
              for c in plan.prefill if c.last}
    tokens.update({r.seq.request: self.token(r.seq.request, r.pos + 1) for r in plan.decode})
    if plan.fetch is not None:
      self.groups_issued[plan.fetch.group] = plan.fetch.fetches
    fetched = []
    for group in plan.settle:
      fetches = self.groups_issued[group]
      failures = tuple(self.failures.get(f.key) for f in fetches)
      ok = sum(f is None for f in failures)
      # The worker only reports: the scheduler has the manager release the pins and drop
      # the failed chains.
      fetched.append((group, FetchReport(fetches=fetches, failures=failures, blocks=ok,
                                         bytes=ok * self.config.page_bytes,
                                         seconds=self.fetch_seconds,
                                         tiers=tuple(sorted({int(f.tier) for f in fetches})))))
    result = StepResult(tokens=tokens, logits=None, t_tokens=self.clock(),
                        fetched=tuple(fetched))
    return plan, self.scheduler.update(plan, result)

  def run(self, handles, limit=100):
    for _ in range(limit):
      if all(h.finished for h in handles):
        return
      self.step()
    raise AssertionError(f"not finished after {limit} steps")

  def put_in_host(self, tokens, shard=0, upto=None, tier=Tier.HOST):
    """Publishes a prompt's first blocks in a lower tier (as a write-through would)."""
    keys = self.index.block_keys(np.asarray(tokens, np.int32), "default")[:upto]
    shard = 0 if tier == Tier.DISK else shard  # one disk for the job
    for j, key in enumerate(keys):
      slot, = self.index.allocate(shard, 1, tier)
      self.index.publish(shard, slot, key, tier, parent=keys[j - 1] if j else None)
      self.index.release(shard, [slot], tier)
    return keys

  def referenced(self, shard=0, tier=Tier.DEVICE):
    return sum(self.index.held_slots(shard, tier).values())


@pytest.fixture
def loop_factory():
  return Loop


def prompt(n, start=1):
  return [start + (i % (VOCAB - 2)) for i in range(n)]


def expected(loop, handle, n):
  """The tokens ``Loop.token`` gives a request of prompt length ``n``."""
  length = len(handle.request.tokens)
  return [loop.token(handle.id, length + i) for i in range(n)]


# ---- one request through its stages ---------------------------------------------------------
def test_a_request_prefills_in_chunks_then_decodes_and_releases_its_pages(loop_factory):
  loop = loop_factory(chunk_pages=2)
  h = loop.submit(prompt(21), max_new_tokens=3)
  plan, _ = loop.step()
  assert plan.admitted == (h.id,) and [(c.start, len(c.tokens)) for c in plan.prefill] == [(0, 8)]
  plan, _ = loop.step()
  assert [(c.start, len(c.tokens), c.last) for c in plan.prefill] == [(8, 8, False)]
  plan, out = loop.step()
  assert [(c.start, len(c.tokens), c.last) for c in plan.prefill] == [(16, 5, True)]
  assert out[0].new_tokens == (loop.token(h.id, 21),) and h.tokens == [loop.token(h.id, 21)]
  loop.run([h])
  assert h.finish_reason == "length" and h.tokens == expected(loop, h, 3)
  assert loop.referenced() == 0  # every page released
  loop.index.check_invariants()
  assert loop.stats["requests"] == 1 and loop.stats["prompt_tokens"] == 21


def test_a_stop_token_ends_a_request_before_its_length(loop_factory):
  loop = loop_factory()
  probe = loop_factory()
  h0 = probe.submit(prompt(6), max_new_tokens=5)
  probe.run([h0])
  stop = h0.tokens[1]  # the second token it would produce
  h = loop.submit(prompt(6), max_new_tokens=5, stop=[stop])
  loop.run([h])
  assert h.finish_reason == "stop" and h.tokens == h0.tokens[:2]


# ---- admission under pressure -----------------------------------------------------------------
def test_a_request_waits_for_pages_and_runs_once_another_releases_them(loop_factory):
  loop = loop_factory(pages=8, seqs=2, prefix_reuse=False)
  a = loop.submit(prompt(17), max_new_tokens=2)  # 5 pages
  b = loop.submit(prompt(17, start=40), max_new_tokens=2)  # 5 more: only 3 are left
  plan, _ = loop.step()
  assert plan.admitted == (a.id,) and [r.id for r in loop.scheduler.waiting] == [b.id]
  while not a.finished:
    plan, _ = loop.step()
    assert b.id not in plan.admitted
  plan, _ = loop.step()
  assert plan.admitted == (b.id,)
  loop.run([b])
  assert b.tokens == expected(loop, b, 2)


def test_rows_per_shard_bound_the_batch(loop_factory):
  loop = loop_factory(seqs=1)
  a, b = loop.submit(prompt(5)), loop.submit(prompt(5, start=30))
  plan, _ = loop.step()
  assert plan.admitted == (a.id,)
  loop.run([a])
  assert not b.finished and b.id not in {r for p in loop.plans for r in p.admitted}
  loop.run([b])
  assert b.tokens == expected(loop, b, 3)


def test_waves_admit_only_into_an_empty_batch(loop_factory):
  loop = loop_factory(seqs=4, batching="waves")
  a = loop.submit(prompt(5), max_new_tokens=4)
  loop.step()
  b = loop.submit(prompt(5, start=30))
  while not a.finished:
    plan, _ = loop.step()
    assert b.id not in plan.admitted
  plan, _ = loop.step()
  assert plan.admitted == (b.id,) and loop.stats["waves"] == 2


# ---- aborts at every stage ----------------------------------------------------------------------
@pytest.mark.parametrize("stage", ["waiting", "prefilling", "decoding"])
def test_an_abort_at_any_stage_ends_that_request_and_releases_what_it_held(loop_factory, stage):
  loop = loop_factory(seqs=1, chunk_pages=1)
  other = loop.submit(prompt(9, start=50), max_new_tokens=4)
  h = loop.submit(prompt(13), max_new_tokens=6)
  if stage != "waiting":
    loop.run([other])
    loop.step()  # h is admitted and prefills its first chunk
    assert loop.scheduler.running and not h.tokens
    while stage == "decoding" and not h.tokens:
      loop.step()
  assert loop.referenced() == (0 if stage == "waiting" else 5)  # 13 + 6 - 1 tokens of KV
  loop.scheduler.abort(h.id)
  plan, out = loop.step()
  assert plan.aborted == (h.id,) and h.finished and h.finish_reason == "abort"
  assert out[0].handle is h and out[0].finished
  assert h.id not in {c.seq.request for c in plan.prefill} | {r.seq.request for r in plan.decode}
  loop.run([other])
  assert other.tokens == expected(loop, other, 4)
  assert loop.referenced() == 0 and loop.stats["aborted_requests"] == 1
  loop.index.check_invariants()


def test_an_abort_waits_for_the_fetch_group_in_flight_then_releases(loop_factory):
  # A split: blocks [0, 2) recomputed (two one-page chunks) while [2, 4) are fetched.
  loop = loop_factory(host_pages=8, chunk_pages=1, decision="split", force_split=2)
  tokens = prompt(21)
  loop.put_in_host(tokens, upto=4)
  h = loop.submit(tokens, max_new_tokens=2)
  plan, _ = loop.step()
  group = plan.fetch.group
  assert [f.block for f in plan.fetch.fetches] == [2, 3] and plan.settle == ()
  assert sum(loop.index.held_slots(0, Tier.HOST).values()) == 2  # the fetches' pins
  loop.scheduler.abort(h.id)
  plan, _ = loop.step()  # the fetch is in flight into its pages: it stays until it settles
  assert plan.aborted == () and not h.finished and plan.settle == (group,)
  plan, _ = loop.step()
  assert plan.aborted == (h.id,) and h.finish_reason == "abort"
  assert loop.referenced() == 0 and sum(loop.index.held_slots(0, Tier.HOST).values()) == 0
  loop.index.check_invariants()


def test_after_a_failed_step_every_request_ends_and_no_order_or_reference_is_left(loop_factory):
  loop = loop_factory(seqs=2)
  a, b = loop.submit(prompt(9)), loop.submit(prompt(9, start=30))
  c = loop.submit(prompt(9, start=60))
  loop.step()  # a's and b's first blocks are published: write-through orders are pending
  assert loop.scheduler.has_orders()
  unsettled = loop.scheduler.fail_all()
  assert unsettled == {} and not loop.scheduler.has_orders()
  assert all(h.finished and h.finish_reason == "error" for h in (a, b, c))
  assert loop.referenced() == 0 and not loop.scheduler.has_work()
  loop.index.check_invariants()


def test_a_raising_on_token_ends_its_own_request_and_no_other(loop_factory):
  loop = loop_factory(seqs=2)

  def boom(token):
    raise RuntimeError("the caller's callback")

  bad = loop.submit(prompt(5), max_new_tokens=4, on_token=boom)
  good = loop.submit(prompt(5, start=30), max_new_tokens=4)
  loop.run([bad, good])
  assert bad.finish_reason == "error" and len(bad.tokens) == 1
  assert good.finish_reason == "length" and good.tokens == expected(loop, good, 4)
  assert loop.stats["failed_requests"] == 1 and loop.referenced() == 0


# ---- fetches: the plan, a failure, a late arrival ------------------------------------------------
def test_host_hits_are_one_fetch_group_into_the_requests_pages(loop_factory):
  loop = loop_factory(host_pages=8, chunk_pages=1)
  tokens = prompt(17)
  keys = loop.put_in_host(tokens, upto=3)
  h = loop.submit(tokens, max_new_tokens=2)
  plan, _ = loop.step()
  seq = next(iter(loop.scheduler.running.values()))
  assert [(f.block, f.tier, f.key, f.page) for f in plan.fetch.fetches] == [
      (j, Tier.HOST, keys[j], seq.placement.pages[j]) for j in range(3)]
  assert plan.moves() == {"fetch_host": 3}
  assert "fetch_host 3" in plan.summary()
  assert [(c.start, len(c.tokens)) for c in plan.prefill] == []  # all fetched: nothing to recompute
  loop.run([h])
  assert loop.stats.hits["host"] == 3 and h.cached_tokens == 12
  assert h.tokens == expected(loop, h, 2)


@pytest.mark.parametrize("failure", [Failure.CHECKSUM, Failure.DEADLINE])
def test_a_failed_or_late_fetch_recomputes_from_that_block_on(loop_factory, failure):
  loop = loop_factory(host_pages=8, chunk_pages=4)
  tokens = prompt(21)
  keys = loop.put_in_host(tokens, upto=4)
  loop.failures[keys[1]] = failure  # block 1's read fails (bad bytes, or past the deadline)
  h = loop.submit(tokens, max_new_tokens=2)
  plan, _ = loop.step()
  assert len(plan.fetch.fetches) == 4 and plan.settle == (plan.fetch.group,)
  # The failed block and the chain after it are gone from the host tier, block 0 stays.
  assert [loop.index.slot_of(0, k, Tier.HOST) is not None for k in keys] == [1, 0, 0, 0]
  plan, _ = loop.step()  # the rest of the prompt: from the failed block on
  assert [(c.start, c.recompute) for c in plan.prefill] == [(1 * PAGE, False)]
  loop.run([h])
  assert loop.stats.hits["host"] == 1 and h.cached_tokens == PAGE  # block 0 only
  assert loop.stats["blocks_recomputed"] == 21 // PAGE - 1
  # Recomputed, the chain is written through to host slots the manager chose again.
  assert [loop.index.slot_of(0, k, Tier.HOST) is not None for k in keys] == [1, 1, 1, 1]
  assert h.tokens == expected(loop, h, 2)


@pytest.mark.parametrize("failure", [Failure.CHECKSUM, Failure.GONE, Failure.READ_RETRY])
def test_a_failed_disk_copy_is_forgotten_at_once_and_its_records_deleted_by_the_next_plan(
    loop_factory, failure):
  loop = loop_factory(disk_pages=8, chunk_pages=4)
  tokens = prompt(21)
  keys = loop.put_in_host(tokens, upto=4, tier=Tier.DISK)
  loop.failures[keys[1]] = failure
  h = loop.submit(tokens, max_new_tokens=2)
  plan, _ = loop.step()
  assert plan.moves() == {"fetch_disk": 4} and plan.orders.drop == ()
  assert loop.referenced(tier=Tier.DISK) == 0  # every pin released when the group settled
  on_disk = [loop.index.slot_of(0, k, Tier.DISK) is not None for k in keys]
  plan, _ = loop.step()
  if failure == Failure.READ_RETRY:  # the store raised: the record is kept to read again
    assert on_disk == [1, 1, 1, 1] and plan.orders.drop == ()
  else:  # the chain from the bad block on is forgotten now, its records deleted next step
    assert on_disk == [1, 0, 0, 0]
    gone = failure == Failure.GONE  # (a record not in the store has nothing to delete)
    assert plan.orders.drop == tuple(keys[2 if gone else 1:])
    assert f"drop {len(plan.orders.drop)} disk records" in plan.summary()
  assert [(c.start, c.recompute) for c in plan.prefill] == [(1 * PAGE, False)]
  loop.run([h])
  assert h.cached_tokens == PAGE and h.tokens == expected(loop, h, 2)
  assert all(not p.orders.drop for p in loop.plans[2:])  # once
  loop.index.check_invariants()


class Peers:
  """The remote tier's prefix lookup as admission asks it, answered when the test says:
  ``longest_prefix`` blocks (on the manager's lookup thread) until ``answer`` is called."""

  def __init__(self):
    self.asked, self._answer, self._given = [], None, threading.Event()

  def longest_prefix(self, keys, local):
    self.asked.append((len(keys), local))
    if not self._given.wait(60):
      raise TimeoutError("the test never answered")
    if isinstance(self._answer, BaseException):
      raise self._answer
    return self._answer

  def answer(self, value):
    self._answer = value
    self._given.set()


def settled(loop):
  """Waits (with a deadline) until no peer lookup is out."""
  deadline = time.monotonic() + 60
  while loop.manager.peers_pending():
    assert time.monotonic() < deadline, "the peer lookup never finished"
    loop.manager.wait_for_peer_answer(1.0)


def test_a_request_waits_in_the_queue_for_a_peers_answer_while_others_run(loop_factory):
  loop = loop_factory(chunk_pages=4)
  peers = Peers()
  loop.manager.set_remote(peers)
  tokens = prompt(17)
  a = loop.submit(tokens, max_new_tokens=2)  # asks the peers about its 4 full blocks
  b = loop.submit(prompt(4, start=50), max_new_tokens=2)  # no full block: nothing to ask
  plan, _ = loop.step()
  assert plan.admitted == (b.id,) and [r.id for r in loop.scheduler.waiting] == [a.id]
  plan, _ = loop.step()  # still out: a keeps its place, the loop goes on
  assert a.id not in plan.admitted and loop.manager.peers_pending()
  peers.answer((0, 3))  # peer 0 holds the first 3 blocks
  settled(loop)
  plan, _ = loop.step()
  assert plan.admitted == (a.id,)
  assert [(f.block, f.tier, f.slot) for f in plan.fetch.fetches] == [
      (j, Tier.REMOTE, 0) for j in range(3)]
  loop.run([a, b])
  assert [c.start for p in loop.plans for c in p.prefill if c.seq.request == a.id] == [3 * PAGE]
  assert peers.asked == [(4, 0)]  # asked once, off the loop
  assert loop.stats.hits["remote"] == 3 and a.cached_tokens == 3 * PAGE
  assert a.tokens == expected(loop, a, 2) and b.tokens == expected(loop, b, 2)
  assert loop.referenced() == 0


def test_a_peer_lookup_that_fails_leaves_the_request_to_recompute(loop_factory):
  loop = loop_factory(chunk_pages=8)
  peers = Peers()
  loop.manager.set_remote(peers)
  a = loop.submit(prompt(17), max_new_tokens=2)
  plan, _ = loop.step()
  assert plan.empty and [r.id for r in loop.scheduler.waiting] == [a.id]  # no CapacityError
  peers.answer(ConnectionResetError("the peer went away"))
  settled(loop)
  plan, _ = loop.step()
  assert plan.admitted == (a.id,) and plan.fetch is None
  assert [(c.start, c.recompute) for c in plan.prefill] == [(0, False)]
  loop.run([a])
  assert loop.stats["peer_lookup_errors"] == 1 and a.cached_tokens == 0
  assert a.tokens == expected(loop, a, 2)


class Broadcast:
  """Process 0's bytes to every process, a collective (as ``distributed.broadcast_bytes``)
  between the threads that stand for a job's processes."""

  def __init__(self, processes):
    self.barrier, self.value = threading.Barrier(processes, timeout=60), None

  def of(self, process):
    def share(payload: bytes) -> bytes:
      if process == 0:
        self.value = payload
      self.barrier.wait()
      out = self.value
      self.barrier.wait()  # every process has read it before the next
      return out
    return share


def test_in_a_job_process_0_asks_the_peer_and_every_process_admits_with_its_answer():
  """Two schedulers in lockstep, as the processes of a job: only process 0 asks the
  peer; its answer reaches both at the start of the same step, so both plans stay the
  same, step for step, fetches included."""
  broadcast = Broadcast(2)
  loops = [Loop(chunk_pages=4, share_answers=broadcast.of(i), asks_peers=i == 0)
           for i in range(2)]
  peers = [Peers(), Peers()]
  for loop, p in zip(loops, peers):
    loop.manager.set_remote(p)
  handles = [(loop.submit(prompt(17), max_new_tokens=2),
              loop.submit(prompt(4, start=50), max_new_tokens=2)) for loop in loops]

  def step_all():
    plans = [None, None]

    def run(i):
      plans[i] = loops[i].step()[0]
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(60)
    assert all(p is not None for p in plans), "a process's step did not finish"
    return plans

  for _ in range(2):  # the question is out: on both, a waits and b runs
    plans = step_all()
    assert all(l.manager.peers_pending() for l in loops)
  assert [p.admitted for p in plans] == [(), ()]
  peers[0].answer((0, 3))
  assert loops[0].manager.wait_for_peer_answer(60)  # answered on process 0 only, so far
  assert loops[1].manager.wait_for_peer_answer(0.0)  # (nothing of its own to wait for)
  plans = step_all()
  for (a, _), plan in zip(handles, plans):
    assert plan.admitted == (a.id,)
    assert [(f.block, f.tier, f.slot) for f in plan.fetch.fetches] == [
        (j, Tier.REMOTE, 0) for j in range(3)]
  while any(loop.scheduler.has_work() for loop in loops):
    step_all()
  assert peers[0].asked == [(4, 0)] and peers[1].asked == []
  assert [l.stats["peer_lookups"] for l in loops] == [1, 0]
  assert [[p.summary() for p in l.plans] for l in loops[1:]] == [
      [p.summary() for p in loops[0].plans]]
  for loop, (a, b) in zip(loops, handles):
    assert a.cached_tokens == 3 * PAGE and a.tokens == expected(loop, a, 2)
    assert b.tokens == expected(loop, b, 2) and loop.referenced() == 0
    assert not loop.manager.peers_pending()


def test_an_aborted_request_stops_waiting_for_its_peers_answer(loop_factory):
  loop = loop_factory()
  peers = Peers()
  loop.manager.set_remote(peers)
  a = loop.submit(prompt(17), max_new_tokens=2)
  loop.step()
  assert loop.manager.peers_pending()
  loop.scheduler.abort(a.id)
  plan, _ = loop.step()
  assert plan.aborted == (a.id,) and a.finish_reason == "abort"
  assert not loop.manager.peers_pending()  # its question is dropped with it
  peers.answer((0, 4))  # a late answer changes nothing
  assert not loop.scheduler.waiting and loop.referenced() == 0
  loop.manager.close()


def test_a_split_recomputes_the_front_while_the_back_is_fetched(loop_factory):
  loop = loop_factory(host_pages=8, chunk_pages=1, decision="split", force_split=2)
  tokens = prompt(21)
  loop.put_in_host(tokens, upto=4)
  h = loop.submit(tokens, max_new_tokens=1)
  plan, _ = loop.step()
  assert [f.block for f in plan.fetch.fetches] == [2, 3]  # blocks [2, 4) fetched
  assert [(c.start, c.recompute) for c in plan.prefill] == [(0, True)]
  assert plan.settle == ()  # recompute left: the group waits for it
  plan, _ = loop.step()
  assert [(c.start, c.recompute) for c in plan.prefill] == [(4, True)]
  assert plan.settle == (loop.plans[0].fetch.group,)
  plan, _ = loop.step()
  assert [(c.start, c.recompute) for c in plan.prefill] == [(16, False)]
  loop.run([h])
  assert loop.stats["blocks_split"] == 2 and loop.stats.hits["host"] == 2
  assert sum(loop.index.held_slots(0, Tier.HOST).values()) == 0  # unused pins released


def _ask_with_four_blocks_in_host(loop, tokens) -> tuple[list[int], object]:
  """Puts ``tokens``' first four blocks in the host tier and asks for one token: the blocks
  its first step's plan fetched and the request's ``SplitChoice``; its token is checked
  against recompute."""
  loop.put_in_host(tokens, upto=4)
  h = loop.submit(tokens, max_new_tokens=1)
  plan, _ = loop.step()
  choice = next(iter(loop.scheduler.running.values())).choice
  loop.run([h])
  assert h.tokens == expected(loop, h, 1)
  return ([f.block for f in plan.fetch.fetches] if plan.fetch else []), choice


def test_splits_that_do_not_overlap_teach_the_plan_to_fetch_everything(loop_factory):
  """Under the cost decision, a request whose 4 cold blocks cost 4 ms each to recompute
  and 3 ms to fetch splits at 2 (8 ms of recompute beside 6 of fetch, against 12 to fetch
  everything) while a split's halves are thought to overlap. The runner reports each split
  taking their sum and more: the overlap learned falls 1 -> 0.5 -> 0.25, and at 0.25 a split
  (8 + 0.75 x 6 ms) costs more than fetching everything, which the third request does."""
  from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
  loop = loop_factory(host_pages=16, chunk_pages=2, decision="cost")
  costs = CostModel(links={"host_to_device": LinkCost(0.0, loop.config.page_bytes / 3e-3)},
                    prefill=PrefillCurve(0.0, 1e-3, 0.0))  # a block: 4 ms
  loop.planner.set_costs(costs)
  running = lambda: next(iter(loop.scheduler.running.values()))
  # 24 ms from placing to the first token, 8 of them the tail's one chunk: nothing hidden.
  loop.clock = lambda: running().t_admitted + 0.024
  loop.fetch_seconds = 0.006
  seen = [_ask_with_four_blocks_in_host(loop, prompt(21, start=1 + 23 * k)) for k in range(3)]
  assert [blocks for blocks, _ in seen] == [[2, 3], [2, 3], [0, 1, 2, 3]]
  first = seen[0][1]
  assert (first.split, first.recompute_s, first.fetch_s, first.tail_s) == pytest.approx(
      (2, 8e-3, 6e-3, 8e-3), rel=1e-5)
  assert costs.overlap == pytest.approx(0.25)
  assert loop.stats["splits_timed"] == 2 and loop.stats["plans_split"] == 2
  assert loop.stats["plans_fetch"] == 1 and loop.referenced() == 0


def test_a_link_the_plan_stopped_using_is_probed_and_used_again_once_it_is_fast(loop_factory):
  """A host link priced at 100 ms a block against 4 ms to recompute one: the plan recomputes
  every cold block, so nothing times the link. After ``probe_every`` (3) such requests the
  fourth fetches its last ``probe_blocks`` (2) cold blocks beside its recompute; that fetch
  is timed fast (the link sped up), and the next request fetches all of its cold blocks.
  The probe's timing replaces the estimate (stale: nothing timed the link meanwhile) rather
  than averaging with it. (Planted: the probe's timing averaged at link_ewma -> the estimate
  after it is 100x slower than the probe measured.)"""
  from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
  loop = loop_factory(host_pages=32, chunk_pages=2, decision="cost", probe_every=3,
                      probe_blocks=2)
  costs = CostModel(links={"host_to_device": LinkCost(0.0, loop.config.page_bytes / 0.1)},
                    prefill=PrefillCurve(0.0, 1e-3, 0.0))  # a block: 4 ms
  loop.planner.set_costs(costs)
  loop.fetch_seconds = 2e-5  # the probe's 2 blocks: 10 us a block
  fetched, rates = [], []
  for k in range(5):
    fetched.append(_ask_with_four_blocks_in_host(loop, prompt(21, start=1 + 17 * k))[0])
    rates.append(costs.links["host_to_device"].bytes_per_s)
  assert fetched == [[], [], [], [2, 3], [0, 1, 2, 3]]
  assert rates[3] == pytest.approx(2 * loop.config.page_bytes / 2e-5)  # the probe's own
  assert loop.stats["plans_recompute"] == 3 and loop.stats["plans_probe"] == 1
  assert loop.stats["plans_fetch"] == 1 and loop.referenced() == 0
  assert costs.links["host_to_device"].bytes_per_s > loop.config.page_bytes / 4e-3
  assert loop.planner.untimed == {}


# ---- orders: evictions, write-through, the journal's pump -------------------------------------------
def test_published_blocks_are_copied_down_by_the_next_plan_only_under_write_through(
    loop_factory):
  for write_through in (True, False):
    loop = loop_factory(host_pages=8, chunk_pages=2, write_through=write_through)
    tokens = prompt(13)
    h = loop.submit(tokens, max_new_tokens=1)
    plan, _ = loop.step()  # blocks 0, 1 written by this step
    keys = loop.index.block_keys(np.asarray(tokens, np.int32), "default")
    seq = next(iter(loop.scheduler.running.values()))
    plan, _ = loop.step()
    want = tuple((0, seq.placement.pages[j], keys[j]) for j in range(2)) if write_through else ()
    assert plan.orders.write_through == want and plan.orders.demote == ()
    loop.run([h])


def test_evicted_blocks_are_demote_orders_of_the_plan_that_takes_their_pages(loop_factory):
  loop = loop_factory(pages=8, seqs=1, host_pages=8, write_through=False, chunk_pages=2)
  first = prompt(17)
  a = loop.submit(first, max_new_tokens=1)
  loop.run([a])
  keys = loop.index.block_keys(np.asarray(first, np.int32), "default")
  cached = {loop.index.slot_of(0, k, Tier.DEVICE): k for k in keys}
  assert None not in cached and len(cached) == 4
  b = loop.submit(prompt(25, start=40), max_new_tokens=1)  # 7 pages: 4 cached ones must go
  plan, _ = loop.step()
  assert plan.admitted == (b.id,)
  demoted = {(page, key) for _, page, key in plan.orders.demote}
  assert len(demoted) == 3 and demoted <= set(cached.items())
  seq = next(iter(loop.scheduler.running.values()))
  assert {page for page, _ in demoted} <= set(seq.placement.pages)  # its pages now
  assert all(loop.index.slot_of(0, k, Tier.DEVICE) is None for _, k in demoted)
  assert plan.moves()["demote"] == 3
  loop.run([b])


def test_no_eviction_touches_a_held_prefix(loop_factory):
  loop = loop_factory(pages=8, seqs=1, chunk_pages=2)
  system = prompt(9)
  a = loop.submit(system, max_new_tokens=1)
  loop.run([a])
  assert loop.manager.hold(system[:8], "default") == 2
  held = {loop.index.slot_of(0, k, Tier.DEVICE)
          for k in loop.index.block_keys(np.asarray(system[:8], np.int32), "default")}
  b = loop.submit(prompt(21, start=40), max_new_tokens=1)  # 6 pages: all but the held 2
  loop.run([b])
  assert all(not {p for _, p, _ in plan.orders.demote} & held for plan in loop.plans)
  assert {loop.index.slot_of(0, k, Tier.DEVICE) for k in loop.index.block_keys(
      np.asarray(system[:8], np.int32), "default")} == held  # still cached where they were
  with pytest.raises(CapacityError, match="7 device pages but at most 6"):
    loop.submit(prompt(25, start=70), max_new_tokens=1)
  loop.manager.release_hold(system[:8], "default")
  c = loop.submit(prompt(25, start=70), max_new_tokens=1)  # 7 pages: fits once released
  plan, _ = loop.step()
  # 1 free page and 6 of the 7 cached blocks: the released ones are evictable again.
  assert plan.admitted == (c.id,) and len(plan.orders.demote) == 6
  loop.run([c])
  assert loop.referenced() == 0


def test_a_completed_request_orders_the_journals_pump_and_the_loop_says_so(loop_factory):
  loop = loop_factory()
  h = loop.submit(prompt(5), max_new_tokens=1)
  loop.step()  # its only token: it completes in this step's update
  assert h.finished and loop.scheduler.has_orders() and not loop.scheduler.has_work()
  plan, _ = loop.step()  # what the engine runs when no request is left to carry the orders
  assert plan.orders.pump and not plan.empty and plan.decode == plan.prefill == ()
  assert not loop.scheduler.has_orders()


# ---- shared prefixes ------------------------------------------------------------------------------
def test_a_request_sharing_blocks_being_computed_waits_and_then_reuses_them(loop_factory):
  loop = loop_factory(seqs=2, chunk_pages=1)
  shared = prompt(16)
  a = loop.submit(shared + [90, 91], max_new_tokens=1)
  loop.step()  # a computes block 0
  b = loop.submit(shared + [92, 93, 94], max_new_tokens=1)
  plan, _ = loop.step()
  assert b.id not in plan.admitted and loop.stats["shared_prefix_waits"] == 1
  loop.run([a, b])
  assert b.cached_tokens == 16 and loop.stats.hits["device"] == 4
  # b computed only what it did not share
  assert sum(len(c.tokens) for p in loop.plans for c in p.prefill if c.seq.request == b.id) == 3


def test_scheduling_many_requests_keeps_the_index_consistent_and_every_token_exact(
    loop_factory):
  loop = loop_factory(pages=12, seqs=2, host_pages=6, chunk_pages=1)
  rng = np.random.default_rng(0)
  system = prompt(8)
  handles = [loop.submit(system + list(rng.integers(1, VOCAB, size=int(rng.integers(1, 14)))),
                         max_new_tokens=int(rng.integers(1, 4))) for _ in range(12)]
  for i, h in enumerate(handles):
    if i % 5 == 3:
      loop.scheduler.abort(h.id)
  loop.run(handles, limit=400)
  for h in handles:
    if h.finish_reason != "abort":
      assert h.tokens == expected(loop, h, h.request.max_new_tokens)
  assert loop.referenced() == 0
  loop.index.check_invariants()
  assert collections.Counter(h.finish_reason for h in handles) == {"length": 10, "abort": 2}


def test_the_manager_imports_no_jax():
  """The manager (and what it imports) loads with ``jax`` blocked: it is host-side only."""
  code = textwrap.dedent(f"""
      import json, sys, types
      class Block:
        def find_spec(self, name, path=None, target=None):
          if name == "jax" or name.startswith(("jax.", "jaxlib", "flax")):
            raise ImportError("blocked: " + name)
      sys.meta_path.insert(0, Block())
      package = types.ModuleType("jaxkv")  # the package's __init__ re-exports the engine
      package.__path__ = [{os.path.join(ROOT, "jaxkv")!r}]
      sys.modules["jaxkv"] = package
      import jaxkv.manager, jaxkv.manager.index
      index = jaxkv.manager.index.PrefixIndex(num_shards=1, pages_per_shard=4, page_size=2,
                                      fingerprint=b"f" * 32)
      m = jaxkv.manager.CacheManager(index, stats=None, page_bytes=64,
                                     write_through=True, has_disk=False)
      pages, evicted = m.allocate_pages(0, 3)
      print(json.dumps([pages, list(evicted), sorted(n for n in sys.modules
                                                     if n.startswith("jax"))]))
      """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
  assert out.returncode == 0, out.stderr
  pages, evicted, loaded = json.loads(out.stdout)
  assert pages == [0, 1, 2] and evicted == []
  assert "jaxkv.manager" in loaded and not [n for n in loaded if n.split(".")[0] != "jaxkv"]
