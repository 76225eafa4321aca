"""What crosses between the scheduler and the runner: one ``StepPlan`` down, one ``StepResult`` up.

Both are frozen. The scheduler builds a plan from the cache manager's view (host-side state
only), the runner has the cache worker carry out its tier orders and runs its compute, and
the result comes back as a value the scheduler learns from. This module is the only thing
the two import of each other.

A step in order:
1. ``orders`` (``TierOrders``): the tier work decided since the last step: the disk records
   of chains that failed verification (deleted), write-through copies of blocks the last
   step published, write-back copies of blocks this step's admissions evicted (before their
   pages are reused), the disk journal's pump. Carried out before anything of this step
   writes a page.
2. ``fetch``: the fetch group of this step's admissions, issued (promote).
3. The compute: ``decode`` rows and ``prefill`` chunks.
4. ``settle``: fetch groups waited for and verified while the device computes; each outcome
   comes back in the result's reports, and the scheduler has the manager release the
   fetches' pins and forget each failed copy's chain (its disk records are the next
   step's ``drop``).
5. The tokens read back (``StepResult``).

The fetch types cross here too: a ``Fetch`` (admission places it, the worker's tiers serve
it), its ``Failure`` and the ``FetchReport`` the worker returns and the manager and the
planner read. The tier backends import them from here (``jaxkv.worker.tiers.base``
re-exports them).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import typing
from collections.abc import Mapping
from typing import Any

import numpy as np


if typing.TYPE_CHECKING:  # this module imports no JAX: the scheduler's side is host only
  from jaxkv.config import SamplingParams

Block = tuple  # (shard, device page, key)


class Tier(enum.IntEnum):
  """Where a block's copy lives. The one tier numbering of jaxkv: the index, the scheduler,
  stats and the plan's inputs (``jaxkv.planning.plan``) all use these values."""

  DEVICE = 0
  HOST = 1
  DISK = 2
  REMOTE = 3
  SHARD = 4  # on another data shard's device pool of the same job
  ABSENT = 5  # cached nowhere (plan inputs only: such a block can only be recomputed)
  POOL = 6  # in the memory pool other nodes lend (Mooncake Store), not kept in the index


TIER_NAMES = {Tier.DEVICE: "device", Tier.HOST: "host", Tier.DISK: "disk",
              Tier.REMOTE: "remote", Tier.SHARD: "shard", Tier.POOL: "pool"}
LOCAL_TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)


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
class FetchReport:
  """One finished promotion (``TierMover.finish_promote``), as its caller and the planner
  read it.

  ``failures[i]`` is ``None`` when ``fetches[i]`` was verified and is in its device page
  now, else why it was not (the mover dropped that copy already; the caller recomputes
  that request from its first failed block on). ``blocks`` and ``bytes``
  count the verified blocks, ``seconds`` runs from issuing the reads to the last block's
  bytes arriving on the device, or, where every tier read says when its bytes arrived
  (``FetchOutcome.arrived``: a read done while the step computed), to then (0: not
  timed, a copy across shards only), and ``tiers``
  lists the tiers fetched from (sorted ``int(Tier)`` values): what the planner learns a
  link's speed from.
  """

  fetches: tuple[Fetch, ...]
  failures: tuple[Failure | None, ...]
  blocks: int
  bytes: int
  seconds: float
  tiers: tuple[int, ...]
  # A round trip of the link the blocks came over, as its tier measured it (a remote
  # peer's lookups), or 0 (not measured): the planner prices a transfer's start with it.
  latency_s: float = 0.0

  def __post_init__(self):
    if len(self.failures) != len(self.fetches):
      raise ValueError(f"FetchReport has {len(self.fetches)} fetches but "
                       f"{len(self.failures)} failures; give one (None: verified) per fetch.")


@dataclasses.dataclass(frozen=True)
class Copy:
  """One block copied down to a slot the manager chose: ``key`` from ``src`` (a device page
  or a host slot of data shard ``shard``) to ``dst`` (a host slot of the same shard, or a
  disk slot of the shared store)."""

  shard: int
  src: int
  key: bytes
  dst: int


@dataclasses.dataclass(frozen=True)
class TierOrders:
  """The tier work of one step, carried out by the cache worker before the step's compute.

  Two halves. What was decided (``drop``, ``write_through``, ``demote``, ``pump``), and where
  every copy goes, which only the manager decides (``CacheManager.resolve``; ``resolved``):
  device blocks into host slots (``to_host``); the host blocks those slots held, read out
  before they are overwritten (``host_out``), and device blocks that go below the host
  directly (``device_out``, where there is no host tier or it is full), each written to the
  disk slot ``to_disk`` names and put in the pool when ``to_pool`` names it. The disk
  records of blocks evicted from the slots ``to_disk`` took are in ``drop``. The worker
  copies and reports; it chooses nothing.
  """

  drop: tuple = ()  # bytes, ...: disk records of blocks the manager forgot or evicted
  write_through: tuple = ()  # Block, ...: published device blocks copied to every lower tier
  demote: tuple = ()  # Block, ...: evicted device blocks copied to the first lower tier
  pump: bool = False  # publish the disk writes that committed (a request completed)
  resolved: bool = False  # the copies below are chosen (the worker carries out only these)
  to_host: tuple = ()  # Copy, ...: device page -> host slot
  host_out: tuple = ()  # Block, ...: (shard, host slot, key) read before the slot is reused
  device_out: tuple = ()  # Block, ...: (shard, device page, key) to the disk and the pool
  to_disk: tuple = ()  # (key, disk slot), ...: which of host_out/device_out go to disk
  to_pool: tuple = ()  # bytes, ...: which of host_out/device_out go to the pool

  @property
  def empty(self) -> bool:
    return not (self.drop or self.write_through or self.demote or self.pump or self.to_host
                or self.host_out or self.device_out)

  def __add__(self, other: "TierOrders") -> "TierOrders":
    if self.resolved or other.resolved:
      raise ValueError("resolved TierOrders are carried out as they are, not added to.")
    return TierOrders(drop=self.drop + other.drop,
                      write_through=self.write_through + other.write_through,
                      demote=self.demote + other.demote, pump=self.pump or other.pump)


@dataclasses.dataclass(frozen=True)
class SplitChoice:
  """The planner's answer for one request: its split point ``split`` (blocks ``[hot,
  split)`` recomputed, the rest of its cached chain fetched) and, under the ``cost``
  decision, the seconds the plan predicted for its parts: the recompute (with the other
  requests' recompute on its shard), the fetch, and the prefill of the prompt after the
  cached chain (all 0 under a fixed rule). The scheduler times the split against them."""

  split: int
  recompute_s: float = 0.0
  fetch_s: float = 0.0
  tail_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class SeqRows:
  """What the runner needs of a running request to give it a batch row."""

  request: int  # request id
  shard: int
  pages: tuple  # device pages, block order
  num_pages: int  # pages the request can ever need (the page table's width bucket)
  sampling: SamplingParams
  # The window group's page of each block (``jaxkv.manager.windows.table_row``); () without
  # a window group.
  window_pages: tuple = ()


@dataclasses.dataclass(frozen=True)
class PrefillChunk:
  seq: SeqRows
  tokens: np.ndarray  # [n] int32, read-only: the chunk's tokens
  start: int  # position of its first token
  last: bool  # it reaches the prompt's end: its last logits give the first token
  recompute: bool  # part of the plan's recompute [hot, s) (else the rest of the prompt)
  # Prompt log-probabilities: the token after each of the chunk's positions (one fewer at
  # the prompt's end, whose next token is generated), scored against that position's logits.
  targets: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class DecodeRow:
  seq: SeqRows
  token: int  # the token fed in (the request's last)
  pos: int  # its position


@dataclasses.dataclass(frozen=True)
class FetchGroup:
  """The fetches of one step's admissions, issued together and verified together."""

  group: int
  fetches: tuple  # Fetch, ...


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """Everything one step does, decided before it runs (printable: ``summary``)."""

  step: int
  aborted: tuple = ()  # request ids that ended this step by ``Scheduler.abort``
  admitted: tuple = ()  # request ids placed this step
  orders: TierOrders = TierOrders()  # carried out first
  fetch: FetchGroup | None = None  # issued at the start of the step
  decode: tuple = ()  # DecodeRow, ...
  prefill: tuple = ()  # PrefillChunk, ...
  decode_again: bool = False  # every decoding row decodes next step too (dispatch it ahead)
  settle: tuple = ()  # fetch groups to wait for and verify after the step's dispatch
  finishing: tuple = ()  # request ids that reach max_new_tokens with this step's token
  streamed: object | None = None  # a long sequence (a Request) that is this whole step
  want_logits: bool = False
  want_logprobs: bool = False  # a row's tokens come with their log-probabilities
  block_bytes: int = 0  # bytes of one block (every layer's K and V), for ``summary``
  # (shard, ring page, kept page), ...: window-group blocks kept, copied before the step
  window_copies: tuple = ()
  # Window-group blocks to and from host memory (``jaxkv.manager.windows``): (shard, device
  # page, host slot), ... copied out before ``window_copies``; (shard, host slot, device
  # page, key), ... loaded and checked after them.
  window_demotes: tuple = ()
  window_loads: tuple = ()
  # ... and to and from the pool: (shard, device page, key), ... put before
  # ``window_copies`` (a finished sequence's last window); loaded and checked after them.
  window_puts: tuple = ()
  window_pool_loads: tuple = ()
  # ... and to and from the disk store's window records: (shard, device page, key), ...
  # written from what the pages held before ``window_copies``; keys whose records are
  # deleted (before any write); (shard, device page, key), ... loaded and checked after.
  window_disk_puts: tuple = ()
  window_disk_deletes: tuple = ()
  window_disk_loads: tuple = ()
  # ... and from a remote peer: (shard, device page, key, peer), ... loaded after them.
  window_remote_loads: tuple = ()

  @property
  def empty(self) -> bool:
    return not (self.decode or self.prefill or self.fetch or self.settle or self.streamed
                or self.window_copies or self.window_demotes or self.window_loads
                or self.window_puts or self.window_pool_loads or self.window_disk_puts
                or self.window_disk_deletes or self.window_disk_loads
                or self.window_remote_loads
                or not self.orders.empty)

  def moves(self) -> dict[str, int]:
    """Blocks this step moves between tiers, by route: what was decided (``write_through``,
    ``demote``), where the copies go (``to_host``, ``host_out``, ``device_out``, ``to_disk``,
    ``to_pool``) and ``fetch_<tier>`` (the tier a fetch reads)."""
    out = collections.Counter()
    orders = self.orders
    for route, n in (("write_through", len(orders.write_through)),
                     ("demote", len(orders.demote)), ("to_host", len(orders.to_host)),
                     ("host_out", len(orders.host_out)), ("device_out", len(orders.device_out)),
                     ("to_disk", len(orders.to_disk)), ("to_pool", len(orders.to_pool))):
      if n:
        out[route] = n
    for f in (self.fetch.fetches if self.fetch else ()):
      out["fetch_" + TIER_NAMES[f.tier]] += 1
    return dict(out)

  def summary(self) -> str:
    """One line: what ran (the log line of ``--verbosity=1``), with the blocks and bytes
    each tier route moves."""
    if self.streamed is not None:
      return (f"step {self.step}: streamed request {self.streamed.id} "
              f"({len(self.streamed.tokens)} prompt tokens)")
    recompute = sum(len(c.tokens) for c in self.prefill if c.recompute)
    prefill = sum(len(c.tokens) for c in self.prefill)
    moves = self.moves()
    moved = ", ".join(f"{route} {n} ({n * self.block_bytes / 2**20:.2f} MiB)"
                      for route, n in sorted(moves.items())) or "none"
    return (f"step {self.step}: rows decode {len(self.decode)} prefill {len(self.prefill)}; "
            f"tokens {len(self.decode) + prefill} (prefill {prefill}, recompute {recompute}); "
            f"admitted {list(self.admitted)}; moves {moved}"
            f"{f' (fetch group {self.fetch.group})' if self.fetch else ''}; settle "
            f"{list(self.settle)}; first tokens {[c.seq.request for c in self.prefill if c.last]}; "
            f"finishing {list(self.finishing)}"
            + ("; pump" if self.orders.pump else "")
            + (f"; drop {len(self.orders.drop)} disk records" if self.orders.drop else "")
            + (f"; aborted {list(self.aborted)}" if self.aborted else ""))


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What the runner reports for a ``StepPlan``."""

  tokens: Mapping  # request id -> the token it produced this step
  logits: Mapping | None  # request id -> [vocab] float32 logits (when the plan wants them)
  t_tokens: float  # perf_counter when the tokens were on the host
  fetched: tuple = ()  # (group, FetchReport), one per settled group (the scheduler settles it)
  streamed: tuple | None = None  # (tokens, logits or None, t_first_token)
  # Request id -> (logprob, top ids [K], top logprobs [K]) of the token it produced (when
  # the plan wants log-probabilities).
  logprobs: Mapping | None = None
  # Request id -> (logprobs [n], top ids [n, K], top logprobs [n, K]) of its prompt chunk's
  # targets (``PrefillChunk.targets``).
  prompt_logprobs: Mapping | None = None
  # (shard, key, tier), ...: window-group blocks the plan loaded from host memory, the
  # disk or the pool whose bytes failed their check or did not come
  # (``StepPlan.window_loads``, ``window_disk_loads``, ``window_pool_loads``).
  window_failures: tuple = ()
  # The plan's window loads from the disk and from the pool, each as one timed fetch
  # (``StepPlan.window_disk_loads``, ``window_pool_loads``): the planner learns their
  # links from them, as from a promotion's report.
  window_fetched: tuple[FetchReport, ...] = ()
