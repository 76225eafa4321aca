"""KV groups: a hybrid-attention model's sliding-window layers in a window group of their
own (``jaxkv.manager.windows``), against the same model with every layer's pages kept for
the whole sequence (``Gemma3Config(kv_groups=False)``, the all-global layout) and against
recomputing every prompt.

The model is ``tests/hybrid_model.py``'s small random Gemma 3 (a 40-token window over
8-token pages: 5 window blocks), so that prompts of a few hundred tokens cross the window
many times.
"""

import json
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import helpers
import jaxkv
from hybrid_model import PAGE, WINDOW, assert_same, engine, prompt, run
from hybrid_model import one, recompute  # noqa: F401  (the fixtures)
from jaxkv.compiles import COMPILES
from jaxkv.manager import windows as windows_lib
from jaxkv.manager.index import Tier
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
from jaxkv.worker.checkpoint import Checkpointer
from jaxkv.worker.tiers.pool.master import LocalMaster


def test_the_window_group_holds_the_local_layers_and_answers_as_the_all_global_layout(
    recompute):
  """On 2 data shards (one kv head: no model axis), two sequences per shard, prompts of
  three to six windows get the all-global layout's tokens and logits (one device, every
  prompt computed whole); the block pools hold the 2 global layers' K/V only and the window
  pool the 4 local ones'."""
  mesh = jaxkv.make_mesh(data=2, model=1, devices=jax.devices()[:2])
  grouped, full = engine(mesh), recompute
  c = grouped.cache.config
  assert (c.num_layers, c.window_layers, c.sliding_window) == (2, 4, WINDOW)
  assert full.cache.config.num_layers == 6 and not full.cache.config.has_windows
  shards = grouped.cache.num_shards
  blocks = sum(x.nbytes for x in grouped.cache.worker.pools)
  assert blocks == c.page_bytes * c.pages_per_shard * shards
  assert c.page_bytes * 3 == full.cache.config.page_bytes
  windows = sum(x.nbytes for x in grouped.cache.worker.window_pools)
  assert windows == c.window_page_bytes * c.window_pages_per_shard * shards
  assert c.window_page_bytes == 2 * c.page_bytes  # 4 local layers to 2 global
  prompts = [prompt(i, n) for i, n in enumerate([130, 170, 200, 245])]
  tokens, logits = grouped.generate(prompts, 8, return_logits=True)
  want_tokens, want_logits = full.generate(prompts, 8, return_logits=True)
  assert tokens == want_tokens
  for got, want in zip(logits, want_logits):
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_a_later_turn_reuses_its_prefix_across_the_window_edge_exactly(one, recompute):
  """A conversation's second turn hits the first turn's blocks, prompt and answer: its local
  layers read the window before the cut from the kept blocks; the third turn, the second's.
  Every answer is the recomputed one's."""
  e = engine(one)
  history = prompt(1, 150)
  for turn in range(3):
    h = run(e, history, 10)
    assert_same(h, run(recompute, history, 10))
    if turn:
      assert h.cached_tokens > WINDOW * 3, (turn, h.cached_tokens)
    history = history + h.tokens + prompt(10 + turn, 30)
  assert e.stats()["window_blocks_kept"] > 0


def test_a_hit_needs_the_window_before_its_cut(one, recompute):
  """With the kept windows gone (what a failed step leaves) the global blocks alone are no
  hit: the prompt is recomputed, exactly. Kept again by that run, the next one hits. The
  window copy is compiled with the tier moves' warm-up (nothing compiles for it later)."""
  e = engine(one)
  e.cache.worker.warm_moves(4)
  p = prompt(2, 200)
  e.generate([p], 4)
  mark = COMPILES.mark()
  e.cache.worker.copy_windows([(0, 1, 2)])
  assert COMPILES.since(mark) == 0, COMPILES.names_since(mark)
  e.cache.manager.windows.forget()
  again = run(e, p, 4)
  assert again.cached_tokens == 0
  assert_same(again, run(recompute, p, 4))
  third = run(e, p, 4)
  assert third.cached_tokens > WINDOW
  assert_same(third, again)


def test_a_long_prompt_runs_in_a_window_pool_smaller_than_its_blocks(one, recompute):
  """A 600-token prompt (75 blocks) runs through a window pool of 24 pages: the ring
  reuses its pages as the window moves on; the answer is the recomputed one's."""
  e = engine(one, rows=1, window_pages_per_shard=24, max_pages_per_seq=80)
  assert e.cache.config.window_pages_per_shard == 24
  p = prompt(3, 600)
  assert_same(run(e, p, 6), run(recompute, p, 6))


def test_a_window_pool_too_small_for_one_ring_is_refused(one):
  with pytest.raises(jaxkv.InputError, match="window_pages_per_shard=8"):
    engine(one, window_pages_per_shard=8)


def _next_turn(e, recompute, history, seed):
  """The conversation's next turn on ``e`` (20 new tokens, 8 answered), checked against
  recompute: ``(its handle, e's stats before, after)``."""
  before = e.stats()
  turn = history + prompt(seed, 20)
  h = run(e, turn, 8)
  after = e.stats()
  assert_same(h, run(recompute, turn, 8))
  return h, before, after


@pytest.fixture(scope="module")
def master(tmp_path_factory):
  with LocalMaster(log_path=str(tmp_path_factory.mktemp("pool") / "master.log")) as m:
    yield m


@pytest.mark.parametrize("tier", ["host", "disk", "pool"])
def test_a_hit_across_the_window_edge_from_a_lower_tier_equals_recompute(
    one, recompute, tmp_path, master, tier):
  """The first turn's blocks leave the device for ``tier`` (the global layers' bytes only);
  the second turn fetches them back and reads the window before its cut from the kept
  blocks on device: its answer is the recomputed one's, and each fetched block moved
  ``page_bytes`` (the 2 global layers' K/V: a third of the all-global block)."""
  tiers = {"host": jaxkv.TierConfig(host_pages_per_shard=64),
           "disk": jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"), disk_pages=128),
           "pool": jaxkv.TierConfig(pool_master=master.address, pool_metadata=master.metadata,
                                    write_policy="write_through")}[tier]
  e = engine(one, tiers=tiers)
  first = prompt(4, 230)
  answer = e.generate([first], 8)[0]
  e.flush()
  e.cache.offload()
  e.flush()  # (the disk's records are published once written)
  for s in range(e.cache.num_shards):
    e.cache.index.evict_all_unreferenced(s, jaxkv.Tier.DEVICE)
  h, before, after = _next_turn(e, recompute, first + answer, 5)
  fetched = after["blocks_fetched"] - before["blocks_fetched"]
  assert fetched > WINDOW // PAGE and h.cached_tokens > WINDOW, (fetched, h.cached_tokens)
  assert after["hits"][tier] > before["hits"].get(tier, 0)
  if tier != "pool":  # (the pool's reads are counted by the pool, not in bytes_moved)
    assert after["bytes_moved"] - before["bytes_moved"] == fetched * e.cache.config.page_bytes
  e.cache.worker.close()


def _costs(pool_bytes_per_s: float):
  """Costs with the pool's link at ``pool_bytes_per_s`` and prefill at 1 ms a token."""
  links = {name: LinkCost(0.0, 1e10) for name in ("host_to_device", "disk_to_host")}
  return CostModel(links={**links, "pool_to_host": LinkCost(0.0, pool_bytes_per_s)},
                   prefill=PrefillCurve(0.0, 1e-3, 0.0))


@pytest.mark.parametrize("case", ["plain", "sealed", "flipped", "slow"])
def test_another_engine_hits_across_the_window_edge_from_the_pool(one, recompute, master, case):
  """A finished sequence leaves its last window in the pool beside its blocks (written
  through); a second engine, which never saw the conversation, hits its next turn past the
  window edge from the pool: its plan fetches the blocks, the window is loaded and checked
  a step before, and the answer is the recomputed one (``sealed``: names and values under a
  deployment key, and the plan deciding from costs). A window value altered in the pool
  (``flipped``, under the key) is rejected, counted, and the turn recomputes, exactly.
  Over a pool link priced so slow (``slow``: 1 kB/s) that recomputing is sooner, the
  windows are not loaded (counted) and the turn recomputes, exactly. The loads' time is
  learned into the pool's link, as a promotion's is. (Planted: no window puts -> no hit
  past the window, and the hand-off promises nothing; the pool's window answer ignored ->
  no hit past the window; the windows' price ignored -> the slow case loads them; the
  loads' report not learned -> no lesson.)"""
  key = None if case == "plain" else bytes(range(32))
  tiers = jaxkv.TierConfig(pool_master=master.address, pool_metadata=master.metadata,
                           write_policy="write_through")
  seed = {"plain": 40, "sealed": 42, "flipped": 44, "slow": 46}[case]
  a = engine(one, tiers=tiers, key=key)
  first = prompt(seed, 230)
  history = first + a.generate([first], 8)[0]
  a.flush()
  assert a.cache.worker.pool.settle(30)
  assert a.stats()["window_pool_puts"] >= WINDOW // PAGE
  cut = len(history) // PAGE  # the blocks a put, and the next turn's hit
  # A prefill node's hand-off promises a hybrid model's blocks only with the window before
  # their end placed too (a prompt of the history less its last token: one block less).
  keys = a.cache.index.block_keys(np.asarray(history, np.int32), "default")
  assert len(a.cache.placed_in_pool(keys[:cut - 1], 5.0)) == cut - 1
  if case == "flipped":  # a window in the middle of the one before the cut
    pool = a.cache.worker.window_pool
    name = pool.name(windows_lib.window_key(keys[cut - 3]))
    value = bytearray(pool.client.get(name))
    value[len(value) // 2] ^= 1
    assert pool.client.remove(name, True) == 0 and pool.client.put(name, bytes(value)) == 0
  costs = {"sealed": _costs(1e10), "slow": _costs(1e3)}.get(case)
  b = engine(one, tiers=tiers, key=key, costs=costs)
  if case == "plain":  # a window's put and load compile nothing after the moves' warm-up
    b.cache.worker.warm_moves(4)
    mark, junk = COMPILES.mark(), bytes(32)
    b.cache.worker.windows.put([(0, 1, junk)])
    assert b.cache.worker.pool.settle(30)
    failed, report = b.cache.worker.windows.load_pool([(0, 2, junk)])
    assert failed == [] and report.blocks == 1 and report.seconds > 0
    assert report.bytes == b.cache.config.window_page_bytes and report.tiers == (Tier.POOL,)
    assert COMPILES.since(mark) == 0, COMPILES.names_since(mark)
  learned = []  # the planner's lessons (from the window loads too, where they ran)
  observe = b.planner.observe_fetch
  b.planner.observe_fetch = lambda report: (learned.append(report), observe(report))[1]
  h, before, after = _next_turn(b, recompute, history, seed + 1)
  names = {windows_lib.window_key(k) for k in keys}
  window_lessons = [r for r in learned if r.fetches and {f.key for f in r.fetches} <= names]
  loaded = after["window_pool_loaded"] - before["window_pool_loaded"]
  failed = after["window_pool_failed"] - before["window_pool_failed"]
  skipped = after["window_pool_skipped"] - before["window_pool_skipped"]
  if case == "flipped":
    assert failed == 1 and h.cached_tokens < WINDOW, (failed, h.cached_tokens)
  elif case == "slow":
    assert loaded == 0 and skipped >= WINDOW // PAGE, (loaded, skipped)
    assert h.cached_tokens < WINDOW, h.cached_tokens
  else:
    assert loaded >= WINDOW // PAGE and failed == 0, (loaded, failed)
    assert h.cached_tokens == cut * PAGE and after["hits"]["pool"] > 0, h.cached_tokens
    # What the loads took is learned into the pool's link, as a promotion's is.
    assert sum(r.blocks for r in window_lessons) == loaded, window_lessons
    assert all(r.tiers == (Tier.POOL,) and r.seconds > 0 for r in window_lessons)
  for e in (a, b):
    e.cache.worker.close()


@pytest.mark.parametrize("altered", [False, True], ids=["kept", "altered"])
def test_a_window_evicted_from_the_device_comes_back_from_host_memory(one, recompute, altered):
  """With ``host_window_pages_per_shard``, kept window blocks that other prompts evict from
  a small window pool (19 pages: one ring and two windows) keep copies in host memory. A
  later turn whose blocks are in the host tier, and whose window before its cut is only in
  host memory, has that window loaded back and is placed on it a step later: a hit past
  the window edge, answered as recompute. A host copy whose bytes no longer match their
  checksum (``altered``) is dropped before anything is placed on it and the turn is
  recomputed, exactly. (Planted: loads landing in the next page -> the kept case's
  log-probabilities differ; no demotes -> no hit.)"""
  tiers = jaxkv.TierConfig(host_pages_per_shard=96, host_window_pages_per_shard=64)
  e = engine(one, tiers=tiers, rows=1, window_pages_per_shard=19)
  first = prompt(14, 230)
  answer = e.generate([first], 8)[0]
  for seed in (15, 16):  # other prompts take every page of the window pool
    e.generate([prompt(seed, 120)], 2)
  windows = e.cache.manager.windows
  keys = e.cache.index.block_keys(np.asarray(first + answer, np.int32), "default")
  assert not any(k in windows._kept[0] for k in keys)  # pylint: disable=protected-access
  assert e.stats()["window_host_stored"] > 0
  e.flush()
  e.cache.offload()
  for s in range(e.cache.num_shards):
    e.cache.index.evict_all_unreferenced(s, jaxkv.Tier.DEVICE)
  if altered:  # every host copy's recorded checksum no longer matches its bytes
    host = e.cache.worker.window_host
    host.expected_checksums(np.zeros((1, 1), np.int32))  # (settles the recorded sums)
    host._checksums ^= 1  # pylint: disable=protected-access
  h, before, after = _next_turn(e, recompute, first + answer, 17)
  loaded = after["window_host_loaded"] - before["window_host_loaded"]
  failed = after["window_host_failed"] - before["window_host_failed"]
  if altered:
    assert loaded == 0 and failed >= WINDOW // PAGE and h.cached_tokens == 0, (loaded, failed)
  else:
    assert loaded >= WINDOW // PAGE and failed == 0, (loaded, failed)
    assert h.cached_tokens >= len(first) - PAGE, h.cached_tokens
    assert after["hits"]["host"] > before["hits"].get("host", 0)
  e.cache.worker.close()


# Each process of a two-process job (launch/multihost.py), on a mesh of one data shard per
# process, in one job start:
# "host": the kept case above, four other prompts (two per shard) pushing the first turn's
#   windows into host memory;
# "pool": an engine answers a turn, its blocks and last window written to the pool; a second
#   engine of the job, which never saw it, takes the next turn from there, planning from
#   costs (what it learns from its fetches is process 0's timing on both processes).
# What each answered and counted, to compare in the test.
JOB = r"""
import json, os, sys
sys.path[:0] = ["tests", os.path.join("tests", "models")]
from jaxkv import distributed
distributed.initialize()
import jax, jaxkv, numpy as np
import test_kv_groups as t
out, master, metadata = {}, sys.argv[2], sys.argv[3]

def answer(e, turn):
  before = e.stats()
  h = t.run(e, turn, 8)
  after = e.stats()
  counted = {k: after[k] - before[k] for k in (
      "window_host_stored", "window_host_loaded", "window_host_failed",
      "window_pool_loaded", "window_pool_failed", "window_disk_loaded",
      "window_disk_failed")}
  return {"turn": turn, "tokens": h.tokens, "logprobs": [lp for lp, _ in h.logprobs],
          "cached": h.cached_tokens, "hits": after["hits"], **counted}

mesh = jaxkv.make_mesh(data=2, model=1)
e = t.engine(mesh, rows=1, window_pages_per_shard=19,
             tiers=jaxkv.TierConfig(host_pages_per_shard=96, host_window_pages_per_shard=64))
first = t.prompt(14, 230)
history = first + e.generate([first], 8)[0]
e.generate([t.prompt(seed, 120) for seed in (15, 16, 18, 19)], 2)
windows, shards = e.cache.manager.windows, e.cache.num_shards
keys = e.cache.index.block_keys(np.asarray(history, np.int32), "default")
kept = sum(k in dict(windows.kept_items(s)) for s in range(shards) for k in keys)
stored = e.stats()["window_host_stored"]
e.flush()
e.cache.offload()
for s in range(shards):
  e.cache.index.evict_all_unreferenced(s, jaxkv.Tier.DEVICE)
out["host"] = {**answer(e, history + t.prompt(17, 20)), "kept_first": kept,
               "stored": stored}
pool = jaxkv.TierConfig(pool_master=master, pool_metadata=metadata,
                        write_policy="write_through")
a = t.engine(mesh, rows=1, tiers=pool)
first = t.prompt(52, 230)
history = first + a.generate([first], 8)[0]
a.flush()
a.cache.worker.pool.settle(30)
b = t.engine(mesh, rows=1, tiers=pool, costs=t._costs(1e10))
out["pool"] = {**answer(b, history + t.prompt(53, 20)),
               "puts": a.stats()["window_pool_puts"], "costs": b.costs.to_json()}
for x in (a, b):
  x.cache.worker.close()
disk = jaxkv.TierConfig(disk_kvstore=os.path.join(sys.argv[1], "disk"), disk_pages=128,
                        write_policy="write_through")
a = t.engine(mesh, rows=1, tiers=disk)
first = t.prompt(54, 230)
history = first + a.generate([first], 8)[0]
a.flush()
puts = a.stats()["window_disk_puts"]
a.cache.worker.close()
b = t.engine(mesh, rows=1, tiers=disk)  # (restarted on the store: no checkpoint)
out["disk"] = {**answer(b, history + t.prompt(55, 20)), "puts": puts,
               "adopted": b.stats()["window_disk_adopted"]}
b.cache.worker.close()
with open(os.path.join(sys.argv[1], f"p{jax.process_index()}.json"), "w") as f:
  json.dump(out, f)
"""


def test_a_job_loads_windows_from_host_memory_and_the_pool_on_every_process(
    recompute, master, tmp_path):
  """A two-process job (one data shard each) keeps evicted windows in host memory and
  loads them back for a hit past the window edge; and one of its engines takes a turn
  another engine of the job answered, from the pool, its window included. Every process
  answers as one process recomputing the turn, and both count the same loads (their checks
  agree: each reads every host checksum; each reads its own shards' pool values and the
  job agrees on every outcome); each window is put by one process. The engine that takes
  the turn plans from costs: what it learns from the fetches it times is the same on both
  processes (process 0's timing), so their plans stay one. (Planted: the job's host loads
  land in the next page -> log-probabilities differ from recompute's; only process 0's
  share of the windows put -> no hit past the window; each process learning its own
  timing -> the costs differ.) A third pair of engines, over one disk store, the second
  opened after the first closed: each window record is written by one process, every
  process adopts them all, and the restarted engine hits past the window edge from the
  disk on both."""
  script = tmp_path / "job.py"
  script.write_text(JOB)
  proc = helpers.start_process([sys.executable, "launch/multihost.py", "--num_processes=2",
                               "--devices=2", "--", str(script), str(tmp_path),
                               master.address, master.metadata],
                              env=helpers.child_env(drop=("JAX_PLATFORMS",)))
  code, _, err = helpers.finish_process(proc, 600, "the two-process job")
  assert code == 0, err[-3000:]
  p0, p1 = (json.loads((tmp_path / f"p{i}.json").read_text()) for i in (0, 1))
  host, pool = p0["host"], p0["pool"]
  assert host["kept_first"] == 0 and host["stored"] > 0, host
  assert host["cached"] >= 230 - PAGE and host["hits"]["host"] > 0, host
  assert host["window_host_loaded"] >= WINDOW // PAGE and host["window_host_failed"] == 0
  assert pool["cached"] == 238 // PAGE * PAGE and pool["hits"]["pool"] > 0, pool
  assert pool["window_pool_loaded"] >= WINDOW // PAGE and pool["window_pool_failed"] == 0
  assert pool["puts"] + p1["pool"]["puts"] >= WINDOW // PAGE  # (each window by one of them)
  learned = json.loads(pool["costs"])["links"]["pool_to_host"]
  assert pool["costs"] == p1["pool"]["costs"] and learned["bytes_per_s"] != 1e10, learned
  disk = p0["disk"]  # each window record written by one process; every process adopts all
  assert disk["puts"] + p1["disk"]["puts"] == WINDOW // PAGE + 1, (disk, p1["disk"])
  assert disk["adopted"] == p1["disk"]["adopted"] == WINDOW // PAGE + 1, disk
  assert disk["cached"] == 238 // PAGE * PAGE and disk["hits"]["disk"] > 0, disk
  assert disk["window_disk_loaded"] >= WINDOW // PAGE and disk["window_disk_failed"] == 0
  for case in ("host", "pool", "disk"):
    for k in ("tokens", "logprobs", "cached", "window_host_loaded", "window_pool_loaded",
              "window_disk_loaded"):
      assert p0[case][k] == p1[case][k], (case, k, p0[case][k], p1[case][k])
    want = run(recompute, p0[case]["turn"], 8)
    assert p0[case]["tokens"] == want.tokens, case
    ref = np.array([lp for lp, _ in want.logprobs])
    assert np.abs(np.array(p0[case]["logprobs"]) - ref).max() < 1e-5, case


def test_a_window_block_goes_to_host_memory_from_where_its_bytes_are_and_comes_back():
  """The host copies' bookkeeping alone (no model). A kept block evicted before the copy
  out of its ring ran is demoted from that ring page (its own page holds nothing yet); one
  evicted after, from its page. Blocks of a window kept only in host memory are loaded
  back into pages of their own, kept on the device again (a sequence can then be placed
  on them), pinned until the plan is taken; host slots a load reads are not reused by the
  same plan's demotes; a failed plan forgets the host copies it ordered. (Planted: demotes
  read the evicted page -> the first assertion fails.)"""
  w = windows_lib.WindowPages(num_shards=1, pages_per_shard=19, sliding_window=WINDOW,
                              page_size=PAGE, chunk_pages=2, host_slots=18)
  keys = [bytes([i]) * 32 for i in range(40)]
  pages = [w.keep(0, keys[i], source=100 + i) for i in range(18)]  # every free page
  w.keep(0, keys[18], source=118)  # evicts keys[0], whose copy (100 -> its page) is pending
  m = w.take_moves()
  demotes, loads = m.demotes, m.loads
  assert demotes == ((0, 100, 0),) and loads == ()
  w.keep(0, keys[19], source=119)  # evicts keys[1]: its copy ran with the last plan
  assert w.take_moves()[0] == ((0, pages[1], 1),)
  assert w.cover(0, keys, 2) == 0 and w.cover(0, keys, 2, host=True) == 2
  for i in range(20, 36):  # every page kept and unreferenced: the loads must evict
    w.keep(0, keys[i], source=100 + i)
  w.take_moves()
  assert w.load(0, keys, (2,)) == 2
  m = w.take_moves()
  demotes, loads = m.demotes, m.loads
  assert [(slot, key) for _, slot, _, key in loads] == [(0, keys[0]), (1, keys[1])]
  assert len(demotes) == 2 and not {slot for _, _, slot in demotes} & {0, 1}
  assert w.cover(0, keys, 2) == 2 and w.load(0, keys, (2,)) == 0  # kept on the device again
  ring, held = w.place(0, keys, (0, 2))
  assert held == {j: page for j, (_, _, page, _) in enumerate(loads)}
  w.release(0, ring, held.values())
  assert w.available(0) == 18
  for i in range(36, 40):  # more evictions: host copies ordered, then the plan fails
    w.keep(0, keys[i], source=100 + i)
  stored = [k for k in keys[20:] if k in w._hkept[0]]  # pylint: disable=protected-access
  assert stored
  w.forget()
  assert all(k not in w._hkept[0] for k in stored)  # pylint: disable=protected-access
  assert w.cover(0, keys, 2, host=True) == 2 and w.available(0) == 18


def test_a_pinned_prefix_keeps_its_window_and_stays_a_whole_hit(one, recompute):
  """``Engine.pin`` holds the prefix's blocks and the kept window before its end: other
  prompts through a small window pool evict every other kept window, yet a request that
  extends the pinned prefix still hits all of it (exactly); unpinned, the window goes like
  the rest and the hit stops at what is still kept."""
  e = engine(one, window_pages_per_shard=40)
  shared = prompt(8, 160)  # 20 blocks
  assert e.pin(shared) == 20
  for i in range(4):  # 4 x 200 tokens: more windows than the pool keeps
    e.generate([prompt(20 + i, 200)], 2)
  assert e.stats()["window_blocks_evicted"] > 0
  extended = shared + prompt(9, 24)
  h = run(e, extended, 6)
  assert h.cached_tokens == 160, h.cached_tokens
  assert_same(h, run(recompute, extended, 6))
  e.unpin(shared)
  for i in range(4):
    e.generate([prompt(30 + i, 200)], 2)
  assert run(e, shared + prompt(10, 24), 2).cached_tokens < 160


def _alter_last_window_row(directory: str) -> None:
  """Someone with write access: a new checkpoint step whose last window row (the block
  kept most recently) holds other bits, the metadata (and its tag) unchanged."""
  manager = ocp.CheckpointManager(directory)
  step = manager.latest_step()
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
  target = {}
  for name, v in meta["arrays"].items():
    shape, dtype = tuple(v["shape"]), np.dtype(v["dtype"])
    if meta.get("sealed"):  # one row of sealed bytes per saved row
      shape, dtype = (shape[2], int(np.prod(shape)) // shape[2] * dtype.itemsize + 28), np.uint8
    target[name] = np.empty(shape, dtype)
  state = {k: np.array(v) for k, v in manager.restore(step, args=ocp.args.Composite(
      state=ocp.args.StandardRestore(target)))["state"].items()}
  row = max(i for i, r in enumerate(meta["window_rows"]) if r is not None)
  if meta.get("sealed"):
    state["window"][row] ^= 1
  else:
    state["window"][:, :, row] ^= 1
  manager.save(step + 1, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                 meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


@pytest.mark.parametrize("key", [None, bytes(range(32))], ids=["plain", "sealed"])
def test_a_restarted_engine_hits_across_the_window_edge_from_its_checkpoint(
    one, recompute, tmp_path, key):
  """A checkpoint saves the kept windows beside the global blocks (sealed under a
  deployment key); a new engine restoring it answers the conversation's next turn from
  both, across the window edge, with the recomputed answer. The most recently kept window's
  row, altered in the files, is left out (counted: a checksum, or under the key a seal,
  that fails) and the hit stops before the cut that needs it."""
  first = engine(one, key=key)
  history = prompt(6, 150)
  history += run(first, history, 10).tokens + prompt(7, 30)
  kept = first.cache.manager.windows.kept_blocks(0)
  directory = str(tmp_path / "ckpt")
  Checkpointer(first.cache, directory).save()
  first.cache.worker.close()
  _alter_last_window_row(directory)
  restarted = engine(one, key=key)
  counts = Checkpointer(restarted.cache, directory).restore()
  assert counts["step"] == 1 and counts["placed"] > 0, counts
  assert counts["failed_checksum" if key is None else "failed_mac"] == 1, counts
  assert counts["windows_kept"] == kept - 1 >= WINDOW // PAGE, (counts, kept)
  h = run(restarted, history, 10)
  assert_same(h, run(recompute, history, 10))
  # 19 blocks of the first turn are cached; the window before the last cut is not whole.
  assert WINDOW * 3 < h.cached_tokens < 19 * PAGE, h.cached_tokens
  restarted.cache.worker.close()


@pytest.mark.parametrize("case", ["into_host", "onto_device", "altered"])
def test_windows_kept_in_host_memory_survive_a_restart(one, recompute, tmp_path, case):
  """A checkpoint saves the windows kept in host memory too, each row with the checksum
  its bytes were stored with. Restored into an engine with a window host pool, they are
  kept there again and the next turn, whose window before its cut is only there, loads
  them and hits past the window edge (under a deployment key: the rows saved sealed);
  into an engine without one, they are kept on its device. Either way the answer is the
  recomputed one. Host copies whose bytes no longer match what they were stored with
  (``altered``) are left out at restore, counted, and the turn recomputes past the window
  edge, exactly. (Planted: the host windows not saved ->
  nothing kept, no hit past the window.)"""
  tiers = jaxkv.TierConfig(host_pages_per_shard=96, host_window_pages_per_shard=64)
  key = bytes(range(32)) if case == "into_host" else None  # (its rows saved sealed)
  first_engine = engine(one, tiers=tiers, rows=1, window_pages_per_shard=19, key=key)
  first = prompt(24, 230)
  history = first + first_engine.generate([first], 8)[0]
  for seed in (25, 26):  # other prompts push the first turn's windows into host memory
    first_engine.generate([prompt(seed, 120)], 2)
  windows = first_engine.cache.manager.windows
  keys = first_engine.cache.index.block_keys(np.asarray(history, np.int32), "default")
  in_host = sum(k in dict(windows.host_items(0)) for k in keys)
  assert in_host >= WINDOW // PAGE and not any(k in dict(windows.kept_items(0)) for k in keys)
  if case == "altered":  # every host copy's recorded checksum no longer matches its bytes
    host = first_engine.cache.worker.window_host
    host.expected_checksums(np.zeros((1, 1), np.int32))  # (settles the recorded sums)
    host._checksums ^= 1  # pylint: disable=protected-access
  directory = str(tmp_path / "ckpt")
  Checkpointer(first_engine.cache, directory).save()
  first_engine.cache.worker.close()
  if case == "onto_device":  # (a window pool with room for every saved window)
    restarted = engine(one, rows=1, window_pages_per_shard=64)
  else:
    restarted = engine(one, tiers=tiers, rows=1, window_pages_per_shard=19, key=key)
  counts = Checkpointer(restarted.cache, directory).restore()
  assert counts["placed"] > 0, counts
  if case == "into_host":
    assert counts["windows_kept_host"] >= in_host and counts["failed_checksum"] == 0, counts
  elif case == "onto_device":
    assert counts["windows_kept_host"] == 0 and counts["failed_checksum"] == 0, counts
    assert counts["windows_kept"] >= in_host, counts
  else:
    assert counts["windows_kept_host"] == 0 and counts["failed_checksum"] >= in_host, counts
  h, before, after = _next_turn(restarted, recompute, history, 27)
  loaded = after["window_host_loaded"] - before["window_host_loaded"]
  if case == "altered":
    assert h.cached_tokens < len(first) - WINDOW and loaded == 0, (h.cached_tokens, loaded)
  else:
    assert h.cached_tokens >= len(first) - PAGE, h.cached_tokens
    assert (loaded >= WINDOW // PAGE) if case == "into_host" else loaded == 0, loaded
  restarted.cache.worker.close()


def test_window_blocks_and_rings_are_accounted_exactly():
  """The window pages' bookkeeping on its own: a ring and pins are taken and given back; a
  kept block is evicted least recently used first and never while pinned; ``cover`` finds
  the longest cut whose window is kept; the table sends every written block to the ring."""
  w = windows_lib.WindowPages(num_shards=1, pages_per_shard=12, sliding_window=16,
                              page_size=8, chunk_pages=1)
  assert (w.window, w.ring) == (2, 4)
  keys = [bytes([i]) for i in range(6)]
  ring, held = w.place(0, keys, (0, 0))
  assert len(set(ring)) == 4 and 0 not in ring and held == {}
  kept = [w.keep(0, keys[j]) for j in range(4)]
  assert None not in kept and len(set(kept) | set(ring)) == 8
  assert w.keep(0, keys[1]) is None  # kept already: touched
  assert w.cover(0, keys, 6) == 4 and w.cover(0, keys[:1] + [b"x"] + keys[2:], 4) == 4
  assert w.cover(0, [keys[0], b"x", keys[2], b"y"], 4) == 1
  w.release(0, ring, ())
  ring2, held2 = w.place(0, keys, (2, 4))  # pins the windows before blocks 2 and 4
  assert held2 == {0: kept[0], 1: kept[1], 2: kept[2], 3: kept[3]}
  assert w.available(0) == 11 - 4 - 4  # page 0 never; the ring and 4 pinned taken
  assert windows_lib.table_row(ring2, held2.items(), 8, (2, 3), 4) == (
      kept[0], kept[1], ring2[2], kept[3], ring2[0], ring2[1], ring2[2], ring2[3])
  other = w.place(0, keys, (0, 0))  # 3 free pages: a ring of 4 does not fit, nothing kept
  assert other is None and w.kept_blocks(0) == 4  # (pinned: none could be evicted)
  w.release(0, ring2, held2.values())
  ring3, _ = w.place(0, keys, (0, 0))  # 3 pages left free
  new = [w.keep(0, bytes([100 + i])) for i in range(4)]  # the 4th evicts block 0
  assert None not in new and w.kept_blocks(0) == 7
  assert w.cover(0, keys, 1) == 0 and w.cover(0, keys[1:], 3) == 3
  # Forgotten (a failed step) while a sequence pins kept pages: each is free once unpinned.
  ring4, held4 = w.place(0, keys, (0, 3))  # pins 2 kept ones, evicts 4 others for its ring
  assert ring4 is not None and len(held4) == 2  # (the window: blocks 1 and 2)
  w.forget()
  assert w.kept_blocks(0) == 0 and w.cover(0, keys, 3) == 0
  w.release(0, ring3, ())
  w.release(0, ring4, held4.values())
  assert w.available(0) == 11  # every page but page 0 again


def test_a_prompt_longer_than_the_device_pool_streams_its_global_layers_only(one, recompute):
  """A 200-token prompt (25 blocks) on a device pool of 12 pages a shard: streamed
  (``StreamConfig``), its global layers' cold pages through host memory and its local
  layers in a ring of the window pool (their queries see nothing older). The answer and
  its log-probabilities are the recomputed all-global layout's; every device page, host slot
  and ring page is given back; the same request again compiles nothing and reads its
  log-probabilities from the streamed logits. The window of the short prompt answered just
  before it is kept all the same (the streamed plan carries out the copy of its last
  block's window): its next turn hits across the window edge, exactly. (Planted: the
  streamed plan dropping its window copies -> that turn's log-probabilities differ.)"""
  e = engine(one, tiers=jaxkv.TierConfig(host_pages_per_shard=64), pages_per_shard=12,
             max_pages_per_seq=12,
             stream=jaxkv.StreamConfig(sink_pages=1, window_pages=4, chunk_pages=3))
  windows = e.cache.manager.windows
  free = windows.available(0)
  p, short = prompt(4, 200), prompt(8, 60)
  want = run(recompute, p, 6)
  first = e.submit(short, jaxkv.SamplingParams(max_new_tokens=5))  # (64 tokens: 8 blocks)
  streamed = e.submit(p, jaxkv.SamplingParams(max_new_tokens=6, logprobs=1))
  short += first.result()
  streamed.result()  # (planned as the short one ended: its plan took that one's window copies)
  assert_same(streamed, want)
  turn = run(e, short + prompt(9, 12), 4)
  assert_same(turn, run(recompute, short + prompt(9, 12), 4))
  assert turn.cached_tokens > WINDOW, turn.cached_tokens
  s = e.stats()
  assert s["streamed_requests"] == 1 and s["streamed_pages"] > 25 - 12
  assert windows.available(0) == free and not windows._refs[0]  # pylint: disable=protected-access
  e.cache.index.check_invariants()
  assert not e.cache.index.held_slots(0, Tier.DEVICE)
  assert not e.cache.index.held_slots(0, Tier.HOST)
  before = dict(e.trace_counts)
  assert_same(run(e, p, 6), want)
  assert dict(e.trace_counts) == before and e.stats()["streamed_requests"] == 2
