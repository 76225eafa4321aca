"""The window group's copies below the device: its moves to and from host memory and the pool.

A model with a window group (``jaxkv.manager.windows``) keeps its local layers' K/V in a
device pool of its own, whose blocks the manager also keeps in host memory (a ``HostTier``
of the window layers, ``TierConfig.host_window_pages_per_shard``) and, for each finished
sequence's last window, in the pool (the pool tier ``reshaped`` to the window layers'
values, under the names ``windows.window_key`` gives). ``WindowTiers`` carries out a plan's
moves of them, every slot and page chosen by the manager: it reads the window pools and
writes them only through its ``CacheWorker``'s verbs (``land_windows``), and reports what
failed its check for the manager to drop.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from jaxkv import buckets
from jaxkv.distributed import to_host
from jaxkv.manager.index import Tier
from jaxkv.manager.windows import window_key
from jaxkv.worker import pages as pages_lib
from jaxkv.worker.tiers.base import Fetch, FetchReport, Landing


class WindowTiers:
  """The window group's host copies and pool values, for one ``CacheWorker`` (which holds
  them: ``window_host``, ``window_pool``)."""

  def __init__(self, worker, stats):
    self.worker, self.stats = worker, stats

  def demote(self, items) -> None:
    """Copies window-group pages into the window host pool (a plan's ``window_demotes``:
    ``(shard, device page, host slot)``), each with the checksum of its bytes: dispatched,
    ordered before anything later writes the pages."""
    if items:
      w = self.worker
      w.window_host.store_pages(w.window_pools, list(items))

  def load_host(self, items) -> list:
    """Loads window host slots into window-group pages (a plan's ``window_loads``: ``(shard,
    host slot, device page, key)``) and waits for the checksums of what arrived; returns
    ``(shard, key)`` of every block whose bytes differ from those it was stored with (its
    page holds them, unused: the manager drops it)."""
    if not items:
      return []
    w = self.worker
    fetches = [Fetch(0, i, shard, Tier.HOST, slot, key, page)
               for i, (shard, slot, page, key) in enumerate(items)]
    landings, pending = w.window_host.start_fetch(fetches,
                                                  drop=w.config.window_pages_per_shard)
    for landing in landings:
      w.land_windows(landing)
    outcome = w.window_host.finish_fetch(pending, 0.0)
    failed = [(f.shard, f.key) for f, why in zip(fetches, outcome.failures) if why is not None]
    self._count("window_host", len(items), len(failed))
    return failed

  def put(self, items) -> None:
    """A plan's ``window_puts`` (``(shard, device page, key)``, before its window copies
    write any page): the pages read out and given to the pool's put queue under the blocks'
    window names (written behind, like every put: dropped, counted, when the queue is
    full); those put lately are skipped. In a job each is put by one process."""
    w = self.worker
    if not items or w.window_pool is None:
      return
    ids, per = buckets.shard_ids(list(items), w.num_shards, 0, lambda b: b[1])
    bits = to_host(pages_lib.gather_stacked(w.window_pools, w.put_rows(ids), mesh=w.mesh,
                                            config=w.config))
    n, names, puts = ids.shape[1], [], []
    processes, me = jax.process_count(), jax.process_index()
    for s, its in enumerate(per):
      for i, (_, _, key) in enumerate(its):
        name = window_key(key)
        if w.window_pool.recently_put(name):
          continue
        names.append(name)
        if int.from_bytes(name[:4], "little") % processes == me:  # (one process puts each)
          payload = np.ascontiguousarray(bits[:, :, s * n + i]).view(w.config.jnp_dtype)
          puts.append((name, None, payload, w.pool.pin_all))
    if names:
      w.window_pool.note(sorted(names))  # every process notes every name, in one order
    if puts:
      w.window_pool.put(puts)
      self.stats.add("window_pool_puts", len(puts))

  def load_pool(self, items) -> tuple[list, FetchReport | None]:
    """Reads a plan's ``window_pool_loads`` (``(shard, device page, key)``) from the pool
    (one get, waited for up to the read deadline; in a job each process reads its own
    shards' and the job agrees on every outcome), each value checked as the pool checks its
    blocks' (opened under the deployment key, or its CRC), into its page of the window
    group. Returns ``(failed, report)``: ``(shard, key)`` of every block that failed or did
    not come (its page holds nothing of use: the manager drops it), and the loads as a
    fetch from the pool, timed from the get to the bytes on the device (what the planner
    learns the pool's link from, as from a promotion's); None: nothing read."""
    if not items:
      return [], None
    w = self.worker
    if w.window_pool is None:
      return [(shard, key) for shard, _, key in items], None
    fetches = tuple(Fetch(0, i, shard, Tier.POOL, None, window_key(key), page)
                    for i, (shard, page, key) in enumerate(items))
    t_start = time.perf_counter()
    landing, failures = w.mover.read(
        w.window_pool, list(fetches), time.monotonic() + w.tiers.read_deadline_s,
        payload_shape=w.window_pool.payload_shape, drop=w.config.window_pages_per_shard)
    seconds = 0.0
    if landing is not None:
      jax.block_until_ready(landing.stack)  # (the bytes on the device: the link's time)
      seconds = time.perf_counter() - t_start
      w.land_windows(landing)
    failed = [(shard, key) for (shard, _, key), why in zip(items, failures) if why is not None]
    self._count("window_pool", len(items), len(failed))
    ok = len(items) - len(failed)
    return failed, FetchReport(fetches=fetches, failures=tuple(failures), blocks=ok,
                               bytes=ok * w.config.window_page_bytes, seconds=seconds,
                               tiers=(int(Tier.POOL),))

  def warm(self, max_pages: int) -> None:
    """Compiles every bucket of these moves (all padding: no page is read into or written
    over): a put's read-out and a pool load's landing up to the window pool's pages per
    shard; the host copies' moves up to ``max_pages``."""
    w = self.worker
    pad_page = w.config.window_pages_per_shard
    if w.window_pool is not None:
      n = buckets.MIN_TRANSFER_PAGES
      while True:
        stack = pages_lib.gather_stacked(w.window_pools,
                                         w.put_rows(np.zeros((w.num_shards, n), np.int32)),
                                         mesh=w.mesh, config=w.config)
        to_host(stack)
        w.land_windows(Landing(np.full((w.num_shards, n), pad_page, np.int32), stack))
        if n >= pad_page:
          break
        n *= 2
    if w.window_host is not None:
      for size in w.window_host.warm(w.window_pools, max_pages):
        blocks, _ = w.window_host.load_blocks(np.zeros((w.num_shards, size), np.int32))
        w.land_windows(Landing(np.full((w.num_shards, size), pad_page, np.int32), blocks,
                               blocks=True))

  def _count(self, what: str, n: int, failed: int) -> None:
    self.stats.add(f"{what}_loaded", n - failed)
    if failed:
      self.stats.add(f"{what}_failed", failed)
