"""The POOL tier against a real Mooncake master on loopback: a block one cache puts is a
hit in another (another process too), names and values reveal and accept nothing without
the deployment key, and every fault (master killed and back, a lender killed or stopped, a
tampered or moved value, a pool with no room) is a counted miss with the exact answer,
never a wait past the read deadline."""

import json
import os
import signal
import sys
import time

import numpy as np
import pytest

import jaxkv
from jaxkv.entrypoints.openai import disagg
from jaxkv.errors import InputError
from jaxkv.worker.tiers.pool import check_reachable, native
from jaxkv.worker.tiers.pool.tier import GET_THREADS
from jaxkv.worker.tiers.pool.master import LocalMaster, free_port

import helpers

KEY = b"the deployment key of the pool tests, 32+ bytes long"
LENGTH = 30  # tokens per prompt: 7 full blocks of 4


@pytest.fixture(scope="module")
def master(tmp_path_factory):
  with LocalMaster(log_path=str(tmp_path_factory.mktemp("pool") / "master.log")) as m:
    yield m


def pool_engine(mesh, m, *, key=None, segment_mb=16, host=0, disk=None,
                write_policy="write_through", deadline_s=10.0, **kw):
  tiers = jaxkv.TierConfig(pool_master=m.address, pool_metadata=m.metadata,
                           pool_segment_mb=segment_mb, write_policy=write_policy,
                           host_pages_per_shard=host, read_deadline_s=deadline_s,
                           disk_kvstore=disk, disk_pages=64 if disk else 0)
  return helpers.make_engine(mesh, tiers=tiers, deployment_key=key, **kw)


def prompts(seed, n=2):
  return [[1 + (seed * 37 + i * 11 + j * 3) % 120 for j in range(LENGTH)] for i in range(n)]


def blocks_of(n_prompts):
  return n_prompts * ((LENGTH - 1) // 4)  # usable blocks: one token is left to compute


def close(*engines):
  for e in engines:
    e.cache.worker.close()


@pytest.mark.parametrize("keyed", [False, True])
def test_a_block_one_cache_put_is_a_hit_in_another_exact_and_named_by_key_only(
    mesh, master, fresh, keyed):
  key = KEY if keyed else None
  a, b = pool_engine(mesh, master, key=key), pool_engine(mesh, master, key=key)
  ps = prompts(1 + keyed)
  want = fresh.generate(ps, 3)
  assert a.generate(ps, 3) == want
  assert a.cache.worker.pool.settle(30)
  assert a.stats()["pool_puts"] >= blocks_of(2)
  assert b.generate(ps, 3) == want
  s = b.stats()
  assert s["hits"]["pool"] == blocks_of(2), s["hits"]
  assert s["pool_failures"] == 0 and s["verify_failures"] == 0
  # What the pool sees: with a key, names that are keyed hashes (no block key in them) and
  # sealed values; without one, the block key in the name.
  pool, keys = b.cache.worker.pool, b.cache.index.block_keys(ps[0], "default")[:3]
  names = [pool.name(k) for k in keys]
  assert any(k.hex() in n for k, n in zip(keys, names)) != keyed
  value = pool.client.get(names[0])
  assert len(value) == pool.value_bytes
  assert (b"JAXKVBK1" in value) != keyed  # the record's magic is visible only in the clear
  close(a, b)


def test_a_value_moved_tampered_or_written_without_the_key_is_rejected_counted_and_removed(
    mesh, master, fresh):
  a, b = pool_engine(mesh, master, key=KEY), pool_engine(mesh, master, key=KEY)
  ps = prompts(3, 1)
  want = fresh.generate(ps, 3)
  a.generate(ps, 3)
  assert a.cache.worker.pool.settle(30)
  pool = a.cache.worker.pool
  keys = a.cache.index.block_keys(ps[0], "default")
  client = pool.client
  # Block 1's value put under block 0's name; block 2's flipped; block 3's replaced by a
  # keyless record of the right block (what a writer without the key can make).
  moved = client.get(pool.name(keys[1]))
  flipped = bytearray(client.get(pool.name(keys[2])))
  flipped[len(flipped) // 2] ^= 1
  payload = np.zeros(pool.payload_shape, pool.dtype)
  unkeyed = pool.scratch(pool.fingerprint)
  unkeyed.key, unkeyed._seal = None, None  # pylint: disable=protected-access
  forged = unkeyed.value(keys[3], payload, keys[2])
  for k, v in ((keys[0], moved), (keys[2], bytes(flipped)), (keys[3], forged)):
    assert client.remove(pool.name(k), True) == 0
    assert client.put(pool.name(k), v) == 0
  assert b.generate(ps, 3) == want  # the first bad block ends the hit: recomputed from there
  s = b.stats()
  assert s["verify_failures_by_reason"] == {"mac": 2, "size": 1}, s["verify_failures_by_reason"]
  assert s["hits"]["pool"] == 0 and s["pool_failures"] == 3
  # The rejected values were removed, and put again by the reader, which recomputed them:
  # every value verifies now, and the next cache hits them all.
  assert s["pool_removed"] == 3
  assert b.cache.worker.pool.settle(30)
  for k in keys[:4]:
    pool.decode(k, client.get(pool.name(k)))
  c = pool_engine(mesh, master, key=KEY)
  assert c.generate(ps, 3) == want
  assert c.stats()["hits"]["pool"] == blocks_of(1)
  close(a, b, c)


def test_the_master_killed_mid_run_is_a_counted_miss_and_the_pool_comes_back(
    mesh, tmp_path, fresh):
  with LocalMaster(log_path=str(tmp_path / "master.log")) as m:
    a = pool_engine(mesh, m, deadline_s=2.0)
    ps = prompts(4, 1)
    want = {tuple(p): fresh.generate([p], 3)[0] for p in ps}
    assert a.generate(ps, 3)[0] == want[tuple(ps[0])]
    assert a.cache.worker.pool.settle(30)
    m.stop()
    helpers.forget_device_copies(a)
    a.reset_stats()
    # The lookup fails (a client call blocks ~4 s while the master is down: the lookup's
    # deadline answers first) and the prompt is recomputed.
    assert a.generate(ps, 3)[0] == want[tuple(ps[0])]
    s = a.stats()
    assert s["hits"]["pool"] == 0 and s["computed_tokens"] == LENGTH
    assert s.get("pool_lookup_errors", 0) + s.get("pool_lookup_timeouts", 0) >= 1
    # The master is back (empty: it keeps the pool in memory); the client reconnects and
    # puts again, and another cache hits what it put.
    m.start()
    tried = []

    def put_one():
      later = prompts(100 + len(tried), 1)
      tried.append(later)
      a.generate(later, 3)
      a.cache.worker.pool.settle(10)
      return a.stats()["pool_puts"] > 0

    helpers.wait_for(put_one, 60, "puts succeed after the master came back", interval_s=0.5)
    b = pool_engine(mesh, m)
    want = fresh.generate(tried[-1], 3)

    def hits_the_pool():
      helpers.forget_device_copies(b)
      b.reset_stats()
      assert b.generate(tried[-1], 3) == want
      return b.stats()["hits"]["pool"] == blocks_of(1)

    # (A fresh client's first lookup after the restart can pass its 0.5 s deadline on a
    # loaded machine, as in a clean-clone run of the suite: that request recomputes,
    # exactly, and a later one hits.)
    helpers.wait_for(hits_the_pool, 30, "another cache hitting what was put after the restart",
                     interval_s=0.2)
    close(a, b)


def _start_lender(m, ps):
  proc = helpers.start_process([sys.executable, "tests/pool_lender.py", m.address, m.metadata,
                                json.dumps(ps)])
  line = proc.stdout.readline()
  if not line.startswith("READY"):
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"the lender did not start: {line!r} {proc.stderr.read()[-2000:]}")
  return proc, int(line.split()[1])


def test_blocks_another_process_lent_are_hits_and_vanish_with_it_or_time_out_when_it_hangs(
    mesh, master, fresh):
  ps = prompts(6, 2)
  want = fresh.generate(ps, 3)
  proc, put = _start_lender(master, ps)
  try:
    assert put >= blocks_of(2)
    # This process lends nothing: every value lives in the lender's segment.
    a = pool_engine(mesh, master, segment_mb=0, deadline_s=1.5)
    assert a.generate(ps[:1], 3) == want[:1]
    assert a.stats()["hits"]["pool"] == blocks_of(1)
    # The lender stops answering (SIGSTOP): a get hangs in the client for 30 s, the read
    # deadline makes it a miss after 1.5 s and the prompt is recomputed.
    os.killpg(proc.pid, signal.SIGSTOP)
    b = pool_engine(mesh, master, segment_mb=0, deadline_s=1.5)
    assert b.generate(ps[1:], 3) == want[1:]
    s = b.stats()
    # Every block of the prompt was a pool entry whose get missed its deadline: each one a
    # counted miss, none a hit, and the whole prompt but its last token computed again.
    assert s["verify_failures_by_reason"] == {"deadline": blocks_of(1)}, s
    assert s["hits"]["pool"] == 0 and s["computed_tokens"] == LENGTH, s
    assert s["read_timeouts"] >= 1, s
    # A get not answered by its deadline opened the gets' breaker at once (each later
    # request would have waited the deadline too).
    assert b.cache.worker.pool.get_breaker.open_until > 0
    # Closed while a get is still inside the client (the lender still stopped): the client
    # is left open, not freed under the call, and the call returns into it later.
    assert b.cache.worker.pool._calls.running_after(0) >= 1  # pylint: disable=protected-access
    b.cache.worker.pool.close(timeout_s=0.5)
    assert b.stats()["pool_close_left_open"] == 1
    os.killpg(proc.pid, signal.SIGCONT)
    # The lender killed: its blocks vanish (a miss each, recomputed exactly).
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    c = pool_engine(mesh, master, segment_mb=0, deadline_s=5.0)
    assert c.generate(ps, 3) == want
    assert c.stats()["hits"]["pool"] == 0
    close(a, b, c)
  finally:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def test_a_lender_the_master_still_lists_costs_misses_then_is_not_tried(mesh, tmp_path, fresh):
  """A lender its master still lists (the master forgets a silent client after 60 s here).
  Stopped (SIGSTOP): each get waits out the read deadline and stays inside the client;
  once every get thread holds one, the pool is asked nothing and read nothing, so no
  request queues behind them. Killed: lookups answer, and each get fails to transfer (a
  miss, counted ``io``); three such gets in a row open the gets' breaker, which the
  lookups' answers do not close: the next request asks for nothing and reads nothing.
  Every answer is recompute's."""
  ps = prompts(21, 6)
  want = fresh.generate(ps, 3)
  with LocalMaster(log_path=str(tmp_path / "master.log"), flags=("--client_ttl=60",)) as m:
    proc, put = _start_lender(m, ps)
    try:
      assert put >= blocks_of(6)
      a = pool_engine(mesh, m, segment_mb=0, deadline_s=1.0)
      pool = a.cache.worker.pool
      assert a.generate(ps[:1], 3) == want[:1]
      assert a.stats()["hits"]["pool"] == blocks_of(1)
      os.killpg(proc.pid, signal.SIGSTOP)
      pool.get_breaker.cool_down_s = 0.0  # each request tries the pool again
      a.reset_stats()
      for _ in range(GET_THREADS + 1):
        helpers.forget_device_copies(a)
        assert a.generate(ps[1:2], 3) == want[1:2]
      s = a.stats()
      assert s["verify_failures_by_reason"] == {"deadline": blocks_of(1) * GET_THREADS}, s
      assert s["pool_gets_stuck"] >= 1 and s["hits"]["pool"] == 0, s
      os.killpg(proc.pid, signal.SIGKILL)  # (the gets inside the client fail and return)
      proc.wait(30)
      helpers.wait_for(lambda: not pool.gets_stuck(), 30, "the stuck gets returning")
      close(a)
      # The killed lender's gets fail at once: asked by an engine whose read deadline no
      # get to a dead lender reaches on a loaded machine (with 1 s, one did, counted as a
      # deadline, which opens the breaker at once), its breaker open for the rest of the
      # test once opened.
      b = pool_engine(mesh, m, segment_mb=0, deadline_s=20.0)
      pool = b.cache.worker.pool
      pool.get_breaker.cool_down_s = 600.0
      for i in (2, 3, 4):
        assert b.generate([ps[i]], 3) == [want[i]]
      s = b.stats()
      assert s["hits"]["pool"] == 0 and s["verify_failures_by_reason"] == {
          "io": blocks_of(3)}, s
      assert not pool.get_breaker.available and pool.breaker.available
      lookups = s["pool_lookups"]
      assert b.generate([ps[5]], 3) == [want[5]]
      s = b.stats()
      assert s["verify_failures_by_reason"] == {"io": blocks_of(3)}, s  # nothing read
      assert s["hits"]["pool"] == 0 and s["pool_lookups"] == lookups + 1, s
      close(b)
    finally:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_a_lender_that_keeps_its_registration_but_stops_serving_costs_misses_never_waits(
    mesh, tmp_path, fresh):
  """Puts to a lender that is registered (its master forgets a silent client only after 60 s
  here) but serves no transfer hang in the client for its own 30 s: each is given up at its
  deadline (the read deadline, 1.5 s, here), counted, and trips the breaker, so later puts are
  dropped at once; a prefill's hand-off answers within seconds, promising no block (it used
  to wait for the whole put queue: up to 60 s); the decode node recomputes, exactly."""
  with LocalMaster(log_path=str(tmp_path / "master.log"), flags=("--client_ttl=60",)) as m:
    lender = helpers.start_process([sys.executable, "-m", "jaxkv.worker.tiers.pool.lend",
                                    f"--pool={m.address}", f"--pool_metadata={m.metadata}",
                                    "--segment_mb=16"], env=helpers.child_env())
    try:
      line = lender.stdout.readline()
      assert line.startswith("lending"), (line, lender.stderr.read()[-2000:])
      # Both nodes lend nothing: every value is placed on the lender, which now stops.
      prefill = pool_engine(mesh, m, segment_mb=0, deadline_s=1.5)
      decode = pool_engine(mesh, m, segment_mb=0, deadline_s=1.5)
      os.killpg(lender.pid, signal.SIGSTOP)
      ps = prompts(15, 1)
      want = fresh.generate(ps, 3)
      assert prefill.generate(ps, 3) == want
      t0 = time.monotonic()
      params = disagg.hand_off(prefill.cache, ps[0], "default", engine_id="e",
                               host="prefill-1", port=8100, deadline_s=60.0)  # the old wait
      waited = time.monotonic() - t0
      print(f"the hand-off with a stopped lender answered in {waited:.2f} s")
      assert waited < 8.0, waited
      assert params["remote_block_ids"] == [] and params["remote_host"] == "prefill-1"
      assert prefill.stats()["pd_prefills_not_handed_off"] == 1
      assert decode.generate(ps, 3) == want
      assert decode.stats()["hits"]["pool"] == 0
      # Two put calls given up (each left inside the client), the third finds no put thread
      # free: the breaker is open, and the next put is dropped at once.
      pool = prefill.cache.worker.pool
      helpers.wait_for(lambda: not pool.breaker.available, 10, "the puts trip the breaker")
      # The puts still queued behind the tripping ones are dropped by the writer at once;
      # the count is read after they are, so the next put's drop is the only change.
      assert pool.settle(10), pool.queued
      s = prefill.stats()
      assert s["pool_put_timeouts"] >= 2 and s["pool_puts"] == 0, s
      pool.put([(bytes(32), None, np.zeros(pool.payload_shape, pool.dtype), False)])
      assert prefill.stats()["pool_put_dropped"] == s.get("pool_put_dropped", 0) + 1
      # Closed with put calls still inside the client: it is left open, not freed under them.
      pool.close(timeout_s=0.5)
      assert prefill.stats()["pool_close_left_open"] == 1
      # A hand-off's question to the master (here stopped: it stays inside the client) is
      # asked on a thread of its own: the next tenant's lookup is asked, not skipped. (On an
      # engine of its own: the decode node's gets may have met the stopped lender, and a
      # pool whose gets are stuck or whose breaker is open asks nothing.)
      asker = pool_engine(mesh, m, segment_mb=0, deadline_s=1.5)
      os.killpg(m.proc.pid, signal.SIGSTOP)
      try:
        keys = asker.cache.index.block_keys(prompts(16, 1)[0], "default")
        disagg.hand_off(asker.cache, prompts(16, 1)[0], "default", engine_id="e", host="h",
                        port=1, deadline_s=1.0)
        assert asker.cache.worker.pool.present(keys) == [False] * len(keys)
      finally:
        os.killpg(m.proc.pid, signal.SIGCONT)
      s = asker.stats()
      assert s.get("pool_lookup_skipped", 0) == 0 and s.get("pool_lookup_timeouts") == 1, s
      close(prefill, decode, asker)
    finally:
      os.killpg(lender.pid, signal.SIGKILL)
      lender.wait(30)


def test_a_pool_with_no_room_refuses_puts_counted_and_answers_stay_exact(mesh, tmp_path, fresh):
  with LocalMaster(log_path=str(tmp_path / "master.log")) as m:
    a = pool_engine(mesh, m, segment_mb=0)  # nobody lends: nothing fits
    ps = prompts(7, 2)
    want = fresh.generate(ps, 3)
    assert a.generate(ps, 3) == want
    assert a.cache.worker.pool.settle(30)
    s = a.stats()
    assert s["pool_puts"] == 0 and s["pool_put_refused"] >= blocks_of(2)
    b = pool_engine(mesh, m, segment_mb=0)
    assert b.generate(ps, 3) == want and b.stats()["hits"]["pool"] == 0
    close(a, b)


def test_pool_between_host_and_disk_takes_what_the_host_evicts(mesh, master, fresh, tmp_path):
  """Write-back with a small device pool and host tier: the host's victims go to the pool
  and the disk; a cache with the pool alone then hits them there."""
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=16, max_pages_per_seq=16)
  a = pool_engine(mesh, master, key=KEY, host=2, disk=str(tmp_path / "d"),
                  write_policy="write_back", cache=cc, max_seqs_per_shard=2)
  ps = [p for seed in range(8, 14) for p in prompts(seed, 2)]
  want = fresh.generate(ps, 3)
  assert a.generate(ps, 3) == want
  assert a.cache.worker.pool.settle(30)
  s = a.stats()
  assert s["pool_puts"] > 0 and s["demoted_host"] > 0 and s["disk_writes"] > 0
  b = pool_engine(mesh, master, key=KEY)
  assert b.generate(ps[:2], 3) == want[:2]
  assert b.stats()["hits"]["pool"] > 0
  close(a, b)


def test_bad_pool_settings_name_the_flag_and_the_fix():
  with pytest.raises(InputError, match=r"--pool='nohost' is not HOST:PORT"):
    check_reachable("nohost", None)
  port = free_port()
  with pytest.raises(InputError, match=rf"--pool=127.0.0.1:{port}: no Mooncake master"):
    check_reachable(f"127.0.0.1:{port}", None, timeout_s=1)
  with pytest.raises(InputError, match="--pool_metadata='ftp://x' is not"):
    check_reachable(f"127.0.0.1:{port}", "ftp://x")
  with pytest.raises(InputError, match="pool_replicas"):
    jaxkv.TierConfig(pool_master="127.0.0.1:1", pool_replicas=0)
  with pytest.raises(InputError, match="pool_master"):
    jaxkv.TierConfig(pool_master="127.0.0.1")
  assert native.lib_dir()


def test_a_full_put_queue_drops_and_counts_at_once():
  """The write-behind bound (``pool_queue_mb``), on the tier's real ``PutQueue`` with no
  writer started (nothing leaves the queue, so it stays full): puts past the bound are
  dropped at once, counted and missed (a hand-off waiting for one returns at once); those
  within it are queued."""
  from jaxkv.stats import Stats
  from jaxkv.worker.tiers.base import Breaker
  from jaxkv.worker.tiers.pool.puts import PutQueue
  stats = Stats()
  puts = PutQueue(jaxkv.TierConfig(pool_master="127.0.0.1:1", pool_queue_mb=1),
                  breaker=Breaker(), stats=stats, recent_keys=16)
  block = np.zeros(256 << 10, np.uint8)  # four fill the 1 MiB queue
  keys = [bytes([i]) * 32 for i in range(6)]
  t0 = time.monotonic()
  puts.put([(k, None, block, False) for k in keys])
  assert time.monotonic() - t0 < 1.0
  assert puts.queued == 4 and puts.queued_bytes == 1 << 20
  assert stats["pool_put_dropped"] == 2
  assert not puts.settle(0)  # queued, not tried
  t0 = time.monotonic()
  assert puts.outcomes.placed_run(keys[4:], t0 + 30, lambda rest, left: [True] * len(rest)) == 0
  assert time.monotonic() - t0 < 1.0  # a missed key ends the run: nothing is waited for


LOAD_BY_PATH = """
import ctypes, sys
for path in sys.argv[1:]:  # dependencies first: each one the fetched file, by its path
  ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
from mooncake import store
print("loaded", len(sys.argv) - 1)
"""


def test_the_native_libraries_are_fetched_without_root_and_the_client_loads(
    tmp_path, monkeypatch):
  """What a fresh machine without Debian's libibverbs1 / libnuma1 does: the libraries the
  system lacks are fetched into a private directory, and the client loads from there. The
  system's own copies are hidden from the fetch (every library counts as missing), so the
  download and unpacking run here whatever this machine has installed."""
  here = tmp_path / "native"
  monkeypatch.setenv("JAXKV_NATIVE_LIBS", str(here))
  monkeypatch.setattr(native, "_loadable", lambda name: False)
  assert native.fetch_libs(timeout_s=240) == list(native.PACKAGES)
  wanted = [lib for libs in native.PACKAGES.values() for lib in libs]
  assert sorted(p.name for p in here.glob("*.so*")) == sorted(wanted)
  for lib in wanted:  # whole ELF shared objects, not a link or a fragment
    data = (here / lib).read_bytes()
    assert data[:4] == b"\x7fELF" and len(data) > 10_000 and not (here / lib).is_symlink(), lib
  assert native.fetch_libs() == []  # all in the directory now: nothing fetched again
  # A fresh process loads exactly the fetched files, then the client on top of them.
  code, out, err = helpers.finish_process(helpers.start_process(
      [sys.executable, "-c", LOAD_BY_PATH, *(str(here / lib) for lib in wanted)]), 120,
      "loading the fetched libraries")
  assert code == 0 and out.split() == ["loaded", str(len(wanted))], err[-2000:]
  # The module's own entry point with that directory: nothing to fetch, and the client loads.
  code, out, err = helpers.finish_process(helpers.start_process(
      [sys.executable, "-m", "jaxkv.worker.tiers.pool.native"],
      env=dict(os.environ, JAXKV_NATIVE_LIBS=str(here))), 120, "the entry point")
  assert code == 0 and out.startswith("nothing to fetch"), (out, err[-2000:])
