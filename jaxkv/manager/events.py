"""KV events: what this cache holds, told to routers in vLLM's event format.

A router that sends each request to the replica holding its prefix needs to know what every
replica holds. ``BlockEvents`` watches the prefix index (``PrefixIndex.observer``: every copy
that enters or leaves a pool passes through it) and turns the changes into events:

- ``BlockStored`` when a block's first copy enters a medium (any data shard of this
  replica), with its chain link and its tokens;
- ``BlockRemoved`` when the last copy in that medium leaves it;
- ``AllBlocksCleared`` when the publisher starts, and before each snapshot it sends.

Media are named as vLLM names them, and as Dynamo's indexer reads them: ``GPU`` for device
memory (on TPU too), ``CPU`` for the host tier, ``DISK`` for the disk tier. The pool, the
remote peers and other data shards are not this replica's own and are not told.

Block hashes are the first 8 bytes of jaxkv's block keys as an unsigned 64-bit integer: the
keys chain over the whole prefix from a tenant-salted root, so two tenants' identical
prompts are different blocks here. ``token_ids`` are the block's tokens *as its tenant's
router asks for them*: each id mapped under the tenant's salt (``security.routing_tokens``),
so a router that scores requests by their tokens (Dynamo's indexer does, and knows no
tenants) matches a request only against its own tenant's blocks
(``jaxkv.entrypoints.openai.router`` maps a request's ids the same way). Each id is keyed
by its position too: the stream hides which tokens a tenant sent and which repeat, though not
which prompts share blocks, so it is still kept where only the router reaches it. ``raw_tokens=True``
sends the tokens as vLLM does (for a router that tokenizes text itself; it then learns every
tenant's prompts and steers tenants by each other's prefixes: one tenant only). With
``tokens=False`` they are left out and the router sees only hashes. A block whose tokens this
process never saw (adopted from disk at start, restored from a checkpoint) is told once a
request's prompt names it (``learn``), so a router never scores tokens it was not given.

Host-side and deterministic, like the index; ``sink`` gets each event (a ``msgspec`` struct)
on the thread that changed the index (``jaxkv.manager.publisher`` sends them).
"""

from __future__ import annotations

import collections
import typing
from collections.abc import Callable, Sequence

import msgspec
import numpy as np

from jaxkv import security
from jaxkv.manager.index import Key, Tier

MEDIA = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.DISK: "DISK"}


# The fields after ``lora_name`` are a hybrid model's (``Group``): left out of the map where
# None, so a model with one group sends exactly what it sent before they existed.
class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
  block_hashes: list[int]
  parent_block_hash: int | None
  token_ids: list[int]
  block_size: int
  lora_id: int | None
  medium: str | None
  lora_name: str | None  # newer vLLM readers require the field; Dynamo ignores it
  group_idx: int | None = None
  kv_cache_spec_kind: str | None = None
  kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
  block_hashes: list[int]
  medium: str | None
  group_idx: int | None = None
  kv_cache_spec_kind: str | None = None
  kv_cache_spec_sliding_window: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
  pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True):
  """One message's payload: ``[ts, events, data_parallel_rank]``."""
  ts: float
  events: list[Event]
  data_parallel_rank: int | None = None


def block_hash(key: Key) -> int:
  """The 64-bit hash a router sees for block ``key``."""
  return int.from_bytes(key[:8], "big")


class Group(typing.NamedTuple):
  """A hybrid model's KV cache group, as its events name it (vLLM's fields): ``index``
  (``group_idx``), ``kind`` (``kv_cache_spec_kind``: ``full_attention`` for the global
  layers' blocks in the prefix index, ``sliding_window`` for the window group's kept
  blocks, ``jaxkv.manager.windows``) and ``sliding_window`` in tokens (the window group's)."""

  index: int
  kind: str
  sliding_window: int | None = None


FULL_ATTENTION = Group(0, "full_attention")


def window_group(sliding_window: int) -> Group:
  """The window group's label: its blocks' events say which blocks' local-layer K/V a
  replica keeps, so that a reader counts a prefix as held only up to the longest cut
  whose window (``sliding_window`` tokens before it) is kept too."""
  return Group(1, "sliding_window", sliding_window)


class BlockEvents:
  """Turns the index's changes into events (``PrefixIndex.observer``).

  A block's tokens and chain link are noted where its key is made (``learn``).
  ``recent``: how many blocks' tokens are kept after their last copy left (a copy down is
  published after its device copy was evicted) or before their first copy came (``learn``
  runs at admission)."""

  def __init__(self, sink: Callable[[Event], None], *, page_size: int, tokens: bool = True,
               raw_tokens: bool = False, recent: int = 1 << 16, group: Group | None = None):
    self.sink, self.page_size = sink, page_size
    # A hybrid model's group, named on every event (None: a model with one group)
    self._group = {} if group is None else {
        "group_idx": group.index, "kv_cache_spec_kind": group.kind,
        "kv_cache_spec_sliding_window": group.sliding_window}
    self.send_tokens, self.raw_tokens, self._recent_cap = tokens, raw_tokens, recent
    self._copies: collections.Counter = collections.Counter()  # (key, tier) -> copies
    self._anywhere: collections.Counter = collections.Counter()  # key -> its copies in every medium
    self._told: dict[tuple[Key, Tier], None] = {}  # (key, tier) whose BlockStored went out
    # (tokens, parent) of the blocks held, and of some recently held or keyed
    self._tokens: dict[Key, tuple[bytes, Key | None]] = {}
    self._recent: collections.OrderedDict[Key, tuple] = collections.OrderedDict()
    self.untold = 0  # (block, medium) copies held whose tokens are unknown: not told yet

  # ---- the index's changes -------------------------------------------------------------------
  def stored(self, key: Key, tier: Tier) -> None:
    if tier not in MEDIA:
      return
    self._copies[key, tier] += 1
    self._anywhere[key] += 1
    if self._copies[key, tier] > 1:
      return
    tokens = self._tokens.get(key)
    if tokens is None:
      tokens = self._recent.pop(key, None)
      if tokens is None:
        self.untold += 1
        return
      self._tokens[key] = tokens
    self._tell(key, tier, tokens)

  def forgotten(self, key: Key, tier: Tier) -> None:
    if tier not in MEDIA:
      return
    self._copies[key, tier] -= 1
    self._anywhere[key] -= 1
    if self._copies[key, tier] == 0:
      del self._copies[key, tier]
      if (key, tier) not in self._told:
        self.untold -= 1
      else:
        del self._told[key, tier]
        self.sink(BlockRemoved(block_hashes=[block_hash(key)], medium=MEDIA[tier],
                               **self._group))
    if self._anywhere[key] == 0:
      del self._anywhere[key]
      tokens = self._tokens.pop(key, None)
      if tokens is not None:
        self._remember(key, tokens)

  # ---- tokens ------------------------------------------------------------------------------------
  def learn(self, keys: Sequence[Key], tokens, *, salt: bytes) -> None:
    """A prompt's (or an answer's) full blocks: ``keys[j]`` holds ``tokens``' block ``j``;
    ``salt``: their tenant's (``PrefixIndex.tenant_salt``), which keys the ids told.
    Blocks held but never told (their tokens were unknown) are told now, front first."""
    if not any(key not in self._tokens for key in keys):
      return
    page = self.page_size
    told = np.asarray(tokens[:len(keys) * page], dtype=np.int64)
    if self.send_tokens and not self.raw_tokens:
      told = np.asarray(security.routing_tokens(salt, told), dtype=np.int64)
    toks = told.astype(np.uint32)
    for j, key in enumerate(keys):
      if key in self._tokens:
        continue
      block = (toks[j * page:(j + 1) * page].tobytes(), keys[j - 1] if j else None)
      if not self._anywhere.get(key):
        self._remember(key, block)
        continue
      self._tokens[key] = block
      for tier in MEDIA:
        if (key, tier) in self._copies and (key, tier) not in self._told:
          self.untold -= 1
          self._tell(key, tier, block)

  def _remember(self, key: Key, tokens: tuple) -> None:
    self._recent[key] = tokens
    self._recent.move_to_end(key)
    while len(self._recent) > self._recent_cap:
      self._recent.popitem(last=False)

  def _tell(self, key: Key, tier: Tier, block: tuple) -> None:
    """``block``: the block's (tokens, parent), as its prompt named them."""
    self._told[key, tier] = None
    tokens, parent = block
    ids = np.frombuffer(tokens, np.uint32).tolist() if self.send_tokens else []
    self.sink(BlockStored(block_hashes=[block_hash(key)],
                          parent_block_hash=None if parent is None else block_hash(parent),
                          token_ids=ids, block_size=self.page_size, lora_id=None,
                          medium=MEDIA[tier], lora_name=None, **self._group))

  def held(self) -> int:
    """How many (block, medium) copies were told and not yet removed."""
    return len(self._told)
