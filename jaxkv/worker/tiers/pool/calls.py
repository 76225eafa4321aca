"""Calls into the Mooncake client that a pool participant cannot make anyone wait on.

A client call can stay inside the client far longer than anyone should wait for it: a get
or put whose segment's owner keeps its registration but stops serving transfers returns
after the client's own 30 s, and any call blocks ~4 s while the master is down. Such a call
cannot be interrupted, so each runs on a thread of its own kind and is waited for up to a
deadline; a call given up on is left to finish in the client (its arguments live as long as
the call), and ``Calls`` remembers it so that the client is never closed under it.

Invariants:

- No call queues behind a stuck one: an ``Asker`` has one question in the client at a time
  (the next is answered "none" at once), and ``PutCalls`` fails a call at once when every put
  thread is still inside the client.
- Each kind of call has its own threads: a hand-off's check never takes the lookup thread
  that every tenant's admission shares, and puts never take either.
- ``Outcomes`` is what this process knows of its own puts (queued, placed, missed), so a
  waiter can wait for its own keys rather than for the whole queue.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time

from absl import logging

QUEUED, PLACED, MISSED = "queued", "placed", "missed"  # a put's outcome, per key


class Calls:
  """The calls submitted into the client that have not returned (``close`` waits for them:
  a call a deadline gave up on may still be inside it, e.g. a get from a lender that stopped
  answering, held for the client's own timeout)."""

  def __init__(self):
    self._futures: set = set()

  def submit(self, threads, fn, *args) -> concurrent.futures.Future:
    future = threads.submit(fn, *args)
    self._futures.add(future)
    future.add_done_callback(self._futures.discard)
    return future

  def running_after(self, timeout_s: float) -> int:
    return len(concurrent.futures.wait(list(self._futures), timeout=timeout_s)[1])


class Asker:
  """One thread that asks the master which names it holds, one question at a time: a
  question stuck in the client is left to finish there and the next one is skipped
  (answered "none", counted ``<what>_skipped``), never queued behind it. Lookups and
  hand-offs each have their own, so neither takes the other's."""

  def __init__(self, what: str, calls: Calls, breaker, stats):
    self.what = what  # the counters' prefix: pool_lookup, pool_hand_off_check
    self._calls, self._breaker, self._stats = calls, breaker, stats
    self._threads = concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix=f"jaxkv-{what.replace('_', '-')}")
    self._asking: concurrent.futures.Future | None = None
    self._lock = threading.Lock()

  def ask(self, batch_is_exist, names: list[str], timeout_s: float) -> list[bool]:
    """Which of ``names`` the pool holds; none when the answer fails or is late (a failure
    toward the breaker)."""
    none = [False] * len(names)
    with self._lock:
      if self._asking is not None and not self._asking.done():
        self._stats.add(f"{self.what}_skipped")  # the last one is still stuck in the client
        return none
      self._asking = asking = self._calls.submit(self._threads, batch_is_exist, names)
    try:
      codes = asking.result(timeout=max(0.0, timeout_s))
    except concurrent.futures.TimeoutError:
      self._breaker.record(False)
      self._stats.add(f"{self.what}_timeouts")
      return none
    except Exception:  # pylint: disable=broad-except  (a pool that fails is a miss)
      logging.exception("pool %s failed", self.what)
      self._breaker.record(False)
      self._stats.add(f"{self.what}_errors")
      return none
    if any(c < 0 for c in codes):
      self._breaker.record(False)
      self._stats.add(f"{self.what}_errors")
      return none
    self._breaker.record(True)
    return [c > 0 for c in codes]

  def shutdown(self) -> None:
    self._threads.shutdown(wait=False, cancel_futures=True)


class PutCalls:
  """The put side's client calls, on ``threads`` threads, each waited for ``deadline_s``.
  Used by the one put thread only."""

  def __init__(self, calls: Calls, threads: int, deadline_s: float):
    self._calls, self._threads, self.deadline_s = calls, threads, deadline_s
    self._pool = concurrent.futures.ThreadPoolExecutor(threads,
                                                       thread_name_prefix="jaxkv-pool-putc")
    self._inside: list = []  # calls submitted that may still be inside the client

  def __call__(self, fn, *args):
    """``fn(*args)``; raises TimeoutError when it is not done within the deadline (it is left
    to finish in the client) or, at once, when every put thread is still inside the client
    with an earlier call."""
    self._inside = [f for f in self._inside if not f.done()]
    if len(self._inside) >= self._threads:
      raise TimeoutError(f"{self._threads} put calls are still inside the pool client")
    try:
      future = self._calls.submit(self._pool, fn, *args)
    except RuntimeError:  # shut down (closing, or the interpreter exits): a put not made
      raise TimeoutError("the pool's put threads are shut down") from None
    self._inside.append(future)
    return future.result(timeout=self.deadline_s)

  def shutdown(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


class Outcomes:
  """The newest outcome of each key this process queued for the pool (the last ``keep``)."""

  def __init__(self, keep: int):
    self._keep = keep
    self._by_key: collections.OrderedDict = collections.OrderedDict()
    self._changed = threading.Condition()

  def set(self, keys, outcome: str, *, where: str | None = None) -> None:
    """``keys``' outcome is ``outcome`` (only those now ``where``, when given)."""
    with self._changed:
      for key in keys:
        if where is not None and self._by_key.get(key) != where:
          continue
        self._by_key[key] = outcome
        self._by_key.move_to_end(key)
      while len(self._by_key) > self._keep:
        self._by_key.popitem(last=False)
      self._changed.notify_all()

  def placed_run(self, keys: list[bytes], t_end: float, ask) -> int:
    """How many of ``keys``, from the front, are placed, waiting until ``t_end`` (monotonic)
    for those still queued. Keys without an outcome here are asked about once,
    ``ask(keys, timeout_s) -> [bool]``; one the pool lacks may still be queued later (a
    write-through is carried out by the engine's next step), so it is waited for too."""
    held: set = set()  # keys without an outcome here that the pool said it holds
    asked = False
    while True:
      with self._changed:
        while True:
          states = [self._by_key.get(k) for k in keys]
          lead = next((i for i, (k, o) in enumerate(zip(keys, states))
                       if not (o == PLACED or (o is None and k in held))), len(keys))
          if lead == len(keys) or states[lead] == MISSED:
            return lead
          if states[lead] is None and not asked:
            break  # asked below, outside the lock: the put thread sets outcomes meanwhile
          left = t_end - time.monotonic()
          if left <= 0:
            return lead
          self._changed.wait(left)
      asked = True
      rest = list(keys[lead:])
      there = ask(rest, max(0.0, t_end - time.monotonic()))
      held.update(k for k, p in zip(rest, there) if p)
