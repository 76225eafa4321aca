"""The REMOTE tier's adapter: ``RemoteTier``, a job's peers behind the tier protocol.

The peers of ``TierConfig.remote_peers`` (a ``client.RemoteClient`` each) as one
``FetchSource`` (``jaxkv.worker.tiers.base``): the longest prefix any of them holds, and
its blocks pulled on a thread of their own while the step recomputes.
"""

from __future__ import annotations

import threading
import time

from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.base import Failure, Fetch, FetchOutcome
from jaxkv.worker.tiers.remote.client import RemoteClient
from jaxkv.worker.tiers.remote.wire import MAX_FETCH_BLOCKS


class RemoteTier:
  """The peers of ``TierConfig.remote_peers`` as one ``FetchSource``: each request's
  blocks from one peer come in one ``fetch`` per ``MAX_FETCH_BLOCKS`` blocks."""

  tier = Tier.REMOTE

  def __init__(self, clients: list[RemoteClient], payload_shape: tuple, dtype,
               window_shape: tuple | None = None, group: int = 0):
    """``window_shape``: a model with a window group's window KV of one block (what
    ``windows()`` fetches); ``group`` 1: this is that view."""
    self.clients, self.payload_shape, self.dtype = clients, tuple(payload_shape), dtype
    self.window_shape, self.group = window_shape, group
    if not group:
      for client in clients:  # before any connection: sizes the largest answer it reads
        client.expect(self.payload_shape, dtype, window_shape)

  def windows(self) -> "RemoteTier":
    """The same peers as a source of the blocks' window KV (``FetchBlocks.group`` 1)."""
    return RemoteTier(self.clients, self.window_shape, self.dtype, group=1)

  def longest_prefix(self, keys: list[bytes], local: int, windows: bool = False
                     ) -> tuple | None:
    """``(peer, blocks)`` of the peer holding the longest prefix of ``keys``, when it is
    longer than the ``local`` blocks this job holds; with ``windows``, ``(peer, blocks,
    [j, ...])``: and the blocks among the last two windows' of it whose window KV that peer
    holds too."""
    best = None
    if len(keys) > local:
      for i, client in enumerate(self.clients):
        n, held = client.lookup_windows(keys, windows)
        n = min(n, len(keys))
        if n > local and (best is None or n > best[1]):
          best = (i, n, list(held)) if windows else (i, n)
    return best

  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, "_Pulls"]:
    """Starts pulling every fetch's blocks on a thread of its own and returns at once: the
    bytes cross the link while the step recomputes (a split's front), as the plan that
    chose it assumes. Each pull has the peer's own deadline (``read_deadline_s``)."""
    deadline = time.monotonic() + max((c.deadline_s for c in self.clients), default=0.0)
    return None, _Pulls(lambda: self._pull(tuple(fetches), deadline), tuple(fetches))

  def finish_fetch(self, pulls: "_Pulls", t_end: float, stage) -> FetchOutcome:
    """Waits for the pulls until ``t_end``; blocks not there by then are misses
    (``Failure.DEADLINE``: their pull ends by its own deadline, its bytes unused)."""
    if not pulls.done.wait(max(0.0, t_end - time.monotonic())) or pulls.result is None:
      return FetchOutcome(None, (Failure.DEADLINE,) * pulls.count)
    staged, failures = pulls.result
    trips = [t for t in (self.clients[f.slot].round_trip_s for f in pulls.fetches)
             if t is not None]
    return FetchOutcome(stage(staged) if staged else None, failures, arrived=pulls.arrived,
                        latency_s=max(trips) if trips else None)

  def _pull(self, fetches: tuple[Fetch, ...], deadline: float) -> tuple[list, list]:
    """Per request and peer, its blocks in chain order, ``MAX_FETCH_BLOCKS`` a ``fetch``;
    a fetch that fails fails every block of it and of the request's later fetches (the
    request recomputes from its first failed block anyway). Returns the staged blocks
    and each fetch's failure (None: verified)."""
    groups: dict = {}
    for i, f in enumerate(fetches):
      groups.setdefault((f.request, f.slot), []).append(i)
    staged, failures = [], [None] * len(fetches)
    for (_, peer), positions in groups.items():
      positions.sort(key=lambda i: fetches[i].block)
      failure = None
      for lo in range(0, len(positions), MAX_FETCH_BLOCKS):
        part = positions[lo:lo + MAX_FETCH_BLOCKS]
        if failure is None:
          try:
            stack = self.clients[peer].fetch([fetches[i].key for i in part],
                                             self.payload_shape, self.dtype, deadline,
                                             group=self.group)
          except Exception as e:  # pylint: disable=broad-except  (any failed pull is a miss)
            failure = Failure.of(e, Failure.REMOTE)
        if failure is not None:
          for i in part:
            failures[i] = failure
          continue
        for j, i in enumerate(part):
          staged.append((fetches[i].shard, fetches[i].page, stack[j]))
    return staged, tuple(failures)


class _Pulls:
  """A ``RemoteTier`` fetch group's pulls, running on a daemon thread from ``start_fetch``
  on (``RemoteClient`` lets one call at a time use its connection; lookups wait their
  turn). ``result`` is set before ``done``; None when the thread failed."""

  def __init__(self, run, fetches: tuple):
    self.result = None
    self.done = threading.Event()
    self.fetches = fetches
    self.count = len(fetches)  # a miss each when the pulls are not done in time
    self.arrived = None  # perf_counter when the last pull ended
    self._thread = threading.Thread(target=self._run, args=(run,), daemon=True,
                                    name="jaxkv-remote-pull")
    self._thread.start()

  def _run(self, run) -> None:
    try:
      self.result = run()
    finally:
      self.arrived = time.perf_counter()
      self.done.set()
