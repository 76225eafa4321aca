"""What every lower tier offers the mover, and why a block read from one can fail.

A *fetch* brings one cached block from a lower tier (host memory, disk, another job) into
a device page a request was given. Every tier backend serves fetches in two halves, so
the caller can issue all of them, run the recompute part of a plan meanwhile, and only
then wait:

- ``start_fetch(fetches)`` issues every read and returns at once. It may already return
  a ``Landing`` (the host tier's copy is an async device transfer that can be scattered
  right away; its verification comes later).
- ``finish_fetch(pending, t_end, stage)`` waits until ``t_end`` (``time.monotonic``) at
  the latest, verifies every block (checksum, key, model fingerprint, dtype, shape) and
  returns a ``FetchOutcome``: the verified blocks still to land (``stage``, given by the
  caller, who knows the device layout, turns host bytes into one) and one ``Failure`` or
  ``None`` per fetch, in the order the fetches were given to ``start_fetch``.

Results are values. A ``Fetch`` is frozen: it says what to bring where, and nobody writes
an outcome into it. Each backend returns its outcomes, the mover (``jaxkv.worker.transfers``)
gathers them into one ``FetchReport`` per promotion, and the caller reads that report.

A failed fetch is never an exception: it is a ``Failure`` in the outcome, and the caller
recomputes from that block on. ``Failure.corrupt`` separates a bad copy (counted as a
verification failure; the copy and its chain are dropped) from one that was merely
unavailable (late, unreachable: a miss).

Backends import nothing above them (index, pages, buckets and config only; the value types
``Fetch``, ``FetchReport`` and ``Failure`` come from ``jaxkv.scheduling.step``, the one module
the scheduler, the manager and the worker share).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxkv.manager.index import Tier
# The outcome types cross into the scheduler and the manager: they live in the step module.
from jaxkv.scheduling.step import Failure, Fetch, FetchReport  # noqa: F401  (re-exported)


class Breaker:
  """A circuit breaker for a backend (a peer, a store): after ``trip_after`` failures in a
  row it is open for ``cool_down_s``, then tried again (one more failure opens it again)."""

  def __init__(self, trip_after: int = 3, cool_down_s: float = 10.0):
    self.trip_after, self.cool_down_s = trip_after, cool_down_s
    self.failures = 0
    self.open_until = 0.0

  @property
  def available(self) -> bool:
    return time.monotonic() >= self.open_until

  def record(self, ok: bool) -> None:
    if ok:
      self.failures = 0
      return
    self.failures += 1
    if self.failures >= self.trip_after:
      self.trip()

  def trip(self) -> None:
    """Opens now, for ``cool_down_s`` (a failure that needs no repeating to be believed)."""
    self.open_until = time.monotonic() + self.cool_down_s
    self.failures = self.trip_after - 1  # after the cool-down, one more failure re-opens


@dataclasses.dataclass(frozen=True)
class Landing:
  """Blocks ready to scatter into the device pool: shard-local destination pages
  ``[data_shards, n]`` (``pages_per_shard`` = padding, dropped) and their raw bits on device
  ``[2 * layers, kv_heads, data_shards * n, page_size, head_dim]``, or with ``blocks``
  page-major ``[data_shards * n, 2 * layers, kv_heads, page_size, head_dim]`` (as the host
  tier loads them)."""

  dest: np.ndarray
  stack: Any  # jax.Array
  blocks: bool = False


# (shard, destination page, raw-bits payload [2*layers, kv_heads, page_size, head_dim])
Staged = tuple[int, int, np.ndarray]


@dataclasses.dataclass(frozen=True)
class FetchOutcome:
  """What one tier's ``finish_fetch`` found: the verified blocks still to land (None when
  there are none, or the tier landed them in ``start_fetch`` already) and, aligned with
  the fetches given to ``start_fetch``, ``None`` for a block that verified (landed or in
  ``landing``) or the ``Failure`` that kept it out."""

  landing: Landing | None
  failures: tuple[Failure | None, ...]
  # ``time.perf_counter()`` when the tier had the bytes (a read that finished while the
  # step computed, before ``finish_fetch`` was called); None: when ``finish_fetch`` returns.
  # A link's speed is learned from it, not from when the caller came to wait.
  arrived: float | None = None
  # The link's round trip (seconds) as the tier measured it apart from moving bytes (a peer's
  # lookups); None: not measured.
  latency_s: float | None = None


class FetchSource(Protocol):
  """A tier the mover brings blocks up from."""

  tier: Tier

  def start_fetch(self, fetches: Sequence[Fetch]
                  ) -> tuple[Landing | list[Landing] | None, Any]:
    """Issues every read without waiting; returns what can land now (one landing, or one
    per bucket) and a handle."""

  def finish_fetch(self, pending: Any, t_end: float,
                   stage: Callable[[list[Staged]], Landing]) -> FetchOutcome:
    """Waits (until ``t_end`` at the latest) and verifies; returns the blocks still to land
    and each fetch's failure (``None``: verified), in ``start_fetch``'s order."""
