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
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from collections.abc import Mapping

import numpy as np

from jaxkv.manager.index import TIER_NAMES

if typing.TYPE_CHECKING:  # this module imports no JAX: the scheduler's side is host only
  from jaxkv.config import SamplingParams

Block = tuple  # (shard, device page, key)


@dataclasses.dataclass(frozen=True)
class TierOrders:
  """The tier work of one step, carried out by the cache worker before the step's compute."""

  drop: tuple = ()  # bytes, ...: disk records of blocks the manager forgot (failed copies)
  write_through: tuple = ()  # Block, ...: published device blocks copied to every lower tier
  demote: tuple = ()  # Block, ...: evicted device blocks copied to the first lower tier
  pump: bool = False  # publish the disk writes that committed (a request completed)

  @property
  def empty(self) -> bool:
    return not (self.drop or self.write_through or self.demote or self.pump)

  def __add__(self, other: "TierOrders") -> "TierOrders":
    return TierOrders(drop=self.drop + other.drop,
                      write_through=self.write_through + other.write_through,
                      demote=self.demote + other.demote, pump=self.pump or other.pump)


@dataclasses.dataclass(frozen=True)
class SeqRows:
  """What the runner needs of a running request to give it a batch row."""

  request: int  # request id
  shard: int
  pages: tuple  # device pages, block order
  num_pages: int  # pages the request can ever need (the page table's width bucket)
  sampling: SamplingParams


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

  @property
  def empty(self) -> bool:
    return not (self.decode or self.prefill or self.fetch or self.settle or self.streamed
                or not self.orders.empty)

  def moves(self) -> dict[str, int]:
    """Blocks this step moves between tiers, by route: ``write_through``, ``demote`` and
    ``fetch_<tier>`` (the tier a fetch reads)."""
    out = collections.Counter()
    if self.orders.write_through:
      out["write_through"] = len(self.orders.write_through)
    if self.orders.demote:
      out["demote"] = len(self.orders.demote)
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
