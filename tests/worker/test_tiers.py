"""Host and disk tiers: exact round trips, exact generation, and faults on real stores."""

import dataclasses
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jaxkv
from jaxkv.worker import pages as pages_lib
from jaxkv.tools import workloads
from jaxkv.scheduling.step import TierOrders
from jaxkv.worker.tiers.base import Fetch
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers import blocks, localdir
from jaxkv.worker.tiers.disk import DiskTier
from jaxkv.worker.tiers.host import HostTier

import faults
import helpers

DTYPES = ["bfloat16", "float16", "float32"]


def random_bits(rng, shape, dtype):
  """Arbitrary bit patterns, NaNs with payloads and infinities included."""
  itemsize = jnp.dtype(dtype).itemsize
  raw = rng.integers(0, 2**(8 * itemsize), size=shape, dtype=np.uint64)
  arr = raw.astype({2: np.uint16, 4: np.uint32}[itemsize]).view(jnp.dtype(dtype))
  flat = arr.reshape(-1)
  flat[:4] = np.array([np.nan, np.inf, -np.inf, -0.0]).astype(jnp.dtype(dtype))
  return arr


def bits(x):
  x = np.asarray(x)
  return x.view({2: np.uint16, 4: np.uint32}[x.dtype.itemsize])


# ---- round trips ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("memory_kind", ["pinned_host", "unpinned_host"])
def test_host_round_trip_is_bit_exact(mesh, dtype, memory_kind):
  c = helpers.cache_config_for(helpers.tiny_model_config(), dtype=dtype, pages_per_shard=8,
                              max_pages_per_seq=8)
  t = jaxkv.TierConfig(host_pages_per_shard=6, host_memory_kind=memory_kind)
  rng = np.random.default_rng(0)
  host = HostTier(mesh, c, t, num_arrays=4)
  assert host.pool.sharding.memory_kind == memory_kind
  stack_np = bits(random_bits(rng, (4, c.num_kv_heads, 4 * 2, c.page_size, c.head_dim), dtype))
  stack = jax.device_put(stack_np, NamedSharding(mesh, pages_lib.stacked_spec(c)))
  slots = np.array([[4, 1], [0, 5], [2, 3], [5, 0]], np.int32)
  host.store(stack, slots)
  back, sums = host.load(slots)
  assert back.sharding.memory_kind == "device"
  np.testing.assert_array_equal(bits(back), bits(stack_np))
  np.testing.assert_array_equal(np.asarray(sums).reshape(4, 2, 2), host.expected_checksums(slots))
  # A flipped bit in one page changes that page's checksum and no other.
  flipped = stack_np.copy()
  flipped[3, 1, 5, 2, 7] ^= 1 << 3
  sums2 = np.asarray(host.checksums(jax.device_put(flipped, stack.sharding))).reshape(4, 2, 2)
  changed = np.argwhere((sums2 != np.asarray(sums).reshape(4, 2, 2)).any(axis=2))
  assert changed.tolist() == [[2, 1]]  # page 5 = shard 2, second slot
  np.testing.assert_array_equal(bits(host.read_numpy(slots)), bits(stack_np))


@pytest.mark.parametrize("dtype", DTYPES)
def test_disk_round_trip_is_bit_exact_and_reopens(tmp_path, dtype):
  rng = np.random.default_rng(1)
  shape = (4, 2, 4, 8)
  fp = b"f" * 32
  disk = DiskTier(str(tmp_path / "d"), num_slots=8, payload_shape=shape, dtype=dtype,
                  fingerprint=fp)
  payloads = [random_bits(rng, shape, dtype) for _ in range(3)]
  writes = [disk.write(bytes([s]) * 32, p, None) for s, p in zip((5, 0, 7), payloads)]
  for w in writes:
    w.result(timeout=30)
  disk.sync()
  for s, p in zip((5, 0, 7), payloads):
    [got] = disk.read_verified([bytes([s]) * 32], time.monotonic() + 30)
    np.testing.assert_array_equal(bits(got), bits(p))
  again = DiskTier(str(tmp_path / "d"), num_slots=8, payload_shape=shape, dtype=dtype,
                   fingerprint=fp)
  good, deleted = again.scan()
  assert sorted(k for _, k, _ in good) == [bytes([s]) * 32 for s in (0, 5, 7)] and deleted == 0
  assert sorted(s for s, _, _ in good) == [0, 1, 2]  # this process's quota, numbered anew
  # A smaller quota takes what it can and deletes nothing; another model sees nothing.
  small = DiskTier(str(tmp_path / "d"), num_slots=2, payload_shape=shape, dtype=dtype,
                   fingerprint=fp)
  assert [len(x) if isinstance(x, list) else x for x in small.scan()] == [2, 0]
  other = DiskTier(str(tmp_path / "d"), num_slots=8, payload_shape=shape, dtype=dtype,
                   fingerprint=b"o" * 32)
  assert other.scan() == ([], 0)
  assert len(again.scan()[0]) == 3  # all still there


def test_record_verification_names_each_fault():
  rng = np.random.default_rng(2)
  x = random_bits(rng, (2, 2, 4, 8), "float32")
  rec = blocks.encode(x, b"k" * 32, b"f" * 32)
  ok = dict(key=b"k" * 32, fingerprint=b"f" * 32, dtype="float32", shape=x.shape)
  np.testing.assert_array_equal(bits(blocks.decode(rec, **ok)), bits(x))
  cases = {
      "checksum": lambda r: r.__setitem__(blocks.HEADER_BYTES + 7, r[blocks.HEADER_BYTES + 7] ^ 4),
      "key": None, "fingerprint": None, "magic": lambda r: r.__setitem__(slice(0, 8), 0),
  }
  for reason, mutate in cases.items():
    r = rec.copy()
    kw = dict(ok)
    if mutate:
      mutate(r)
    elif reason == "key":
      kw["key"] = b"x" * 32
    else:
      kw["fingerprint"] = b"g" * 32
    with pytest.raises(blocks.BlockError) as e:
      blocks.decode(r, **kw)
    assert e.value.reason == reason
  with pytest.raises(blocks.BlockError, match="size"):
    blocks.decode(rec[:-3], **ok)
  with pytest.raises(blocks.BlockError) as e:
    blocks.decode(rec, **{**ok, "dtype": "float16", "shape": (2, 2, 4, 16)})
  assert e.value.reason == "shape"


def test_device_host_disk_and_back_through_the_mover_is_bit_exact(mesh, tmp_path):
  for dtype in DTYPES:
    mc = helpers.tiny_model_config(dtype=dtype)
    cc = helpers.cache_config_for(mc, pages_per_shard=8, max_pages_per_seq=8)
    tiers = jaxkv.TierConfig(host_pages_per_shard=2, disk_kvstore=str(tmp_path / dtype),
                             disk_pages=32)
    engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers)
    rng = np.random.default_rng(3)
    pools = [jax.device_put(random_bits(rng, pages_lib.pool_shape(mesh, cc), dtype),
                            pages_lib.pool_sharding(mesh, cc)) for _ in range(4)]
    engine.cache.worker.update_pools(lambda old: (pools,))
    before = [bits(p) for p in pools]
    index, mover = engine.cache.index, engine.cache.worker.mover
    keys = [bytes([i]) * 32 for i in range(5)]
    pages = index.allocate(1, 5)
    for p, k in zip(pages, keys):
      index.publish(1, p, k)
    index.release(1, pages)
    # Two fit on host; then the host evicts those to disk to take the next two, and the
    # last one goes straight to disk (both host slots are in flight).
    # Every destination is the manager's choice; the worker copies what it is told.
    for part in (slice(0, 2), slice(2, 5)):
      orders = engine.cache.manager.resolve(TierOrders(demote=tuple(
          (1, p, k) for p, k in zip(pages[part], keys[part]))))
      engine.cache.worker.carry_out(orders)
    assert mover.flush(30) == 0
    assert [index.slot_of(1, k, Tier.HOST) is not None for k in keys] == [0, 0, 1, 1, 0]
    assert index.num_cached(1, Tier.HOST) == 2 and index.num_cached(0, Tier.DISK) == 3
    index.evict_all_unreferenced(1, Tier.DEVICE)
    dest = [7, 6, 5, 4, 3]  # bring them back to other pages of the same shard
    fetches = []
    for k, d in zip(keys, dest):
      (tier, slot), = index.locate(1, [k])
      index.acquire(1, [slot], tier)
      fetches.append(Fetch(0, 0, 1, tier, slot, k, d))
    new, pending = mover.start_promote(engine.cache.worker.pools, fetches)
    new, report = mover.finish_promote(new, pending, time.monotonic() + 30)
    assert report.failures == (None,) * 5 and report.blocks == 5, report.failures
    assert report.fetches == tuple(fetches) and report.tiers == (int(Tier.HOST), int(Tier.DISK))
    assert report.bytes == 5 * cc.page_bytes and report.seconds > 0
    assert sum(index.held_slots(1, Tier.HOST).values()) == 2  # the pins are the manager's
    assert engine.cache.manager.fetched(report.fetches, report.failures) == ()  # to release
    assert not index.held_slots(1, Tier.HOST) and not index.held_slots(0, Tier.DISK)
    for b, p in zip(before, new):
      got = bits(p)
      for src, d in zip(pages, dest):
        np.testing.assert_array_equal(got[:, 1 * 8 + d], b[:, 1 * 8 + src])
    index.check_invariants()


# ---- generation -------------------------------------------------------------------------------
def chat_outputs(engine, spec):
  chat = workloads.Chat(spec)
  outs = []
  for turn in range(spec.turns):
    out = engine.generate(chat.prompts(turn), spec.max_new_tokens)
    outs.append(out)
    chat.record(turn, out)
  return outs


SPEC = workloads.ChatSpec(users=6, turns=3, system_prompt_tokens=9, user_tokens=(3, 8),
                          max_new_tokens=4, vocab_size=128, seed=1)


@pytest.fixture(scope="module")
def recomputed(mesh):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  return chat_outputs(helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=False,
                                          max_seqs_per_shard=1), SPEC)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_small_device_budget_through_host_and_disk_is_exact(mesh, tmp_path, recomputed,
                                                           write_policy):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  tiers = jaxkv.TierConfig(host_pages_per_shard=3, disk_kvstore=str(tmp_path / "disk"),
                           disk_pages=200, write_policy=write_policy)
  engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=1)
  # Between turns the device copies are forgotten, so every reuse comes from below.
  chat = workloads.Chat(SPEC)
  for turn in range(SPEC.turns):
    out = engine.generate(chat.prompts(turn), SPEC.max_new_tokens)
    assert out == recomputed[turn], turn
    chat.record(turn, out)
    assert engine.flush(30) == 0
    if write_policy == "write_through":
      for s in range(4):
        engine.cache.index.evict_all_unreferenced(s, Tier.DEVICE)
  s = engine.stats()
  assert s["hits"]["host"] + s["hits"]["disk"] > 0 and s["blocks_fetched"] > 0
  if write_policy == "write_through":
    assert s["hits"]["disk"] > 0
  assert s["verify_failures"] == 0 and s["disk_write_failures"] == 0
  engine.cache.index.check_invariants()
  for tier, pools in ((Tier.DEVICE, 4), (Tier.HOST, 4)):
    for sh in range(pools):
      assert not engine.cache.index.held_slots(sh, tier)


def test_compute_never_reads_host_memory(mesh, tmp_path):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  engine = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1,
                               tiers=jaxkv.TierConfig(host_pages_per_shard=8))
  kinds = set()
  steps = engine.runner.steps
  real_prefill, real_decode = steps.prefill, steps.decode

  def spy(fn):
    def run(*args):
      for leaf in jax.tree.leaves(args):
        if isinstance(leaf, jax.Array):
          kinds.add(leaf.sharding.memory_kind)
      return fn(*args)
    return run

  steps.prefill, steps.decode = spy(real_prefill), spy(real_decode)
  try:
    chat_outputs(engine, SPEC)
  finally:
    steps.prefill, steps.decode = real_prefill, real_decode
  assert engine.stats()["hits"]["host"] > 0  # host pages were used...
  assert kinds == {"device"}  # ...but every array a model step saw was in device memory
  assert engine.cache.worker.host.pool.sharding.memory_kind == "pinned_host"


# ---- faults on a real store -------------------------------------------------------------------
def disk_engine(mesh, tmp_path, **tier_kw):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"), disk_pages=64,
                           write_policy="write_through", **tier_kw)
  return helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=1)


def chunk_path(engine, key):
  return engine.cache.worker.disk.path_of(key)



def assert_clean(engine):
  idx = engine.cache.index
  idx.check_invariants()
  for tier, shards in ((Tier.DEVICE, range(4)), (Tier.DISK, [0])):
    for s in shards:
      held = idx.held_slots(s, tier)
      assert not held, f"leaked references in {tier}: {held}"


FAULTS = ["flip_bit", "truncate", "delete", "swap", "foreign_tenant", "foreign_model"]


@pytest.mark.parametrize("fault", FAULTS)
def test_corrupt_disk_blocks_become_counted_misses_with_exact_output(mesh, tmp_path, fault):
  engine = disk_engine(mesh, tmp_path)
  page = engine.cache.config.page_size
  prompt = list(range(1, 6 * page + 2))  # 6 full blocks
  want = engine.generate([prompt], 3)
  assert engine.flush(30) == 0
  keys = engine.cache.index.block_keys(prompt, "default")
  slots = [engine.cache.index.slot_of(0, k, Tier.DISK) for k in keys]
  assert None not in slots
  target = chunk_path(engine, keys[2])
  if fault == "flip_bit":
    data = bytearray(open(target, "rb").read())
    data[len(data) // 2] ^= 0x10
    open(target, "wb").write(bytes(data))
  elif fault == "truncate":
    os.truncate(target, os.path.getsize(target) // 3)
  elif fault == "delete":
    os.remove(target)
  elif fault == "swap":
    other = chunk_path(engine, keys[4])
    a, b = open(target, "rb").read(), open(other, "rb").read()
    open(target, "wb").write(b)
    open(other, "wb").write(a)
  else:  # a block of another tenant / model, written by a real store, put in its place
    tenant, fp = ("mallory", None) if fault == "foreign_tenant" else ("default", b"m" * 32)
    foreign_key = engine.cache.index.block_keys(prompt, tenant)[2]
    donor = DiskTier(str(tmp_path / "donor"), num_slots=64,
                     payload_shape=engine.cache.payload_shape, dtype=engine.cache.config.jnp_dtype,
                     fingerprint=fp or engine.cache.config.fingerprint())
    written = foreign_key if fp is None else keys[2]
    donor.write(written, np.zeros(engine.cache.payload_shape, np.float32),
                None).result(timeout=30)
    donor.sync()
    open(target, "wb").write(open(donor.path_of(written), "rb").read())
  helpers.forget_device_copies(engine)
  got = engine.generate([prompt], 3)
  assert got == want
  s = engine.stats()
  if fault == "delete":  # as another process sharing the store evicting it: a miss
    assert s["verify_failures"] == 0 and s["verify_failures_by_reason"]["gone"] == 1
  else:
    assert s["verify_failures"] >= 1
  assert s["hits"]["disk"] == 2  # blocks 0 and 1 verified; 2 failed; the rest recomputed
  # The bad copy left the index with the three blocks chained after it (then the
  # recomputed blocks were written through again).
  assert engine.cache.index.counters.dropped == 4
  assert engine.flush(30) == 0
  assert_clean(engine)
  # Recomputed blocks were written again: the next cold read verifies end to end.
  helpers.forget_device_copies(engine)
  assert engine.generate([prompt], 3) == want
  assert engine.stats()["hits"]["disk"] == 2 + 6


def test_reads_later_than_the_deadline_become_misses(mesh, tmp_path):
  """A store that answers no read: the request does not wait for it past the deadline
  (it returns, exact, while every read is still unanswered) and the reads count as
  timeouts; answers that come after that change nothing."""
  engine = disk_engine(mesh, tmp_path, read_deadline_s=0.2)
  prompt = list(range(1, 30))
  want = engine.generate([prompt], 3)
  engine.flush(30)
  helpers.forget_device_copies(engine)
  held = faults.HeldReads(engine.cache.worker.disk)
  engine.cache.worker.disk.read = held
  assert engine.generate([prompt], 3) == want
  # Answered before any read result came (a reader that waited would have had them at
  # the backstop): it did not wait for the store.
  assert held.issued and held.delivered == 0
  s = engine.stats()
  assert s["read_timeouts"] == len(held.issued) and s["hits"]["disk"] == 0
  assert s["verify_failures_by_reason"]["deadline"] == len(held.issued)
  # None answered by the deadline: the store is detached at once, not after two more.
  assert s["disk_detached"] == 1, s
  held.release()  # the late reads complete into nothing
  assert held.delivered == len(held.issued)
  assert engine.flush(30) == 0
  after = engine.stats()
  assert after["read_timeouts"] == s["read_timeouts"] and after["hits"] == s["hits"]
  assert_clean(engine)


@pytest.mark.parametrize("times", [1, 2])
def test_a_read_error_keeps_the_record_once_and_gives_up_when_it_repeats(mesh, tmp_path, times):
  engine = disk_engine(mesh, tmp_path)
  prompt = list(range(1, 30))
  want = engine.generate([prompt], 3)
  engine.flush(30)
  keys = engine.cache.index.block_keys(prompt, "default")
  slots = [engine.cache.index.slot_of(0, k, Tier.DISK) for k in keys]
  assert None not in slots
  engine.cache.worker.disk.read = faults.FailingReads(engine.cache.worker.disk, times)
  for attempt in range(times):
    helpers.forget_device_copies(engine)
    engine.reset_stats()
    assert engine.generate([prompt], 3) == want  # a miss: recomputed, exact
    s = engine.stats()
    assert s["hits"]["disk"] == 0 and s["verify_failures"] == (len(keys) if attempt else 0)
    reason = "read_retry" if attempt == 0 else "read_error"
    assert s["verify_failures_by_reason"].get(reason, 0) >= 1
    engine.flush(30)
    # Kept (transient): nothing is written again. Given up: dropped as a corrupt record
    # is, so the recomputed blocks are written anew.
    assert engine.stats()["demoted_disk"] == (len(keys) if attempt else 0)
  helpers.forget_device_copies(engine)
  engine.reset_stats()
  assert engine.generate([prompt], 3) == want
  assert engine.stats()["hits"]["disk"] == len(keys)  # read this time
  if times == 1:
    assert [engine.cache.index.slot_of(0, k, Tier.DISK) for k in keys] == slots
  engine.flush(30)
  assert_clean(engine)


def test_a_store_that_keeps_failing_is_detached_for_a_cool_down(mesh, tmp_path):
  engine = disk_engine(mesh, tmp_path)
  prompt = list(range(1, 30))
  want = engine.generate([prompt], 3)
  engine.flush(30)
  failing = faults.FailingReads(engine.cache.worker.disk, times=10**9)  # the store is down
  engine.cache.worker.disk.read = failing
  engine.cache.worker.disk.write = faults.FailingWrites(engine.cache.worker.disk,
                                                 OSError(5, "Input/output error"))
  breaker = engine.cache.worker.mover.journal.breaker
  breaker.cool_down_s = 1.0
  for _ in range(3):  # every read and write raises: recomputed; 3 failed batches detach it
    helpers.forget_device_copies(engine)
    assert engine.generate([prompt], 3) == want
    engine.flush(30)
  assert engine.stats()["disk_detached"] == 1
  reads = sum(failing.failed.values())
  helpers.forget_device_copies(engine)
  engine.reset_stats()
  assert engine.generate([prompt], 3) == want
  s = engine.stats()
  assert sum(failing.failed.values()) == reads  # detached: nothing was read from it
  assert s["hits"]["disk"] == 0 and s["disk_detached_drops"] > 0  # nor written to it
  helpers.wait_for(lambda: breaker.available, 10, "the disk's breaker closes after its cool-down")
  del engine.cache.worker.disk.read, engine.cache.worker.disk.write  # the real ones again
  for _ in range(2):  # attached again: written through, then read back
    helpers.forget_device_copies(engine)
    engine.reset_stats()
    assert engine.generate([prompt], 3) == want
    engine.flush(30)
  assert engine.stats()["hits"]["disk"] > 0 and engine.stats()["demoted_disk"] == 0
  engine.flush(30)
  assert_clean(engine)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_disk_fetch_says_when_its_reads_ended_not_when_it_was_waited_for(tmp_path, s3, where):
  """Reads that end while the caller computes (a split's front) are timed to their end:
  ``FetchOutcome.arrived`` lies between their start and the wait, so the plan learns the
  store's link from its reads, not from the compute beside them."""
  shape = (4, 2, 4, 8)
  location = str(tmp_path / "d") if where == "local" else s3.kvstore("arrivals", "kv/")
  disk = DiskTier(location, num_slots=8, payload_shape=shape, dtype="float32",
                  fingerprint=b"f" * 32)
  payloads = [np.full(shape, i, np.float32) for i in range(3)]
  keys = [bytes([i + 1]) * 32 for i in range(3)]
  for key, payload in zip(keys, payloads):
    disk.write(key, payload, None).result()
  fetches = [Fetch(request=0, block=j, shard=0, tier=Tier.DISK, slot=0, key=key, page=j + 1)
             for j, key in enumerate(keys)]
  t0 = time.perf_counter()
  _, pending = disk.start_fetch(fetches)
  helpers.wait_for(lambda: all(r.future.done() for _, r in pending), 30, "the reads to end")
  time.sleep(0.2)  # the caller's compute
  t_wait = time.perf_counter()
  outcome = disk.finish_fetch(pending, time.monotonic() + 10, stage=list)
  assert outcome.failures == (None,) * 3
  for (_, page, got), f, want in zip(outcome.landing, fetches, payloads):
    assert page == f.page
    np.testing.assert_array_equal(got.view(np.float32).reshape(shape), want)
  assert t0 < outcome.arrived < t_wait - 0.1, (outcome.arrived - t0, t_wait - t0)
  # A read that failed says nothing of when bytes came: none verified, no time.
  _, pending = disk.start_fetch([dataclasses.replace(fetches[0], key=b"\x09" * 32)])
  missed = disk.finish_fetch(pending, time.monotonic() + 10, stage=list)
  assert missed.failures != (None,) and missed.arrived is None


def test_an_object_store_that_is_gone_refuses_reads_at_once_and_is_detached(mesh, tmp_path):
  """The disk tier on an S3 server (moto on loopback) that then stops: each request's
  reads fail as the store's errors (a refused connection, retried a bounded number of
  times), not at the read deadline (60 s here); the answers are recompute's; the failed
  batches detach the store, after which nothing is read from it."""
  from jaxkv.tools.bench.s3server import LocalS3
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  prompt = list(range(1, 30))
  with LocalS3() as s3:
    tiers = jaxkv.TierConfig(disk_kvstore=s3.kvstore("gone-store", "kv/"), disk_pages=64,
                             write_policy="write_through", read_deadline_s=60.0)
    engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=1)
    # Once detached, detached for the rest of the test (not tried again after 10 s).
    engine.cache.worker.mover.journal.breaker.cool_down_s = 600.0
    want = engine.generate([prompt], 3)
    engine.flush(30)
    helpers.forget_device_copies(engine)
    engine.reset_stats()
    assert engine.generate([prompt], 3) == want
    assert engine.stats()["hits"]["disk"] > 0  # read from the store while it is there
  engine.reset_stats()
  for _ in range(3):  # the server is gone
    helpers.forget_device_copies(engine)
    assert engine.generate([prompt], 3) == want
    engine.flush(30)
  s = engine.stats()
  reasons = s["verify_failures_by_reason"]
  assert s["hits"]["disk"] == 0 and reasons.get("read_retry", 0) > 0, s
  assert "deadline" not in reasons and s["read_timeouts"] == 0, reasons  # refused, not waited
  assert s["disk_detached"] == 1, s
  helpers.forget_device_copies(engine)
  engine.reset_stats()
  assert engine.generate([prompt], 3) == want
  s = engine.stats()
  assert not s["verify_failures_by_reason"] and s["disk_detached_drops"] > 0, s  # not read


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_a_block_on_several_shards_is_written_to_disk_once(mesh, tmp_path, write_policy):
  """pin computes a prompt on every data shard; each copy used to take a disk slot of its
  own when they went down together (and evict other records for it)."""
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  engine = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1, tiers=jaxkv.TierConfig(
      disk_kvstore=str(tmp_path / "disk"), disk_pages=64, write_policy=write_policy))
  page = engine.cache.config.page_size
  before = [list(range(40 + 20 * i, 40 + 20 * i + 2 * page + 1)) for i in range(3)]
  engine.generate(before, 2)
  engine.offload()  # write-back: they go down now
  engine.flush(30)
  earlier = engine.occupancy()["cached_blocks"]["disk"]
  assert earlier > 0
  prompt = list(range(1, 3 * page + 2))  # 3 full blocks
  assert engine.pin(prompt) == 3
  keys = engine.cache.index.block_keys(prompt, "default")
  assert all(engine.cache.index.slot_of(s, k, Tier.DEVICE) is not None
             for s in range(4) for k in keys)
  engine.unpin(prompt)
  engine.offload()  # every shard's copy goes down in one batch
  assert engine.flush(30) == 0
  assert engine.occupancy()["cached_blocks"]["disk"] == earlier + 3  # once each, nothing lost
  assert engine.stats()["demoted_disk"] == earlier + 3
  assert_clean(engine)


def test_failed_disk_writes_are_counted_and_never_published(mesh, tmp_path):
  engine = disk_engine(mesh, tmp_path)
  engine.cache.worker.disk.write = faults.FailingWrites(
      engine.cache.worker.disk, PermissionError(13, "Permission denied"), landed=True)
  prompt = list(range(1, 30))
  want = engine.generate([prompt], 3)
  engine.flush(30)
  s = engine.stats()
  assert s["disk_write_failures"] > 0 and s["demoted_disk"] == 0
  assert engine.cache.index.num_cached(0, Tier.DISK) == 0
  helpers.forget_device_copies(engine)
  assert engine.generate([prompt], 3) == want
  assert_clean(engine)


DISK_FULL_WRITER = r"""
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
from jaxkv.worker.tiers.disk import DiskTier
disk = DiskTier(sys.argv[1], num_slots=8, payload_shape=(2, 2, 4, 64), dtype="float32",
                fingerprint=b"f" * 32)
resource.setrlimit(resource.RLIMIT_FSIZE, (1500, 1500))  # records are ~4.3 KB: the disk is "full"
w = disk.write(b"k" * 32, np.ones((2, 2, 4, 64), np.float32), None)
try:
  w.result(timeout=30)
  print("WROTE")
except Exception as e:
  print("FAILED", type(e).__name__, e)
"""


def test_disk_full_is_a_failed_write_not_a_crash(tmp_path):
  proc = subprocess.run([sys.executable, "-c", DISK_FULL_WRITER, str(tmp_path / "d")],
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("FAILED"), proc.stdout
  reopened = DiskTier(str(tmp_path / "d"), num_slots=8, payload_shape=(2, 2, 4, 64),
                      dtype="float32", fingerprint=b"f" * 32)
  good, _ = reopened.scan()
  assert good == []  # nothing half-written is ever taken for a block


KILLED_WRITER = r"""
import sys
import numpy as np
from jaxkv.worker.tiers.disk import DiskTier
disk = DiskTier(sys.argv[1], num_slots=64, payload_shape=(4, 2, 16, 256), dtype="float32",
                fingerprint=b"f" * 32)
rng = np.random.default_rng(0)
i = 0
print("WROTE 0", flush=True)
while True:
  ws = [disk.write(((i + j) % 64).to_bytes(32, "little"),
                   rng.standard_normal((4, 2, 16, 256)).astype(np.float32), None)
        for j in range(8)]
  for w in ws:
    w.result()
  i += 8
  print("WROTE", i, flush=True)
"""


def written(proc, at_least: int, timeout_s: float) -> int:
  """Reads the writer's progress lines until it has written ``at_least`` blocks (it keeps
  writing); past ``timeout_s``, or if it exits, the test fails."""
  deadline, wrote = time.monotonic() + timeout_s, -1
  while wrote < at_least:
    left = deadline - time.monotonic()
    if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
      pytest.fail(f"the writer wrote {wrote} blocks in {timeout_s} s, not {at_least}")
    line = proc.stdout.readline()
    if not line.startswith("WROTE"):
      pytest.fail(f"the writer stopped: {line!r}")
    wrote = int(line.split()[1])
  return wrote


def test_writer_killed_mid_write_reopens_with_only_verified_blocks(tmp_path):
  path = str(tmp_path / "d")
  proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, path], stdout=subprocess.PIPE,
                          text=True)
  try:
    written(proc, 24, 120)  # killed while it writes its fourth batch or a later one
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()
  # Leave a torn temporary behind as a crash would, and a chunk cut short; and a
  # temporary that a live writer holds locked, as TensorStore's file driver does while it
  # writes (an open-file-description lock).
  disk = DiskTier(path, num_slots=64, payload_shape=(4, 2, 16, 256), dtype="float32",
                  fingerprint=b"f" * 32)
  records = sorted(n for n in os.listdir(disk.prefix_path) if not n.endswith(".__lock"))
  assert len(records) >= 8
  torn = os.path.join(disk.prefix_path, "ab" * 32 + ".__lock")
  open(torn, "wb").write(b"partial")
  live = os.path.join(disk.prefix_path, "cd" * 32 + ".__lock")
  live_fd = os.open(live, os.O_RDWR | os.O_CREAT)
  fcntl.fcntl(live_fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, 0, 0, 0, 0))
  fresh = os.path.join(disk.prefix_path, "ef" * 32 + ".1-0.__lock")  # created, not yet locked
  open(fresh, "wb").write(b"being written")
  os.truncate(os.path.join(disk.prefix_path, records[0]), 100)
  # The next open comes later: what the killed writer left, and the torn temporary, are
  # older than a live writer's (an unlocked temporary is stale only once old).
  old = time.time() - 2 * localdir.STALE_TEMPORARY_S
  for n in os.listdir(disk.prefix_path):
    if n.endswith(".__lock") and not n.startswith("ef"):
      os.utime(os.path.join(disk.prefix_path, n), (old, old))
  try:
    disk = DiskTier(path, num_slots=64, payload_shape=(4, 2, 16, 256), dtype="float32",
                    fingerprint=b"f" * 32)
    assert disk.removed_temporaries >= 1 and not os.path.exists(torn)
    assert os.path.exists(live)  # a live writer's temporary is not taken from under it
    assert os.path.exists(fresh)  # nor one just created (its writer locks it next)
  finally:
    os.close(live_fd)
  os.remove(live)
  os.remove(fresh)
  good, deleted = disk.scan()
  assert deleted >= 1 and len(good) >= 7
  assert records[0] not in os.listdir(disk.prefix_path)  # the torn record was deleted
  keys = [key for _, key, _ in good]
  assert all(int.from_bytes(k, "little") < 10**6 for k in keys)  # the writer's keys
  disk.read_verified(keys, time.monotonic() + 30)
  assert not [n for n in os.listdir(disk.prefix_path) if n.endswith("__lock")]
  assert disk.bytes_on_disk() <= 64 * disk.record_bytes * 1.01 + 4096
  # The cache adopts the survivors.
  assert len(disk.scan()[0]) == len(good)


def test_opening_a_store_tolerates_temporaries_that_vanish_meanwhile(tmp_path, monkeypatch):
  """Another writer finishes (renames) its temporary between our listing and our removal."""
  path = str(tmp_path / "d")
  make = lambda: DiskTier(path, num_slots=8, payload_shape=(2, 2, 4, 8), dtype="float32",
                          fingerprint=b"f" * 32)
  first = make()
  from jaxkv.worker.tiers import localdir
  os.makedirs(first.prefix_path, mode=0o700, exist_ok=True)
  temporary = os.path.join(first.prefix_path, "ab" * 32 + ".__lock")
  with open(temporary, "wb") as f:
    f.write(b"half a record")
  real = localdir._remove_if_unlocked

  def writer_finishes_first(dir_fd, name):  # the writer renames it once it was listed
    if name.endswith(".__lock"):
      os.rename(temporary, temporary[:-len(".__lock")])
    return real(dir_fd, name)

  monkeypatch.setattr(localdir, "_remove_if_unlocked", writer_finishes_first)
  assert make().removed_temporaries == 0  # listed, gone by the time it is looked at
  assert os.path.exists(temporary[:-len(".__lock")])  # the finished record is left alone


def test_cache_adopts_verified_disk_blocks_of_a_previous_run(mesh, tmp_path):
  engine = disk_engine(mesh, tmp_path)
  prompt = list(range(1, 30))
  want = engine.generate([prompt], 3)
  engine.flush(30)
  again = disk_engine(mesh, tmp_path)
  assert again.cache.disk_recovered["adopted"] >= 7
  assert again.generate([prompt], 3) == want
  assert again.stats()["hits"]["disk"] == 7


def test_bad_tier_configs_are_refused(tmp_path):
  with pytest.raises(ValueError, match="must be set together"):
    jaxkv.TierConfig(disk_kvstore=str(tmp_path))
  with pytest.raises(ValueError, match="host_pages_per_shard=-1"):
    jaxkv.TierConfig(host_pages_per_shard=-1)
  with pytest.raises(ValueError, match="write_policy='sometimes'"):
    jaxkv.TierConfig(write_policy="sometimes")
  with pytest.raises(ValueError, match="remote_transport='rdma'.*inline"):
    jaxkv.TierConfig(remote_transport="rdma")
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(ValueError, match="cannot be created"):
    DiskTier(str(blocker / "sub"), num_slots=2, payload_shape=(2, 2, 4, 8), dtype="float32",
             fingerprint=b"f" * 32)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_stress_tiny_pools_with_slow_disk_never_lose_a_pinned_block(mesh, tmp_path, write_policy):
  """Many rounds over pools far too small: evictions in every tier race promotions, disk
  reads in flight and disk writes not yet committed. Outputs stay exact and every
  reference is given back."""
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=10, max_pages_per_seq=10)
  tiers = jaxkv.TierConfig(host_pages_per_shard=2, disk_kvstore=str(tmp_path / write_policy),
                           disk_pages=12, write_policy=write_policy, read_deadline_s=5.0)
  engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=2)
  engine.cache.worker.disk.read = faults.SlowReads(engine.cache.worker.disk, delay_s=0.02)
  fresh = helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=False, max_seqs_per_shard=2)
  rng = np.random.default_rng(11)
  prefixes = [rng.integers(1, 128, int(n)).tolist() for n in (9, 14, 21)]
  for round_ in range(8):
    prompts = []
    for _ in range(5):
      p = prefixes[int(rng.integers(0, 3))]
      prompts.append(p + rng.integers(1, 128, int(rng.integers(1, 12))).tolist())
    assert engine.generate(prompts, 3) == fresh.generate(prompts, 3), round_
    engine.cache.index.check_invariants()
    for s in range(4):  # no request or transfer reference survives a call...
      assert not engine.cache.index.held_slots(s, Tier.DEVICE)
      assert not engine.cache.index.held_slots(s, Tier.HOST)
    disk_refs = sum(engine.cache.index.held_slots(0, Tier.DISK).values())
    assert disk_refs == engine.cache.worker.mover.writes_in_flight  # ...but uncommitted disk writes
    if round_ % 2:
      assert engine.offload() > 0  # everything below device: the next round promotes
  assert engine.flush(30) == 0
  assert_clean(engine)
  s = engine.stats()
  assert s["hits"]["host"] + s["hits"]["disk"] > 0 and s["blocks_fetched"] > 0
  assert s["demoted_host"] > 0 and s["demoted_disk"] > 0  # both lower tiers took blocks
  assert engine.cache.index.counters.evictions > 20
