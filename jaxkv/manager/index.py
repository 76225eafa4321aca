"""PrefixIndex: which blocks of which token prefixes are cached, and in which tier.

Concepts
- A *block key* names the KV of one full page of tokens *in its context*: it is a SHA-256
  chained over every token before it, ``k_i = sha256(k_{i-1} || tokens_i)``, and the
  chain starts from ``k_0 = sha256(fingerprint || tenant salt)``, the salt keyed with the
  deployment key when there is one (``jaxkv.security``). Two requests share a
  block only if their whole prefix up to and including that block is identical, for the
  same model/layout and the same tenant. Partial blocks are never shared.
- Tiers: every data shard owns a DEVICE pool and a HOST pool of pages with shard-local
  ids; the DISK pool (slots of a TensorStore array) is shared by all shards of a process.
  A block may have copies in several tiers; its *best* tier is the fastest holding one.
- In every pool a slot is *free* (no content), *cached* (holds a published block,
  refcount 0, evictable) or *referenced* (refcount > 0: a running request, an in-flight
  transfer or a user pin holds it). Free and cached slots sit in one queue per pool in
  eviction order: never-used slots first, then cached ones least recently released
  first. Allocation takes from the front; a cached slot in a small window at the front
  whose block was reused more often is passed over for a colder one, its reuse count
  halved each time (shared hot prefixes stay while they are reused, then age out; LRU
  breaks ties). Every operation is O(1) per slot.

Invariants (``check_invariants``; property tests drive random operation sequences)
- A referenced slot is never in a free queue and is never evicted or reallocated.
- Refcounts never go negative; releasing an unreferenced slot raises.
- Per pool, ``slot_of_key`` and ``key_of_slot`` are inverse maps.

Errors by kind (``jaxkv.errors``): a bad value from a user (a tenant, a pool size from a
config) raises ``InputError``; a broken rule of the bookkeeping above (a release below
zero, a publish into a slot nobody holds, a shard or slot id no pool has) raises
``InvariantError``: the caller (jaxkv's own cache and scheduler) has a bug.

Everything is host-side Python and deterministic (hashlib, insertion-ordered dicts, no
``hash()``, no set iteration), so processes that apply the same operations hold the
same index; ``digest`` compares them.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

from jaxkv import security
from jaxkv.errors import InputError, InvariantError, check_text
# The tier numbering is a value every side shares: it lives in the step module.
from jaxkv.scheduling.step import LOCAL_TIERS, TIER_NAMES, Tier  # noqa: F401

Key = bytes  # a 32-byte SHA-256 digest


def tenant_root_key(fingerprint: bytes, tenant: str, secret: bytes | None = None) -> Key:
  """The chain's starting key: model/layout fingerprint mixed with the tenant's salt
  (keyed by the deployment key ``secret`` when given)."""
  check_text(tenant, "tenant")
  salt = security.tenant_salt(tenant, secret)
  return hashlib.sha256(b"jaxkv-root\x00" + fingerprint + salt).digest()


def chain_keys(root: Key, tokens: Sequence[int], page_size: int, *, parent: Key | None = None,
               start_block: int = 0) -> list[Key]:
  """Keys of the full blocks of ``tokens``, from block ``start_block`` on.

  ``parent`` is the key of block ``start_block - 1`` (``root`` when starting at 0), so a
  caller can extend a chain without rehashing its front.
  """
  toks = np.asarray(tokens, dtype=np.int32)
  key = root if parent is None else parent
  keys = []
  for b in range(start_block, len(toks) // page_size):
    block = toks[b * page_size:(b + 1) * page_size].astype("<i4").tobytes()
    key = hashlib.sha256(key + block).digest()
    keys.append(key)
  return keys


def _expect(holds, message: str) -> None:
  if not holds:
    raise InvariantError(f"PrefixIndex invariant broken: {message}.")


class _Pool:
  """Bookkeeping of one pool of slots (a shard's device or host pages, the disk slots)."""

  def __init__(self, num_slots: int, tier: Tier):
    self.num_slots, self.tier = num_slots, tier
    self.refcount = np.zeros(num_slots, dtype=np.int64)
    self.key_of_slot: list[Key | None] = [None] * num_slots
    self.slot_of_key: dict[Key, int] = {}
    # Eviction order: the front goes first. Values unused (OrderedDict as an O(1) queue).
    self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
        (p, None) for p in range(num_slots))


@dataclasses.dataclass
class IndexCounters:
  evictions: int = 0
  published: int = 0
  duplicate_publishes: int = 0
  dropped: int = 0  # copies removed as unverifiable (and their descendants)


# How many cached slots at the front of a queue are compared when choosing a victim.
_EVICTION_WINDOW = 4


class PrefixIndex:
  """Host-side index of cached blocks over per-shard device/host pools and a disk pool."""

  def __init__(self, *, num_shards: int, pages_per_shard: int, page_size: int,
               fingerprint: bytes, host_pages_per_shard: int = 0, disk_slots: int = 0,
               secret: bytes | None = None):
    for name, v, low in (("num_shards", num_shards, 1), ("pages_per_shard", pages_per_shard, 1),
                         ("page_size", page_size, 1),
                         ("host_pages_per_shard", host_pages_per_shard, 0),
                         ("disk_slots", disk_slots, 0)):
      if not isinstance(v, int) or v < low:
        raise InputError(f"PrefixIndex {name}={v!r} must be an integer >= {low}.")
    self.num_shards = num_shards
    self.pages_per_shard = pages_per_shard
    self.host_pages_per_shard = host_pages_per_shard
    self.page_size = page_size
    self.fingerprint = fingerprint
    self._secret = security.check_key(secret)  # the deployment key (never shown)
    self._slots = {tier: [_Pool(n, tier) for _ in range(num_shards)] for tier, n in (
        (Tier.DEVICE, pages_per_shard), (Tier.HOST, host_pages_per_shard))}
    self._slots[Tier.DISK] = [_Pool(disk_slots, Tier.DISK)]
    self._hits: collections.Counter = collections.Counter()  # key -> reuses, aged
    self._parent: dict[Key, Key | None] = {}
    self._children: dict[Key, dict[Key, None]] = {}
    self._copies: collections.Counter = collections.Counter()  # key -> copies in any pool
    self.counters = IndexCounters()
    # Told of every copy that enters or leaves a pool (``stored(key, tier)`` once its chain
    # link is known, ``forgotten(key, tier)``): the KV events (``jaxkv.manager.events``).
    self.observer = None

  # ---- keys ------------------------------------------------------------------------------
  def bind_fingerprint(self, fingerprint: bytes) -> None:
    """The fingerprint block keys are chained from, once the model's weights are known
    (``KVCache.attach``), before any block is keyed under it."""
    if any(self.num_cached(s, t) for s in range(self.num_shards) for t in LOCAL_TIERS
           if self.has_tier(t)):
      raise InvariantError("the index's fingerprint changed while it holds blocks keyed "
                           "under the old one.")
    self.fingerprint = fingerprint

  def block_keys(self, tokens: Sequence[int], tenant: str) -> list[Key]:
    """Keys of every full block of ``tokens`` for ``tenant``."""
    return chain_keys(tenant_root_key(self.fingerprint, tenant, self._secret), tokens,
                      self.page_size)

  def tenant_salt(self, tenant: str) -> bytes:
    """The salt ``tenant``'s key chains start from (keyed by the deployment key, if any):
    what the KV events key a tenant's token ids with (``security.routing_tokens``)."""
    return security.tenant_salt(tenant, self._secret)

  # ---- queries ---------------------------------------------------------------------------
  def has_tier(self, tier: Tier) -> bool:
    return self._slots[tier][0].num_slots > 0

  def match(self, shard: int, keys: Sequence[Key], tier: Tier = Tier.DEVICE) -> list[int]:
    """Slots holding the longest prefix of ``keys`` in one pool (may be empty)."""
    pool = self._pool(tier, shard)
    slots = []
    for key in keys:
      slot = pool.slot_of_key.get(key)
      if slot is None:
        break
      slots.append(slot)
    return slots

  def locate(self, shard: int, keys: Sequence[Key], tiers: Sequence[Tier] = LOCAL_TIERS
             ) -> list[tuple[Tier, int]]:
    """The longest prefix of ``keys`` present in any of ``tiers`` of ``shard``, with the
    best (fastest) tier and slot of each block."""
    out = []
    for key in keys:
      for tier in tiers:
        slot = self._pool(tier, shard).slot_of_key.get(key)
        if slot is not None:
          out.append((tier, slot))
          break
      else:
        break
    return out

  def parent_of(self, key: Key) -> Key | None:
    """The key of the block before ``key`` in its chain (None for a first block)."""
    return self._parent.get(key)

  def slot_of(self, shard: int, key: Key, tier: Tier) -> int | None:
    return self._pool(tier, shard).slot_of_key.get(key)

  def num_available(self, shard: int, tier: Tier = Tier.DEVICE) -> int:
    """Slots that ``allocate`` could hand out now (free or evictable)."""
    return len(self._pool(tier, shard).free_queue)

  def refcount(self, shard: int, slot: int, tier: Tier = Tier.DEVICE) -> int:
    pool = self._pool(tier, shard)
    self._check_slot(pool, slot)
    return int(pool.refcount[slot])

  def held_slots(self, shard: int, tier: Tier = Tier.DEVICE) -> dict[int, int]:
    """The referenced slots of one pool (a running request, an in-flight transfer or a
    pin holds them), in slot order, each with its refcount; empty when nothing is held.

    ``not index.held_slots(shard, tier)`` says that no reference leaked; the dict names
    the slots that did. ``sum(...values())`` is the pool's total reference count.
    """
    refcount = self._pool(tier, shard).refcount
    return {int(p): int(refcount[p]) for p in np.flatnonzero(refcount)}

  def key_of(self, shard: int, slot: int, tier: Tier = Tier.DEVICE) -> Key | None:
    pool = self._pool(tier, shard)
    self._check_slot(pool, slot)
    return pool.key_of_slot[slot]

  def num_cached(self, shard: int, tier: Tier = Tier.DEVICE) -> int:
    return len(self._pool(tier, shard).slot_of_key)

  def cached_keys(self, shard: int, tier: Tier) -> list[Key]:
    return list(self._pool(tier, shard).slot_of_key)

  # ---- mutations -------------------------------------------------------------------------
  def acquire(self, shard: int, slots: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
    """Take a reference on slots (cached blocks after ``match``, or slots in flight)."""
    pool = self._pool(tier, shard)
    for p in slots:
      self._check_slot(pool, p)
      if pool.refcount[p] == 0:
        pool.free_queue.pop(p, None)
      pool.refcount[p] += 1

  def reuses(self, key: Key) -> float:
    """How often the block was reused (aged as eviction passes it over)."""
    return self._hits.get(key, 0)

  def record_hits(self, keys: Sequence[Key]) -> None:
    """Counts a reuse of each block: reused blocks are evicted later than cold ones."""
    for key in keys:
      self._hits[key] += 1

  def allocate(self, shard: int, n: int, tier: Tier = Tier.DEVICE) -> list[int] | None:
    """``n`` fresh slots with refcount 1, evicting the least valuable cached blocks; None
    (and nothing changed) when fewer than ``n`` are free or evictable. For a caller whose
    evicted blocks need nothing more (``allocate_evicting`` says which they were)."""
    return self.allocate_evicting(shard, n, tier)[0]

  def allocate_empty(self, shard: int, n: int, tier: Tier = Tier.DEVICE) -> list[int] | None:
    """``n`` slots that hold no block, with refcount 1, evicting nothing; None (and nothing
    changed) when fewer than ``n`` are empty. Scratch for work that must not cost a cached
    block (calibration's steps). A scan of the free queue: not for the serving path."""
    pool = self._pool(tier, shard)
    empty = [p for p in pool.free_queue if pool.key_of_slot[p] is None][:n]
    if len(empty) < n:
      return None
    for p in empty:
      pool.free_queue.pop(p)
      pool.refcount[p] = 1
    return empty

  def allocate_evicting(self, shard: int, n: int, tier: Tier = Tier.DEVICE
                        ) -> tuple[list[int] | None, tuple[tuple[Key, int], ...]]:
    """``(slots, evicted)``: ``n`` fresh slots with refcount 1 and the cached blocks
    evicted to make room, as ``(key, slot)`` (their bytes are still in the slots until
    the caller overwrites them, so a write-back copy can be issued first).

    ``slots`` is None (and nothing changed) when fewer than ``n`` slots are free or
    evictable: running out is an expected outcome, not an error.
    """
    pool = self._pool(tier, shard)
    if n < 0:
      raise InvariantError(f"allocate n={n} on shard {shard}: a slot count must be >= 0; "
                           "the caller computed it wrong.")
    if n > len(pool.free_queue):
      return None, ()
    out, evicted = [], []
    for _ in range(n):
      p = self._pick_victim(pool)
      key = pool.key_of_slot[p]
      if key is not None:
        self._forget(pool, p, key)
        self.counters.evictions += 1
        evicted.append((key, p))
      pool.refcount[p] = 1
      out.append(p)
    return out, tuple(evicted)

  def publish(self, shard: int, slot: int, key: Key, tier: Tier = Tier.DEVICE,
              parent: Key | None = None) -> bool:
    """Record that referenced ``slot`` now holds block ``key`` (its write completed).

    ``parent`` is the key of the block before it (None for a first block): the index
    keeps the chain so that dropping a bad block also drops what was chained after it.
    Returns False when the pool already holds ``key`` in another slot; that slot stays
    and this one remains private.
    """
    pool = self._pool(tier, shard)
    self._check_slot(pool, slot)
    if pool.refcount[slot] <= 0:
      raise InvariantError(f"publish of {TIER_NAMES[tier]} slot {slot} on shard {shard} that no "
                           "request references: only a slot taken by allocate/acquire (and not "
                           "yet released) may be published.")
    existing = pool.slot_of_key.get(key)
    if existing is not None:
      if existing != slot:
        self.counters.duplicate_publishes += 1
      return existing == slot
    if pool.key_of_slot[slot] is not None:
      raise InvariantError(f"{TIER_NAMES[tier]} slot {slot} on shard {shard} already holds "
                           "another block: publish only into a freshly allocated slot.")
    pool.slot_of_key[key] = slot
    pool.key_of_slot[slot] = key
    if self._copies[key] == 0:
      self._parent[key] = parent
      if parent is not None:
        self._children.setdefault(parent, {})[key] = None
    self._copies[key] += 1
    self.counters.published += 1
    if self.observer is not None:
      self.observer.stored(key, tier)
    return True

  def release(self, shard: int, slots: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
    """Drop one reference from each slot; slots reaching zero become evictable.

    Release a sequence's pages in order: its later blocks are queued for eviction
    before its earlier ones (a prefix's head is shared more often than its tail).
    Slots without a published block go to the front of the queue (nothing to keep).
    """
    pool = self._pool(tier, shard)
    for p in reversed(list(slots)):
      self._check_slot(pool, p)
      if pool.refcount[p] <= 0:
        raise InvariantError(
            f"release of {TIER_NAMES[tier]} slot {p} on shard {shard} whose refcount is "
            f"{pool.refcount[p]}: each acquire/allocate must be released exactly once.")
      pool.refcount[p] -= 1
      if pool.refcount[p] == 0:
        pool.free_queue[p] = None
        if pool.key_of_slot[p] is None:
          pool.free_queue.move_to_end(p, last=False)

  def unpublish(self, shard: int, slot: int, tier: Tier) -> Key | None:
    """Forgets the block a slot holds (its bytes are unusable); the slot stays as is."""
    pool = self._pool(tier, shard)
    key = pool.key_of_slot[slot]
    if key is not None:
      self._forget(pool, slot, key)
      if pool.refcount[slot] == 0:
        pool.free_queue.move_to_end(slot, last=False)
    return key

  def drop_chain(self, shard: int, key: Key, tier: Tier) -> list[Key]:
    """Drops the ``tier`` copy of ``key`` and of every block chained after it.

    Used when a copy failed verification: the bad copy goes, and so do the copies in the
    same tier of the blocks that continue its chain (they were written by the same
    path and cannot be reached without it). Referenced copies (in use) are left alone.
    Returns the keys whose copy was dropped.
    """
    pool = self._pool(tier, shard)
    dropped = []
    todo = [key]
    while todo:
      k = todo.pop()
      slot = pool.slot_of_key.get(k)
      if slot is not None and pool.refcount[slot] == 0:
        self.unpublish(shard, slot, tier)
        dropped.append(k)
      todo.extend(reversed(list(self._children.get(k, {}))))
    self.counters.dropped += len(dropped)
    return dropped

  def evict_all_unreferenced(self, shard: int, tier: Tier = Tier.DEVICE) -> int:
    """Forget every cached block nobody references in one pool (its slots become free)."""
    pool = self._pool(tier, shard)
    n = 0
    for p in list(pool.free_queue):
      key = pool.key_of_slot[p]
      if key is not None:
        self._forget(pool, p, key)
        n += 1
    self.counters.evictions += n
    return n

  # ---- checks ----------------------------------------------------------------------------
  def check_invariants(self) -> None:
    """Raises ``InvariantError`` naming the first rule of the module docstring that the
    index breaks (also under ``python -O``, unlike ``assert``)."""
    copies = collections.Counter()
    for tier, pools in self._slots.items():
      for s, pool in enumerate(pools):
        where = f"{TIER_NAMES[tier]} pool {s}"
        _expect((pool.refcount >= 0).all(), f"negative refcount in {where}")
        for p in pool.free_queue:
          _expect(pool.refcount[p] == 0, f"referenced slot {p} is in {where}'s free queue")
        for p in range(pool.num_slots):
          if pool.refcount[p] == 0:
            _expect(p in pool.free_queue, f"unreferenced slot {p} of {where} is lost")
        for key, p in pool.slot_of_key.items():
          _expect(pool.key_of_slot[p] == key, f"maps disagree for slot {p} of {where}")
          copies[key] += 1
        _expect(sum(k is not None for k in pool.key_of_slot) == len(pool.slot_of_key),
                f"{where} has slots holding keys that slot_of_key does not list")
    _expect(copies == +self._copies, "copy counts disagree with the pools")
    _expect(set(self._parent) == set(copies), "chain links kept for keys with no copy")

  def digest(self) -> str:
    """SHA-256 over the full index state; equal on processes that did the same work."""
    h = hashlib.sha256(self.fingerprint)
    for tier in (Tier.DEVICE, Tier.HOST, Tier.DISK):
      for pool in self._slots[tier]:
        h.update(pool.refcount.astype("<i8").tobytes())
        for p in range(pool.num_slots):
          h.update(pool.key_of_slot[p] or b"\x00")
        h.update(np.asarray(list(pool.free_queue), dtype="<i8").tobytes())
    return h.hexdigest()

  # ---- internals -------------------------------------------------------------------------
  def _pick_victim(self, pool: _Pool) -> int:
    """Front of the queue, unless a more-reused cached block is there and a colder one
    follows within the window: then the coldest of the window (first one on ties). Each
    block passed over has its reuse count halved (zero below one half), so popularity
    ages: a block reused k times is passed over about log2(k) + 2 times, not forever."""
    best, best_hits, seen = None, None, []
    for i, p in enumerate(pool.free_queue):
      if i >= _EVICTION_WINDOW:
        break
      key = pool.key_of_slot[p]
      hits = -1 if key is None else self._hits.get(key, 0)
      seen.append((p, key, hits))
      if best is None or hits < best_hits:
        best, best_hits = p, hits
      if hits <= 0:
        break  # nothing is colder than a free or never-reused slot
    for p, key, hits in seen:
      if p != best and key is not None and hits > best_hits:
        aged = hits / 2  # passed over: it ages, and below half a reuse it counts as cold
        self._hits[key] = aged if aged >= 0.5 else 0
    pool.free_queue.pop(best)
    return best

  def _forget(self, pool: _Pool, slot: int, key: Key) -> None:
    del pool.slot_of_key[key]
    pool.key_of_slot[slot] = None
    if self.observer is not None:
      self.observer.forgotten(key, pool.tier)
    self._copies[key] -= 1
    if self._copies[key] == 0:
      del self._copies[key]
      self._hits.pop(key, None)
      parent = self._parent.pop(key, None)
      if parent is not None and parent in self._children:
        self._children[parent].pop(key, None)
        if not self._children[parent]:
          del self._children[parent]

  def _pool(self, tier: Tier, shard: int) -> _Pool:
    if tier == Tier.DISK:
      return self._slots[Tier.DISK][0]
    if tier not in self._slots:
      raise InvariantError(f"tier={tier!r} has no pools in the index; its pools are "
                           f"{[TIER_NAMES[t] for t in LOCAL_TIERS]}.")
    if not 0 <= shard < self.num_shards:
      raise InvariantError(f"shard={shard} is out of range [0, {self.num_shards}).")
    return self._slots[tier][shard]

  @staticmethod
  def _check_slot(pool: _Pool, slot: int) -> None:
    if not 0 <= slot < pool.num_slots:
      raise InvariantError(f"slot={slot} is out of range [0, {pool.num_slots}).")
