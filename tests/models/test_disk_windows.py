"""A hybrid model's windows on the disk: each finished sequence's last window written as
records of the window layers beside the disk's blocks, so that an engine restarted on the
same store (no checkpoint) hits its next turn past the window edge from the disk, as
recompute answers (``jaxkv.manager.windows``, ``DiskWindows``).

The model is ``tests/hybrid_model.py``'s small random Gemma 3 (a 40-token window over
8-token pages: 5 window blocks).
"""

import os

import numpy as np
import pytest

import jaxkv
from hybrid_model import (PAGE, WINDOW, assert_same, costs, engine, prompt, run,
                          window_loads)
from hybrid_model import one, recompute  # noqa: F401  (the fixtures)
from jaxkv.manager import windows as windows_lib
from jaxkv.manager.index import Tier


def _records(directory) -> list[str]:
  """The window records under a disk store's root (their prefix: ``window_key`` of the
  cache's fingerprint), by path."""
  found = []
  for root, _, files in os.walk(directory):
    found += [os.path.join(root, f) for f in files]
  return found


def _window_records(e, directory) -> list[str]:
  prefix = e.cache.worker.window_disk.prefix_path
  return [p for p in _records(directory) if p.startswith(prefix)]


@pytest.mark.parametrize("case", ["plain", "sealed", "altered", "slow", "quota", "off"])
def test_a_restarted_engine_hits_across_the_window_edge_from_the_disk(one, recompute, tmp_path,
                                                                     case):
  """Engine A answers a 230-token prompt over a disk store and stops; engine B opens the
  same store (no checkpoint) and takes the next turn. A's last window went to the disk as
  records of the window layers (``window_disk_puts``); B adopts them at open, loads the
  window before its cut from them (checked) a step before it is placed, fetches the
  blocks, and hits past the window edge with the recomputed answer (``sealed``: records
  encrypted under a deployment key, the plan deciding from costs; the loads' time learned
  into the disk's link). A record altered on the disk (``altered``) fails its check, is
  counted, forgotten and deleted, and the turn recomputes past the window edge, exactly.
  Over a disk link priced so slow that recomputing is sooner (``slow``) the windows are
  not loaded (counted). With room for fewer records than a window (``quota``) the least
  recently used are deleted, the store holds that many, and no hit reaches past the edge.
  ``store_windows=False`` (``off``) writes none. (Planted: records not adopted at open ->
  no hit past the window; the price ignored -> the slow case loads; the quota not kept ->
  six records.)"""
  directory = tmp_path / "disk"
  key = bytes(range(32)) if case == "sealed" else None
  tiers = jaxkv.TierConfig(disk_kvstore=str(directory), disk_pages=128,
                           write_policy="write_through", encryption="auto",
                           store_windows=case != "off",
                           disk_window_pages=4 if case == "quota" else 0)
  a = engine(one, tiers=tiers, key=key)
  first = prompt({"plain": 70, "sealed": 72, "altered": 74, "slow": 76, "quota": 78,
                  "off": 80}[case], 230)
  history = first + a.generate([first], 8)[0]
  assert a.flush() == 0
  cut = len(history) // PAGE  # the blocks published, and the next turn's hit
  keys = a.cache.index.block_keys(np.asarray(history, np.int32), "default")
  stats = a.stats()
  if case == "off":
    assert a.cache.worker.window_disk is None and stats["window_disk_puts"] == 0
    assert a.cache.manager.windows.records.quota == 0
  else:
    # (past the quota, the oldest of one plan's writes are never written)
    want = 4 if case == "quota" else WINDOW // PAGE + 1
    assert stats["window_disk_puts"] == want, stats["window_disk_puts"]
    records = _window_records(a, directory)
    assert len(records) == want and a.cache.manager.windows.records.kept.keys() <= set(keys), (
        records)
  a.cache.worker.close()

  priced = {"sealed": costs("disk_to_host", 1e10), "slow": costs("disk_to_host", 1e3)}.get(case)
  b = engine(one, tiers=tiers, key=key, costs=priced)
  adopted = b.stats()["window_disk_adopted"]
  assert b.cache.disk_recovered["adopted"] >= cut
  assert adopted == {"quota": 4, "off": 0}.get(case, WINDOW // PAGE + 1), adopted
  if case == "altered":  # after B opened: a record in the middle of the window before the cut
    path = os.path.join(b.cache.worker.window_disk.prefix_path, keys[cut - 3].hex())
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 1
    open(path, "wb").write(bytes(data))
  learned = []  # the planner's lessons (from the window loads too, where they ran)
  observe = b.planner.observe_fetch
  b.planner.observe_fetch = lambda report: (learned.append(report), observe(report))[1]
  before = b.stats()
  turn = history + prompt(81, 20)
  h = run(b, turn, 8)
  after = b.stats()
  assert_same(h, run(recompute, turn, 8))
  loaded, failed, skipped = window_loads(before, after, "disk")
  if case in ("plain", "sealed"):
    assert loaded == WINDOW // PAGE and failed == 0, (loaded, failed)
    assert h.cached_tokens == cut * PAGE and after["hits"]["disk"] > 0, h.cached_tokens
    lessons = [r for r in learned if r.tiers == (Tier.DISK,) and r.fetches
               and {f.key for f in r.fetches} <= set(keys)]
    window_lessons = [r for r in lessons if r.bytes == r.blocks * b.cache.config.window_page_bytes]
    assert sum(r.blocks for r in window_lessons) == loaded and all(
        r.seconds > 0 for r in window_lessons), window_lessons
  elif case == "altered":
    assert failed == 1 and h.cached_tokens < len(first) - WINDOW, (failed, h.cached_tokens)
    assert keys[cut - 3] not in b.cache.manager.windows.records.kept
    b.cache.worker.window_disk.settle()
    assert not os.path.exists(os.path.join(b.cache.worker.window_disk.prefix_path,
                                           keys[cut - 3].hex()))
  elif case == "slow":
    assert loaded == 0 and skipped >= WINDOW // PAGE, (loaded, skipped)
    assert h.cached_tokens < len(first) - WINDOW, h.cached_tokens
  else:  # quota, off: no window on the disk before the cut
    assert loaded == 0 and h.cached_tokens < len(first) - WINDOW, (loaded, h.cached_tokens)
  b.cache.worker.close()


def test_the_disks_window_records_are_accounted_exactly():
  """The disk's window records on their own (``DiskWindows``, through ``WindowPages``): a
  finished sequence's window is ordered written once per key, whatever the shard; past the
  quota the least recently used are deleted, never one a load of the plan being built
  reads; a cut is covered by them only when asked to (``disk``), and a load takes a block
  from host memory before the disk; a failed load forgets its record."""
  w = windows_lib.WindowPages(num_shards=2, pages_per_shard=20, sliding_window=16,
                              page_size=8, chunk_pages=1, host_slots=4, disk_records=3)
  keys = [bytes([i]) * 32 for i in range(8)]
  pages = {i: w.keep(0, keys[i], source=50 + i) for i in range(4)}
  w.keep(1, keys[1])
  assert w.put(0, keys, 4, spare=1) == 3 and w.put(1, keys, 2) == 1  # blocks 1..3; 1 again
  m = w.take_moves()
  assert [(s, k) for s, _, k in m.disk_puts] == [(0, keys[1]), (0, keys[2]), (0, keys[3])]
  assert [p for _, p, _ in m.disk_puts] == [51, 52, 53] and m.disk_deletes == ()
  assert list(w.records.kept) == [keys[2], keys[3], keys[1]]  # (1, touched by shard 1's put)
  assert w.cover(1, keys, 4) == 0 and w.cover(1, keys, 4, disk=True) == 4  # [2, 4) on disk
  assert w.records.keep(keys[0]) is False  # (full: an adoption takes no room)
  assert w.load(1, keys, (4,)) == 0  # not from the disk unless asked
  assert w.load(1, keys, (4,), disk=True) == 2  # blocks 2, 3
  m = w.take_moves()
  assert [(s, k) for s, _, k in m.disk_loads] == [(1, keys[2]), (1, keys[3])]
  assert list(w.records.kept) == [keys[1], keys[2], keys[3]]  # (loads touch their records)
  w.keep(0, keys[4], source=54)
  w.keep(0, keys[5], source=55)
  assert w.load(1, keys, (6,), disk=True) == 0  # 4, 5 are on shard 0's device only
  assert w.put(0, keys, 6) == 2  # blocks 4, 5 written: 1 and 2 deleted (least recent)
  m = w.take_moves()
  assert m.disk_deletes == (keys[1], keys[2]) and list(w.records.kept) == [keys[3], keys[4], keys[5]]
  w.drop_loaded(1, keys[3])  # (its bytes failed on the device: the record stays)
  assert keys[3] in w.records.kept
  # Records a load of this plan reads are not deleted for a write of the same plan.
  assert w.load(1, keys, (5,), disk=True) == 2  # blocks 3, 4
  w.keep(0, keys[6], source=56)
  w.put(0, keys, 7)  # block 5 touched, 6 written: 5 deleted, not 3 or 4
  m = w.take_moves()
  assert m.disk_deletes == (keys[5],) and m.disk_puts == ((0, 56, keys[6]),)
  assert [k for _, _, k in m.disk_loads] == [keys[3], keys[4]]
  w.drop_loaded(1, keys[4], disk=True)  # (read from the disk and failed: forgotten)
  assert keys[4] not in w.records.kept and keys[3] in w.records.kept
  assert pages
