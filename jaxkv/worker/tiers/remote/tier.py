"""The REMOTE tier's adapter: ``RemoteTier``, a job's peers behind the tier protocol.

The peers of ``TierConfig.remote_peers`` (a ``client.RemoteClient`` each) as one
``FetchSource`` (``jaxkv.worker.tiers.base``): the longest prefix any of them holds, and
its blocks fetched after the step's recompute.
"""

from __future__ import annotations

from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.base import Failure, Fetch, FetchOutcome
from jaxkv.worker.tiers.remote.client import RemoteClient
from jaxkv.worker.tiers.remote.wire import MAX_FETCH_BLOCKS


class RemoteTier:
  """The peers of ``TierConfig.remote_peers`` as one ``FetchSource``: each request's
  blocks from one peer come in one ``fetch`` per ``MAX_FETCH_BLOCKS`` blocks."""

  tier = Tier.REMOTE

  def __init__(self, clients: list[RemoteClient], payload_shape: tuple, dtype):
    self.clients, self.payload_shape, self.dtype = clients, tuple(payload_shape), dtype
    for client in clients:  # before any connection: sizes the largest answer it reads
      client.expect(self.payload_shape, dtype)

  def longest_prefix(self, keys: list[bytes], local: int) -> tuple[int, int] | None:
    """``(peer, blocks)`` of the peer holding the longest prefix of ``keys``, when it is
    longer than the ``local`` blocks this job holds."""
    best = None
    if len(keys) > local:
      for i, client in enumerate(self.clients):
        n = min(client.lookup(keys), len(keys))
        if n > local and (best is None or n > best[1]):
          best = (i, n)
    return best

  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, tuple[Fetch, ...]]:
    return None, tuple(fetches)  # a fetch waits: it runs in finish_fetch, after the recompute

  def finish_fetch(self, fetches: tuple[Fetch, ...], t_end: float, stage) -> FetchOutcome:
    """Per request and peer, its blocks in chain order, ``MAX_FETCH_BLOCKS`` a ``fetch``;
    a fetch that fails fails every block of it and of the request's later fetches (the
    request recomputes from its first failed block anyway)."""
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
                                             self.payload_shape, self.dtype, t_end)
          except Exception as e:  # pylint: disable=broad-except  (any failed pull is a miss)
            failure = Failure.of(e, Failure.REMOTE)
        if failure is not None:
          for i in part:
            failures[i] = failure
          continue
        for j, i in enumerate(part):
          staged.append((fetches[i].shard, fetches[i].page, stack[j]))
    return FetchOutcome(stage(staged) if staged else None, tuple(failures))
