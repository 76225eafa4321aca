"""PrefixIndex: which blocks of which token prefixes are cached, and where.

Concepts
- A *block key* names the KV of one full page of tokens *in its context*: it is a SHA-256
  chained over every token before it, ``k_i = sha256(k_{i-1} || tokens_i)``, and the
  chain starts from ``k_0 = sha256(fingerprint || tenant salt)``. Two requests share a
  block only if their whole prefix up to and including that block is identical, for the
  same model/layout and the same tenant. Partial blocks are never shared.
- Every data shard owns a pool of ``pages_per_shard`` device pages with shard-local ids.
  A page is either *free* (no content), *cached* (holds a published block, refcount 0,
  evictable), or *referenced* (refcount > 0: some running request reads or writes it).
- Free and cached-unreferenced pages sit in one queue per shard in eviction order: never
  used pages first, then cached pages least recently released first. Allocation pops
  from the front; popping a cached page evicts its block. All operations are O(1) per
  page (``OrderedDict`` gives O(1) push, pop and removal).

Invariants (checked by ``check_invariants``, exercised by property tests)
- A referenced page is never in the free queue and is never evicted.
- Refcounts never go negative; releasing an unreferenced page raises.
- ``page_of_key`` and ``key_of_page`` are inverse maps.

Everything here is host-side Python and deterministic: hashlib only, insertion-ordered
dicts, no ``hash()`` and no set iteration order, so every process of a multi-host job
that applies the same operations holds the same index (``digest`` compares them).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from collections.abc import Sequence

import numpy as np

Key = bytes  # a 32-byte SHA-256 digest


def tenant_root_key(fingerprint: bytes, tenant: str) -> Key:
  """The chain's starting key: model/layout fingerprint mixed with the tenant salt."""
  if not isinstance(tenant, str) or not tenant:
    raise ValueError(f"tenant={tenant!r} must be a non-empty string, e.g. 'default'.")
  salt = hashlib.sha256(b"jaxkv-tenant\x00" + tenant.encode("utf-8")).digest()
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


class _ShardPool:
  """Bookkeeping of one data shard's device pages."""

  def __init__(self, num_pages: int):
    self.num_pages = num_pages
    self.refcount = np.zeros(num_pages, dtype=np.int64)
    self.key_of_page: list[Key | None] = [None] * num_pages
    self.page_of_key: dict[Key, int] = {}
    # Eviction order: front is evicted first. Values unused (OrderedDict as O(1) queue).
    self.free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
        (p, None) for p in range(num_pages))


@dataclasses.dataclass
class IndexCounters:
  evictions: int = 0
  published: int = 0
  duplicate_publishes: int = 0


class PrefixIndex:
  """Host-side index of cached blocks over ``num_shards`` independent page pools."""

  def __init__(self, *, num_shards: int, pages_per_shard: int, page_size: int,
               fingerprint: bytes):
    for name, v in (("num_shards", num_shards), ("pages_per_shard", pages_per_shard),
                    ("page_size", page_size)):
      if not isinstance(v, int) or v <= 0:
        raise ValueError(f"PrefixIndex {name}={v!r} must be a positive integer.")
    self.num_shards = num_shards
    self.pages_per_shard = pages_per_shard
    self.page_size = page_size
    self.fingerprint = fingerprint
    self._shards = [_ShardPool(pages_per_shard) for _ in range(num_shards)]
    self.counters = IndexCounters()

  # ---- keys ------------------------------------------------------------------------------
  def block_keys(self, tokens: Sequence[int], tenant: str) -> list[Key]:
    """Keys of every full block of ``tokens`` for ``tenant``."""
    return chain_keys(tenant_root_key(self.fingerprint, tenant), tokens, self.page_size)

  # ---- queries ---------------------------------------------------------------------------
  def match(self, shard: int, keys: Sequence[Key]) -> list[int]:
    """Pages holding the longest cached prefix of ``keys`` on ``shard`` (may be empty)."""
    pool = self._pool(shard)
    pages = []
    for key in keys:
      page = pool.page_of_key.get(key)
      if page is None:
        break
      pages.append(page)
    return pages

  def num_available(self, shard: int) -> int:
    """Pages that ``allocate`` could hand out now (free or evictable)."""
    return len(self._pool(shard).free_queue)

  def refcount(self, shard: int, page: int) -> int:
    return int(self._pool(shard).refcount[page])

  def key_of(self, shard: int, page: int) -> Key | None:
    return self._pool(shard).key_of_page[page]

  def num_cached(self, shard: int) -> int:
    return len(self._pool(shard).page_of_key)

  # ---- mutations -------------------------------------------------------------------------
  def acquire(self, shard: int, pages: Sequence[int]) -> None:
    """Take a reference on pages that hold cached blocks (after ``match``)."""
    pool = self._pool(shard)
    for p in pages:
      self._check_page(pool, p)
      if pool.refcount[p] == 0:
        pool.free_queue.pop(p, None)
      pool.refcount[p] += 1

  def allocate(self, shard: int, n: int) -> list[int] | None:
    """``n`` fresh pages with refcount 1, evicting least valuable cached blocks first.

    Returns ``None`` (and changes nothing) when fewer than ``n`` pages are free or
    evictable: running out of pages is an expected outcome, not an error.
    """
    pool = self._pool(shard)
    if n < 0:
      raise ValueError(f"allocate n={n} must be >= 0.")
    if n > len(pool.free_queue):
      return None
    pages = []
    for _ in range(n):
      p, _ = pool.free_queue.popitem(last=False)
      key = pool.key_of_page[p]
      if key is not None:  # evict the cached block this page held
        del pool.page_of_key[key]
        pool.key_of_page[p] = None
        self.counters.evictions += 1
      pool.refcount[p] = 1
      pages.append(p)
    return pages

  def publish(self, shard: int, page: int, key: Key) -> bool:
    """Record that referenced ``page`` now holds the block ``key`` (its write completed).

    Returns False when another page already holds ``key`` (two requests computed the
    same block): the existing entry stays and this page remains private.
    """
    pool = self._pool(shard)
    self._check_page(pool, page)
    if pool.refcount[page] <= 0:
      raise ValueError(f"publish of page {page} on shard {shard} that no request references.")
    existing = pool.page_of_key.get(key)
    if existing is not None:
      if existing != page:
        self.counters.duplicate_publishes += 1
      return existing == page
    if pool.key_of_page[page] is not None:
      raise ValueError(f"page {page} on shard {shard} already holds another block.")
    pool.page_of_key[key] = page
    pool.key_of_page[page] = key
    self.counters.published += 1
    return True

  def release(self, shard: int, pages: Sequence[int]) -> None:
    """Drop one reference from each page; pages reaching zero become evictable.

    Release a sequence's pages in order: its later blocks are queued for eviction
    before its earlier ones (a prefix's head is shared more often than its tail).
    Pages without a published block go to the front of the queue (nothing to keep).
    """
    pool = self._pool(shard)
    for p in reversed(list(pages)):
      self._check_page(pool, p)
      if pool.refcount[p] <= 0:
        raise ValueError(
            f"release of page {p} on shard {shard} whose refcount is {pool.refcount[p]}: "
            "each acquire/allocate must be released exactly once.")
      pool.refcount[p] -= 1
      if pool.refcount[p] == 0:
        pool.free_queue[p] = None
        if pool.key_of_page[p] is None:
          pool.free_queue.move_to_end(p, last=False)

  def evict_all_unreferenced(self, shard: int) -> int:
    """Forget every cached block nobody references (their pages become free)."""
    pool = self._pool(shard)
    n = 0
    for p in list(pool.free_queue):
      key = pool.key_of_page[p]
      if key is not None:
        del pool.page_of_key[key]
        pool.key_of_page[p] = None
        n += 1
    self.counters.evictions += n
    return n

  # ---- checks ----------------------------------------------------------------------------
  def check_invariants(self) -> None:
    for s, pool in enumerate(self._shards):
      assert (pool.refcount >= 0).all(), f"negative refcount on shard {s}"
      for p in pool.free_queue:
        assert pool.refcount[p] == 0, f"referenced page {p} is on shard {s}'s free queue"
      for p in range(pool.num_pages):
        if pool.refcount[p] == 0:
          assert p in pool.free_queue, f"unreferenced page {p} on shard {s} is lost"
      for key, p in pool.page_of_key.items():
        assert pool.key_of_page[p] == key, f"maps disagree for page {p} on shard {s}"
      assert sum(k is not None for k in pool.key_of_page) == len(pool.page_of_key)

  def digest(self) -> str:
    """SHA-256 over the full index state; equal on processes that did the same work."""
    h = hashlib.sha256(self.fingerprint)
    for pool in self._shards:
      h.update(pool.refcount.astype("<i8").tobytes())
      for p in range(pool.num_pages):
        h.update(pool.key_of_page[p] or b"\x00")
      h.update(np.asarray(list(pool.free_queue), dtype="<i8").tobytes())
    return h.hexdigest()

  def _pool(self, shard: int) -> _ShardPool:
    if not 0 <= shard < self.num_shards:
      raise ValueError(f"shard={shard} is out of range [0, {self.num_shards}).")
    return self._shards[shard]

  @staticmethod
  def _check_page(pool: _ShardPool, page: int) -> None:
    if not 0 <= page < pool.num_pages:
      raise ValueError(f"page={page} is out of range [0, {pool.num_pages}).")
