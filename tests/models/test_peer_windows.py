"""A hybrid model's windows from a remote peer: another engine's block server answers a
lookup with the blocks it holds and which of the last two windows' blocks it keeps the
window KV of (``Have.windows``), and a fetch of the window group's KV (``FetchBlocks``
group 1), so that an engine that never saw the conversation hits its next turn past the
window edge from the peer, as recompute answers.

The model is ``tests/hybrid_model.py``'s small random Gemma 3 (a 40-token window over
8-token pages: 5 window blocks).
"""

import numpy as np
import pytest

import helpers
import jaxkv
from hybrid_model import (PAGE, WINDOW, assert_same, costs, engine, prompt, run,
                          window_loads)
from hybrid_model import one, recompute  # noqa: F401  (the fixtures)
from jaxkv.compiles import COMPILES
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.remote import BlockServer, RemoteClient


@pytest.mark.parametrize("case", ["plain", "sealed", "gone", "slow"])
def test_another_engine_hits_across_the_window_edge_from_a_peer(one, recompute, case):
  """Engine A answers a 230-token prompt and serves its cache (``BlockServer``); engine B,
  which never saw the conversation, takes the next turn with A as its peer: the lookup
  finds the blocks and the window before the cut, B loads that window from A (checked) a
  step before it is placed, fetches the blocks, and hits the whole history past the window
  edge with the recomputed answer (``sealed``: under a deployment key, encrypted, the plan
  deciding from costs; the loads' time learned into the peers' link). With A's windows
  gone (``gone``) the lookup says so and B recomputes past the window edge, exactly. Over a
  link priced so slow that recomputing is sooner (``slow``) the windows are not loaded
  (counted). (Planted: the server's window answer left empty -> no hit past the window;
  window fetches answered with the blocks' arrays -> refused as the wrong shape.)"""
  key = bytes(range(32)) if case == "sealed" else None
  a = engine(one, key=key)
  first = prompt({"plain": 90, "sealed": 92, "gone": 94, "slow": 96}[case], 230)
  history = first + a.generate([first], 8)[0]
  cut = len(history) // PAGE
  keys = a.cache.index.block_keys(np.asarray(history, np.int32), "default")
  if case == "gone":
    a.cache.manager.windows.forget()  # (between steps: nothing of A's reads them)
  server = BlockServer(a.cache)
  server.warm()
  with helpers.serving_blocks(server):
    # The peer's answer, as the wire carries it: the prefix held, and the window blocks.
    client = RemoteClient(server.address, a.cache.config.fingerprint(), secret=key,
                          encrypt=key is not None)
    held, windows = client.lookup_windows(keys)
    assert held == cut, held
    want = () if case == "gone" else tuple(range(cut - 2 * WINDOW // PAGE, cut))
    assert windows == want, windows
    priced = {"sealed": costs("remote_to_host", 1e10),
              "slow": costs("remote_to_host", 1e3)}.get(case)
    b = engine(one, tiers=jaxkv.TierConfig(remote_peers=(server.address,)), key=key,
               costs=priced)
    if case == "plain":  # a window fetch's landing compiles nothing after the moves' warm-up
      b.cache.worker.warm_moves(4)
      mark = COMPILES.mark()
      failed, report = b.cache.worker.windows.load_remote([(0, 2, keys[cut - 1], 0)])
      assert failed == [] and report.blocks == 1 and report.tiers == (Tier.REMOTE,)
      assert report.bytes == b.cache.config.window_page_bytes and report.seconds > 0
      assert COMPILES.since(mark) == 0, COMPILES.names_since(mark)
    learned = []
    observe = b.planner.observe_fetch
    b.planner.observe_fetch = lambda report: (learned.append(report), observe(report))[1]
    before = b.stats()
    turn = history + prompt(97, 20)
    h = run(b, turn, 8)
    after = b.stats()
  server.close()
  assert_same(h, run(recompute, turn, 8))
  loaded, failed, skipped = window_loads(before, after, "remote")
  if case in ("plain", "sealed"):
    assert loaded == WINDOW // PAGE and failed == 0, (loaded, failed)
    assert h.cached_tokens == cut * PAGE and after["hits"]["remote"] > 0, h.cached_tokens
    window_lessons = [r for r in learned if r.tiers == (Tier.REMOTE,)
                      and r.bytes == r.blocks * b.cache.config.window_page_bytes]
    assert sum(r.blocks for r in window_lessons) == loaded, learned
  elif case == "slow":
    assert loaded == 0 and skipped >= WINDOW // PAGE, (loaded, skipped)
    assert h.cached_tokens < len(first) - WINDOW, h.cached_tokens
  else:
    assert loaded == 0 and h.cached_tokens < len(first) - WINDOW, (loaded, h.cached_tokens)
  b.cache.worker.close()
