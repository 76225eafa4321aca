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

Backends import nothing above them (index, pages, buckets and config only).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from jaxkv.manager.index import Tier


class Failure(str, enum.Enum):
  """Why a fetched block was not used (the value is the name stats report)."""

  # The bytes are wrong: a verification failure.
  SIZE = "size"  # record of the wrong length
  MAGIC = "magic"  # not a jaxkv record (missing, truncated, foreign)
  VERSION = "version"  # another record format
  FINGERPRINT = "fingerprint"  # another model, dtype or layout
  KEY = "key"  # another block (swapped, stale, another tenant's)
  SHAPE = "shape"  # wrong dtype or shape
  CHECKSUM = "checksum"  # the bytes changed
  MAC = "mac"  # the keyed tag does not verify: forged, damaged, or another key's
  MODE = "mode"  # keyless record for a keyed reader (forgeable), or keyed one for a keyless
  TOKEN = "token"  # a remote offer answering another request
  READ_ERROR = "read_error"  # the store raised while reading, again: given up on
  REMOTE = "remote"  # a remote fetch failed in an unclassified way
  MALFORMED = "malformed"  # a remote answer breaks the protocol (schema, frames, sizes)
  NOT_A_FILE = "not_a_file"  # a link, FIFO, socket, device or directory under a record's name
  # The bytes never came: a miss, not a corruption.
  DEADLINE = "deadline"  # not there before the deadline
  BREAKER = "breaker"  # the peer's circuit breaker is open
  IO = "io"  # the connection to the peer failed
  REFUSED = "refused"  # the peer answered with an error
  CLOSED = "closed"  # the peer closed the connection
  PULL = "pull"  # the transfer itself failed
  READ_RETRY = "read_retry"  # the store raised while reading; the record is kept to retry
  GONE = "gone"  # the record is not in the store (another process sharing it evicted it)

  @property
  def corrupt(self) -> bool:
    """True when the copy was read and is wrong (as opposed to late or unreachable)."""
    return self not in _UNAVAILABLE

  @classmethod
  def of(cls, error: BaseException, default: "Failure") -> "Failure":
    """The failure an exception names through its ``reason``, else ``default``."""
    try:
      return cls(getattr(error, "reason", default))
    except ValueError:
      return default


_UNAVAILABLE = frozenset({Failure.DEADLINE, Failure.BREAKER, Failure.IO, Failure.REFUSED,
                          Failure.CLOSED, Failure.PULL, Failure.READ_RETRY,
                          Failure.GONE})


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
      self.open_until = time.monotonic() + self.cool_down_s
      self.failures = self.trip_after - 1  # after the cool-down, one more failure re-opens


@dataclasses.dataclass(frozen=True)
class Fetch:
  """One lower-tier block to copy into a request's device page. What to bring where, and
  nothing else: its outcome comes back as a value (``FetchOutcome``, ``FetchReport``)."""

  request: int  # the requesting sequence (groups a request's remote blocks in one pull)
  block: int  # index of the block in the request's chain
  shard: int  # data shard of the destination page
  tier: Tier
  slot: Any  # where the block is: a slot (host, disk), a peer (remote), (shard, page) (shard)
  key: bytes
  page: int  # destination device page (shard-local)


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


@dataclasses.dataclass(frozen=True)
class FetchReport:
  """One finished promotion (``TierMover.finish_promote``), as its caller and the planner
  read it.

  ``failures[i]`` is ``None`` when ``fetches[i]`` was verified and is in its device page
  now, else why it was not (the mover dropped that copy already; the caller recomputes
  that request from its first failed block on). ``blocks`` and ``bytes``
  count the verified blocks, ``seconds`` runs from issuing the reads to the last block's
  bytes arriving on the device (0: not timed, a copy across shards only), and ``tiers``
  lists the tiers fetched from (sorted ``int(Tier)`` values): what the planner learns a
  link's speed from.
  """

  fetches: tuple[Fetch, ...]
  failures: tuple[Failure | None, ...]
  blocks: int
  bytes: int
  seconds: float
  tiers: tuple[int, ...]

  def __post_init__(self):
    if len(self.failures) != len(self.fetches):
      raise ValueError(f"FetchReport has {len(self.fetches)} fetches but "
                       f"{len(self.failures)} failures; give one (None: verified) per fetch.")
