"""PrefixIndex: chained keys, tenant isolation, refcounts, LRU eviction, invariants."""

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxkv.errors import InputError, InvariantError
from jaxkv.manager.index import PrefixIndex, Tier, chain_keys, tenant_root_key

FP = hashlib.sha256(b"test-fingerprint").digest()


def make_index(num_shards=2, pages=8, page_size=4):
  return PrefixIndex(num_shards=num_shards, pages_per_shard=pages, page_size=page_size,
                     fingerprint=FP)


def test_keys_chain_over_whole_prefix_and_skip_partial_blocks():
  idx = make_index()
  a = idx.block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], "t")
  assert len(a) == 2  # the 9th token is a partial block: never keyed
  b = idx.block_keys([1, 2, 3, 4, 5, 6, 7, 8], "t")
  assert a == b
  # Same second block after a different first block: different key (chained).
  c = idx.block_keys([0, 2, 3, 4, 5, 6, 7, 8], "t")
  assert c[0] != a[0] and c[1] != a[1]
  # Explicit chain definition: k_i = sha256(k_{i-1} || int32 LE tokens).
  root = tenant_root_key(FP, "t")
  k0 = hashlib.sha256(root + np.array([1, 2, 3, 4], "<i4").tobytes()).digest()
  assert a[0] == k0
  assert a[1] == hashlib.sha256(k0 + np.array([5, 6, 7, 8], "<i4").tobytes()).digest()
  # Extending a chain from a parent equals hashing from scratch.
  assert chain_keys(b"", [1, 2, 3, 4, 5, 6, 7, 8], 4, parent=a[0], start_block=1) == a[1:]


def test_tenants_and_fingerprints_separate_keys():
  idx = make_index()
  toks = list(range(8))
  assert idx.block_keys(toks, "alice") != idx.block_keys(toks, "bob")
  other = PrefixIndex(num_shards=2, pages_per_shard=8, page_size=4,
                      fingerprint=hashlib.sha256(b"other-model").digest())
  assert other.block_keys(toks, "alice") != idx.block_keys(toks, "alice")
  with pytest.raises(InputError, match="tenant"):
    idx.block_keys(toks, "")


def test_match_acquire_publish_release_cycle():
  idx = make_index()
  keys = idx.block_keys(list(range(12)), "t")
  assert idx.match(0, keys) == []
  pages = idx.allocate(0, 3)
  assert len(set(pages)) == 3 and all(idx.refcount(0, p) == 1 for p in pages)
  for p, k in zip(pages, keys):
    assert idx.publish(0, p, k)
  assert idx.match(0, keys) == pages
  assert idx.match(1, keys) == []  # shards are independent pools
  assert idx.match(0, keys[:1] + [b"x" * 32]) == pages[:1]  # longest prefix only
  idx.release(0, pages)
  assert idx.match(0, keys) == pages  # still cached after release
  idx.acquire(0, pages[:2])
  assert idx.refcount(0, pages[0]) == 1 and idx.num_available(0) == 8 - 2
  idx.release(0, pages[:2])
  idx.check_invariants()


def test_eviction_takes_unreferenced_tail_first_and_never_referenced_pages():
  idx = make_index(num_shards=1, pages=4)
  keys = idx.block_keys(list(range(16)), "t")
  pages = idx.allocate(0, 4)
  for p, k in zip(pages, keys):
    idx.publish(0, p, k)
  idx.release(0, pages)
  idx.acquire(0, pages[:1])  # block 0 is in use by someone
  got = idx.allocate(0, 2)
  # The sequence's tail (blocks 3, 2) goes first; block 0 is referenced and safe.
  assert got == [pages[3], pages[2]]
  assert idx.match(0, keys) == pages[:2]
  assert idx.counters.evictions == 2
  assert idx.allocate(0, 2) is None  # only block 1 is evictable: refuse, change nothing
  assert idx.match(0, keys) == pages[:2]
  idx.check_invariants()


def test_unpublished_pages_are_reused_before_cached_ones():
  idx = make_index(num_shards=1, pages=3)
  keys = idx.block_keys(list(range(4)), "t")
  a = idx.allocate(0, 2)
  idx.publish(0, a[0], keys[0])
  idx.release(0, a)  # a[1] holds nothing worth keeping
  nxt = idx.allocate(0, 1)
  assert nxt == [a[1]]
  assert idx.match(0, keys) == [a[0]]


def test_duplicate_publish_keeps_first_and_errors_are_clear():
  idx = make_index(num_shards=1)
  key = idx.block_keys([1, 2, 3, 4], "t")[0]
  a, b = idx.allocate(0, 2)
  assert idx.publish(0, a, key)
  assert not idx.publish(0, b, key)
  assert idx.counters.duplicate_publishes == 1
  idx.release(0, [a, b])
  # Broken bookkeeping is a bug in the caller, never bad input (tests/test_errors.py).
  with pytest.raises(InvariantError, match="refcount is 0"):
    idx.release(0, [a])
  with pytest.raises(InvariantError, match="no request references"):
    idx.publish(0, b, b"k" * 32)
  with pytest.raises(InvariantError, match="slot=99 is out of range"):
    idx.acquire(0, [99])
  with pytest.raises(InvariantError, match="shard=5 is out of range"):
    idx.match(5, [key])
  with pytest.raises(InvariantError, match="allocate n=-1"):
    idx.allocate(0, -1)
  c, = idx.allocate(0, 1)
  idx.publish(0, c, idx.block_keys([5, 6, 7, 8], "t")[0])
  with pytest.raises(InvariantError, match="already holds another block"):
    idx.publish(0, c, idx.block_keys([9, 9, 9, 9], "t")[0])
  with pytest.raises(InvariantError, match="tier=.*REMOTE.* has no pools"):
    idx.num_cached(0, Tier.REMOTE)
  with pytest.raises(InvariantError, match="slot=-1 is out of range"):
    idx.refcount(0, -1)  # not numpy's last slot
  with pytest.raises(InputError, match="PrefixIndex pages_per_shard=0"):
    make_index(pages=0)  # a size from a config is input


def test_held_slots_names_the_referenced_slots_and_their_counts():
  idx = PrefixIndex(num_shards=2, pages_per_shard=6, page_size=4, fingerprint=FP,
                    host_pages_per_shard=3, disk_slots=2)
  for tier, shard in ((Tier.DEVICE, 0), (Tier.DEVICE, 1), (Tier.HOST, 1), (Tier.DISK, 0)):
    assert idx.held_slots(shard, tier) == {}
  a, b, c = idx.allocate(1, 3)
  idx.acquire(1, [b])
  host, = idx.allocate(1, 1, Tier.HOST)
  assert idx.held_slots(1) == {a: 1, b: 2, c: 1}
  assert list(idx.held_slots(1)) == sorted([a, b, c])  # slot order
  assert idx.held_slots(0) == {} and idx.held_slots(1, Tier.HOST) == {host: 1}
  idx.release(1, [a, b])
  assert idx.held_slots(1) == {b: 1, c: 1}
  idx.release(1, [b, c])
  idx.release(1, [host], Tier.HOST)
  assert idx.held_slots(1) == {} and idx.held_slots(1, Tier.HOST) == {}


def test_digest_is_deterministic_and_sensitive():
  def run(extra):
    idx = make_index()
    keys = idx.block_keys(list(range(8)), "t")
    pages = idx.allocate(1, 2)
    for p, k in zip(pages, keys):
      idx.publish(1, p, k)
    idx.release(1, pages)
    if extra:
      idx.allocate(0, 1)
    return idx.digest()
  assert run(False) == run(False)
  assert run(False) != run(True)


# ---- property test: random operation sequences keep every invariant -----------------------
OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "match_acquire", "publish", "release", "evict"]),
              st.integers(0, 1), st.integers(0, 5), st.integers(0, 3)),
    min_size=1, max_size=60)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_random_operations_keep_invariants(ops):
  idx = make_index(num_shards=2, pages=6, page_size=2)
  held = {0: [], 1: []}  # references we took, in order, per shard
  prompts = [[t, t + 1, t + 2, t + 3, t + 4, t + 5] for t in range(4)]
  for op, shard, n, which in ops:
    keys = idx.block_keys(prompts[which], "t")
    if op == "alloc":
      before = idx.num_available(shard)
      got = idx.allocate(shard, n)
      if got is None:
        assert n > before
      else:
        assert len(got) == n and len(set(got)) == n
        assert not set(got) & set(held[shard]), "a referenced page was handed out again"
        held[shard] += got
    elif op == "match_acquire":
      pages = idx.match(shard, keys)
      idx.acquire(shard, pages)
      held[shard] += pages
    elif op == "publish" and held[shard]:
      page = held[shard][n % len(held[shard])]
      if idx.key_of(shard, page) is None:
        idx.publish(shard, page, keys[n % len(keys)])
    elif op == "release" and held[shard]:
      page = held[shard].pop(n % len(held[shard]))
      idx.release(shard, [page])
    elif op == "evict":
      idx.evict_all_unreferenced(shard)
    idx.check_invariants()
    for s in (0, 1):  # every reference we hold is counted and never evictable
      for p in set(held[s]):
        assert idx.refcount(s, p) == held[s].count(p)
      assert idx.held_slots(s) == {p: held[s].count(p) for p in sorted(set(held[s]))}


# ---- the same across tiers: pins taken for in-flight transfers are never evicted -------------
TIER_OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "pin", "publish", "release", "evict", "drop"]),
              st.sampled_from([Tier.DEVICE, Tier.HOST, Tier.DISK]), st.integers(0, 1),
              st.integers(0, 5), st.integers(0, 3)),
    min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(TIER_OPS)
def test_tiered_pools_never_hand_out_a_pinned_slot(ops):
  idx = PrefixIndex(num_shards=2, pages_per_shard=5, page_size=2, fingerprint=FP,
                    host_pages_per_shard=3, disk_slots=4)
  held = {}  # (tier, pool shard) -> slots we hold (requests, transfers in flight, pins)
  prompts = [[t, t + 1, t + 2, t + 3, t + 4, t + 5] for t in range(4)]
  for op, tier, shard, n, which in ops:
    pool_shard = 0 if tier == Tier.DISK else shard
    mine = held.setdefault((tier, pool_shard), [])
    keys = idx.block_keys(prompts[which], "t")
    if op == "alloc":
      got, evicted = idx.allocate_evicting(shard, n % 3, tier)
      if got is not None:
        assert not set(got) & set(mine), "a held slot was handed out again"
        assert not {p for _, p in evicted} & set(mine), "a held slot was evicted"
        mine += got
    elif op == "pin":
      found = idx.locate(shard, keys)
      for t, slot in found:
        idx.acquire(shard, [slot], t)
        held.setdefault((t, 0 if t == Tier.DISK else shard), []).append(slot)
    elif op == "publish" and mine:
      slot = mine[n % len(mine)]
      j = n % len(keys)
      if idx.key_of(shard, slot, tier) is None:
        idx.publish(shard, slot, keys[j], tier, parent=keys[j - 1] if j else None)
    elif op == "release" and mine:
      idx.release(shard, [mine.pop(n % len(mine))], tier)
    elif op == "evict":
      idx.evict_all_unreferenced(shard, tier)
    elif op == "drop":
      idx.drop_chain(shard, keys[n % len(keys)], tier)
    idx.check_invariants()
    for (t, s), slots in held.items():
      for p in set(slots):
        assert idx.refcount(s, p, t) == slots.count(p)
    for t, s in ((Tier.DEVICE, 0), (Tier.DEVICE, 1), (Tier.HOST, 0), (Tier.HOST, 1),
                 (Tier.DISK, 0)):  # and nothing else is held
      slots = held.get((t, s), [])
      assert idx.held_slots(s, t) == {p: slots.count(p) for p in sorted(set(slots))}


def test_reused_blocks_outlive_cold_ones_and_lru_breaks_ties():
  idx = make_index(num_shards=1, pages=6)
  hot = idx.block_keys(list(range(8)), "t")  # a shared prefix: 2 blocks
  cold = idx.block_keys(list(range(100, 108)), "t")
  pages = idx.allocate(0, 4)
  for p, k in zip(pages, hot + cold):
    idx.publish(0, p, k)
  idx.release(0, pages[:2])  # the hot prefix is released first: it is older
  idx.release(0, pages[2:])
  idx.record_hits(hot)
  idx.allocate(0, 2)  # the two never-used pages
  got = idx.allocate(0, 2)
  assert sorted(got) == sorted(pages[2:])  # the cold blocks go, though the hot ones are older
  assert idx.match(0, hot) == pages[:2]


@pytest.mark.parametrize("reuses", [1, 8])
def test_popularity_ages_a_once_hot_block_leaves_under_a_stream_of_new_ones(reuses):
  """A block reused k times is passed over while colder ones sit in the window, but its
  count halves each time: after log2(k) + 2 passes it goes like any other."""
  idx = make_index(num_shards=1, pages=4)
  hot = idx.block_keys(list(range(4)), "t")
  page, = idx.allocate(0, 1)
  idx.publish(0, page, hot[0])
  idx.release(0, [page])
  for _ in range(reuses):
    idx.record_hits(hot)
  survived = 0
  for i in range(50):  # a stream of new blocks, each cached once and never reused
    (new,), evicted = idx.allocate_evicting(0, 1)
    idx.publish(0, new, idx.block_keys(list(range(1000 + 4 * i, 1004 + 4 * i)), "t")[0])
    idx.release(0, [new])
    if any(k == hot[0] for k, _ in evicted):
      break
    survived += 1
  else:
    pytest.fail("the once-hot block was never evicted")
  # Three never-used slots go first, then it is passed over log2(k) + 2 times.
  assert survived == 3 + reuses.bit_length() + 1
  idx.check_invariants()
