"""The window group's copies below the device: its moves to and from host memory, the disk
and the pool.

A model with a window group (``jaxkv.manager.windows``) keeps its local layers' K/V in a
device pool of its own, whose blocks the manager also keeps in host memory (a ``HostTier``
of the window layers, ``TierConfig.host_window_pages_per_shard``) and, for each finished
sequence's last window, in the pool (the pool tier ``reshaped`` to the window layers'
values, under the names ``windows.window_key`` gives) and on the disk (records of the
window layers in a store's prefix of their own: the disk tier's ``scratch`` under
``window_key`` of the fingerprint; written behind, their bytes in flight bounded by
``TierConfig.disk_queue_mb``: more are dropped, counted). ``WindowTiers`` carries out a plan's
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
    self._writing: dict = {}  # key -> (its record's write, bytes): disk writes in flight

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
    ``(shard, key, tier)`` of every block whose bytes differ from those it was stored with (its
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
    failed = [(f.shard, f.key, Tier.HOST) for f, why in zip(fetches, outcome.failures)
              if why is not None]
    self._count("window_host", len(items), len(failed))
    return failed

  def put(self, items, disk_items=()) -> None:
    """A plan's ``window_puts`` and ``window_disk_puts`` (``(shard, device page, key)``,
    before its window copies write any page): the pages read out (once, for both) and given
    to the pool's put queue under the blocks' window names (written behind, like every
    put: dropped, counted, when the queue is full; those put lately are skipped), and
    written as the disk's window records (behind too: dropped, counted, past the bytes in
    flight ``disk_queue_mb`` allows). In a job each is put by one process."""
    w = self.worker
    items = list(items) if w.window_pool is not None else []
    disk_items = list(disk_items) if w.window_disk is not None else []
    if not items and not disk_items:
      return
    # (a block going to both is read out once)
    ids, per = buckets.shard_ids(list(dict.fromkeys(items + disk_items)), w.num_shards, 0,
                                 lambda b: b[1])
    bits = to_host(pages_lib.gather_stacked(w.window_pools, w.put_rows(ids), mesh=w.mesh,
                                            config=w.config))
    n = ids.shape[1]
    at = {(shard, page): s * n + i for s, its in enumerate(per)
          for i, (shard, page, _) in enumerate(its)}

    def payload(shard, page):
      return np.ascontiguousarray(bits[:, :, at[shard, page]]).view(w.config.jnp_dtype)

    processes, me = jax.process_count(), jax.process_index()
    names, puts = [], []
    for shard, page, key in items:
      name = window_key(key)
      if w.window_pool.recently_put(name):
        continue
      names.append(name)
      if int.from_bytes(name[:4], "little") % processes == me:  # (one process puts each)
        puts.append((name, None, payload(shard, page), w.pool.pin_all))
    if names:
      w.window_pool.note(sorted(names))  # every process notes every name, in one order
    if puts:
      w.window_pool.put(puts)
      self.stats.add("window_pool_puts", len(puts))
    for shard, page, key in disk_items:
      if _writer(key, processes) == me:
        self._write(key, payload(shard, page))

  def _write(self, key: bytes, payload: np.ndarray) -> None:
    """Starts writing ``key``'s window record unless the writes in flight are at their
    bound (then it is dropped and counted; one is let through when none is in flight)."""
    w = self.worker
    self._settle_writes()
    size = w.window_disk.record_bytes
    if self._writing and (sum(b for _, b in self._writing.values()) + size
                          > w.tiers.disk_queue_mb << 20):
      self.stats.add("window_disk_dropped")
      return
    self._writing[key] = (w.window_disk.write(key, payload, None), size)
    self.stats.add("window_disk_puts")

  def _settle_writes(self, keys=None, t_end: float = 0.0) -> None:
    """Forgets the window records' writes that finished (with ``keys``, waits for theirs
    first, up to ``t_end``, monotonic); a failed one is counted."""
    for key in list(keys or ()):
      if key in self._writing:
        try:
          self._writing[key][0].result(timeout=max(0.0, t_end - time.monotonic()))
        except Exception:  # pylint: disable=broad-except  (counted below, or still on its way)
          pass
    for key, (future, _) in list(self._writing.items()):
      if future.done():
        del self._writing[key]
        try:
          future.result()
        except Exception:  # pylint: disable=broad-except  (the load of it fails, and forgets it)
          self.stats.add("window_disk_write_failed")

  def flush(self, t_end: float) -> int:
    """Waits (up to ``t_end``, monotonic) for the window records' writes in flight; returns
    how many had not finished."""
    self._settle_writes(list(self._writing), t_end)
    return len(self._writing)

  def delete_disk(self, keys) -> None:
    """A plan's ``window_disk_deletes``: records evicted past the disk's quota (in a job,
    each by the process that writes it)."""
    w = self.worker
    if w.window_disk is None:
      return
    processes, me = jax.process_count(), jax.process_index()
    for key in keys:
      if _writer(key, processes) == me:
        w.window_disk.delete(key)

  def load_disk(self, items) -> tuple[list, FetchReport | None]:
    """Reads a plan's ``window_disk_loads`` (``(shard, device page, key)``) from the disk's
    window records, as ``load_pool`` reads the pool's (a write of one still in flight is
    waited for first, within the read deadline); a record that failed is deleted."""
    w = self.worker
    if not items or w.window_disk is None:
      return [(shard, key, Tier.DISK) for shard, _, key in items], None
    t_end = time.monotonic() + w.tiers.read_deadline_s
    self._settle_writes([key for _, _, key in items], t_end)
    failed, report = self._load(w.window_disk, Tier.DISK, "window_disk", items,
                                lambda key: key, t_end)
    processes, me = jax.process_count(), jax.process_index()
    for _, key, _ in failed:
      if _writer(key, processes) == me:
        w.window_disk.delete(key)
    return failed, report

  def load_pool(self, items) -> tuple[list, FetchReport | None]:
    """Reads a plan's ``window_pool_loads`` (``(shard, device page, key)``) from the pool
    (one get, waited for up to the read deadline; in a job each process reads its own
    shards' and the job agrees on every outcome), each value checked as the pool checks its
    blocks' (opened under the deployment key, or its CRC), into its page of the window
    group. Returns ``(failed, report)``: ``(shard, key, tier)`` of every block that failed
    or did not come (its page holds nothing of use: the manager drops it), and the loads as
    a fetch from the pool, timed from the get to the bytes on the device (what the planner
    learns the pool's link from, as from a promotion's); None: nothing read."""
    w = self.worker
    if not items or w.window_pool is None:
      return [(shard, key, Tier.POOL) for shard, _, key in items], None
    return self._load(w.window_pool, Tier.POOL, "window_pool", items, window_key,
                      time.monotonic() + w.tiers.read_deadline_s)

  def load_remote(self, items) -> tuple[list, FetchReport | None]:
    """Reads a plan's ``window_remote_loads`` (``(shard, device page, key, peer)``) from
    the peers' block servers (``FetchBlocks.group`` 1: each answer checked as a remote
    fetch's blocks are, sealed or tagged under the deployment key, or its CRC), as
    ``load_pool`` reads the pool's."""
    w = self.worker
    if not items or w.window_remote is None:
      return [(shard, key, Tier.REMOTE) for shard, _, key, _ in items], None
    return self._load(w.window_remote, Tier.REMOTE, "window_remote", items, lambda key: key,
                      time.monotonic() + w.tiers.read_deadline_s)

  def _load(self, source, tier: Tier, what: str, items, name_of, t_end: float
            ) -> tuple[list, FetchReport]:
    """``items`` (``(shard, page, key)``, or with a peer: ``(shard, page, key, peer)``)
    read from ``source`` (under ``name_of(key)``) into their pages, timed."""
    w = self.worker
    fetches = tuple(Fetch(0, i, item[0], tier, item[3] if len(item) > 3 else None,
                          name_of(item[2]), item[1]) for i, item in enumerate(items))
    t_start = time.perf_counter()
    landing, failures = w.mover.read(
        source, list(fetches), t_end, payload_shape=source.payload_shape,
        drop=w.config.window_pages_per_shard)
    seconds = 0.0
    if landing is not None:
      jax.block_until_ready(landing.stack)  # (the bytes on the device: the link's time)
      seconds = time.perf_counter() - t_start
      w.land_windows(landing)
    failed = [(item[0], item[2], tier) for item, why in zip(items, failures)
              if why is not None]
    self._count(what, len(items), len(failed))
    ok = len(items) - len(failed)
    return failed, FetchReport(fetches=fetches, failures=tuple(failures), blocks=ok,
                               bytes=ok * w.config.window_page_bytes, seconds=seconds,
                               tiers=(int(tier),))

  def warm(self, max_pages: int) -> None:
    """Compiles every bucket of these moves (all padding: no page is read into or written
    over): a put's read-out and a pool load's landing up to the window pool's pages per
    shard; the host copies' moves up to ``max_pages``."""
    w = self.worker
    pad_page = w.config.window_pages_per_shard
    if (w.window_pool is not None or w.window_disk is not None
        or w.window_remote is not None):
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


def _writer(key: bytes, processes: int) -> int:
  """The process of a job that writes (and deletes) ``key``'s window record."""
  return int.from_bytes(key[:4], "little") % processes
