"""Measures the costs the planner decides with, on this machine, model and config.

- ``host_to_device``: ``HostTier.load`` + the device scatter for two batch sizes; latency
  and bandwidth from the line through both points.
- ``disk_to_host``: verified reads of freshly written records from a scratch store beside
  the disk tier (cold when the store is a local directory), one read and a batch in flight.
- ``pool_to_host``: verified gets of values put in the pool for the purpose (one, and a
  batch), removed after.
- prefill: the model runner's own prefill step, timed for every page-table width bucket with
  its rows attending over that bucket's context (nothing written; with a window group, into
  one empty page per shard taken for the purpose and given back); the curve ``t(n, c)`` is
  fitted to what ``n`` tokens after ``c`` cached ones cost in steps.
- ``overlap``: one prefill step timed alone, reads of the slowest lower tier there is (the
  pool, else the disk, else host memory) of about as long timed alone, and both at once,
  the reads on a thread of their own as a fetch's are: how much a split's two halves hide
  each other here (on a CPU the reads take cycles from the step; an accelerator's DMA
  does not), before any split has been timed.
Nothing here is a constant: a different machine, model or config measures differently.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
import time

import jax
import numpy as np
from absl import logging

from jaxkv import buckets
from jaxkv.worker.tiers.base import Landing
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve, overlap_seen


def _median_time(fn, reps: int) -> float:
  fn()  # warm: compile and first-touch outside the clock
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return float(np.median(times))


def _line(points: list[tuple[float, float]]) -> LinkCost:
  """Latency and bandwidth of ``t = latency + bytes / bandwidth`` through two points."""
  (b0, t0), (b1, t1) = points
  slope = (t1 - t0) / (b1 - b0)
  if slope <= 0:  # noise hid the bytes' cost: take the larger transfer's average rate
    return LinkCost(latency_s=0.0, bytes_per_s=b1 / max(t1, 1e-9))
  return LinkCost(latency_s=max(t0 - slope * b0, 0.0), bytes_per_s=1.0 / slope)


class Reader:
  """Reads of one lower tier's blocks for calibration: ``read(k)`` returns a function that
  reads ``k`` of them (``1 <= k <= most``) the way a fetch does, ``block_bytes`` apiece.
  ``beside(k)``: the same reads for another thread to run while a step runs (they change
  no pool: a step owns the pools while it runs); ``read`` where that is ``read`` itself."""

  def __init__(self, read, most: int, block_bytes: int, beside=None):
    self.read, self.most, self.block_bytes = read, most, block_bytes
    self.beside = beside or read

  def link(self, reps: int) -> LinkCost:
    """The link's latency and bandwidth, from one block's reads and ``most`` blocks'."""
    return _line([(k * self.block_bytes, _median_time(self.read(k), reps))
                  for k in (1, self.most)])

  def blocks(self, n: int):
    """A function reading ``n`` blocks (``beside``): ``most`` at a time, then the rest."""
    parts = [self.beside(self.most)] * (n // self.most) + (
        [self.beside(n % self.most)] if n % self.most else [])

    def go():
      for part in parts:
        part()
    return go


@contextlib.contextmanager
def _host_reader(cache):
  """Host slots loaded to device and landed (slot 0 read, padding pages written: no block
  changes), in the move buckets a fetch uses (``transfer_pages(1)`` blocks per shard each)."""
  worker, c = cache.worker, cache.config
  per = buckets.transfer_pages(1)
  ids = lambda k: np.zeros((cache.num_shards, k * per), np.int32)  # slot 0: same bytes

  def read(k, land=True):
    dest = np.full((cache.num_shards, k * per), c.pages_per_shard, np.int32)  # dropped

    def move():  # a fetch's path: page-major blocks loaded, then landed (all padding)
      blocks, _ = worker.host.load_blocks(ids(k))
      if land:
        worker.land(Landing(dest, blocks, blocks=True))
        jax.block_until_ready(worker.pools)
      else:
        jax.block_until_ready(blocks)
    return move

  # (1 and 8 buckets' worth: the buckets a warm engine compiled)
  yield Reader(read, 8, per * cache.num_shards * c.page_bytes,
                beside=lambda k: read(k, land=False))


@contextlib.contextmanager
def _disk_reader(cache):
  """Verified reads of records written for the purpose, under a fingerprint of their own
  (random: processes sharing the store never see or touch each other's), deleted after."""
  disk = cache.worker.disk
  n = 16
  scratch = disk.scratch(b"calibration" + secrets.token_bytes(21), n)  # same key, same cost
  rng = np.random.default_rng(0)
  payload = rng.standard_normal(disk.payload_shape).astype(np.float32).astype(disk.dtype)
  keys = [i.to_bytes(32, "little") for i in range(n)]
  try:
    for w in [scratch.write(k, payload, None) for k in keys]:
      w.result(timeout=120)

    def read(k):
      def go():
        if scratch.local:  # cold reads: drop the records from the page cache first
          for key in keys:
            fd = os.open(scratch.path_of(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        scratch.read_verified(keys[:k], time.monotonic() + 120)
      return go

    yield Reader(read, n, scratch.record_bytes)
  finally:
    for key in keys:
      scratch.delete(key)
    scratch.settle()
    if scratch.local:
      shutil.rmtree(scratch.prefix_path, ignore_errors=True)


@contextlib.contextmanager
def _pool_reader(cache):
  """Verified gets of values put for the purpose under a fingerprint of their own (random:
  no other process reads or evicts them on purpose), removed after."""
  live = cache.worker.pool
  scratch = live.scratch(b"calibration" + secrets.token_bytes(21))
  rng = np.random.default_rng(0)
  payload = rng.standard_normal(live.payload_shape).astype(np.float32).astype(live.dtype)
  n = 8
  keys = [i.to_bytes(32, "little") for i in range(n)]
  try:
    for k in keys:
      if live.client.put(scratch.name(k), scratch.value(k, payload, None)) != 0:
        raise RuntimeError("the pool refused a calibration value")
    yield Reader(lambda k: lambda: scratch.read_verified(keys[:k], time.monotonic() + 60),
                  n, scratch.value_bytes)
  finally:
    for k in keys:
      live.client.remove(scratch.name(k), True)


@contextlib.contextmanager
def _scratch_pages(cache):
  """One empty device page per data shard for the prefill steps of a model with a window
  group to write (``ModelRunner.time_prefill_step``), given back on leaving; None (and a
  warning) when a shard has none: then its local layers are priced at no attention."""
  pages = []
  try:
    for shard in range(cache.num_shards):
      got = cache.manager.allocate_empty(shard, 1)
      if got is None:
        logging.warning("calibration: data shard %d has no empty device page for the "
                        "prefill steps to write; the window group's layers are priced at no "
                        "attention", shard)
        break
      pages.append(got[0])
    yield pages if len(pages) == cache.num_shards else None
  finally:
    for shard, page in enumerate(pages):
      cache.manager.release(shard, [page])


def _prefill_curve(cache, runner, max_seqs_per_shard: int, reps: int) -> PrefillCurve:
  """Every page-table width bucket's prefill step, timed with its rows attending over the
  middle of the context the bucket holds (a chunk's cost grows with the context before it:
  a step of padding alone would attend over nothing and price every prefill as if the
  prompt had no past); a prefill of ``n`` tokens after ``c`` is the sum of its chunks'
  steps, each at the bucket its end falls in."""
  c = cache.config
  chunk = runner.chunk_tokens
  rows = cache.num_shards * min(buckets.pow2_at_least(max_seqs_per_shard), max_seqs_per_shard)
  widths = sorted({buckets.table_width(p, c) for p in range(1, c.max_pages_per_seq + 1)})
  step_s, below = {}, 0
  with (_scratch_pages(cache) if c.has_windows else contextlib.nullcontext()) as pages:
    for w in widths:
      middle = max(chunk, (below + w) * c.page_size // 2)
      step_s[w] = runner.time_prefill_step(rows, w, lambda step: _median_time(step, reps),
                                           kv_len=min(middle, w * c.page_size), pages=pages)
      below = w
  width_of = lambda tokens: buckets.table_width(-(-tokens // c.page_size), c)
  samples = []
  max_tokens = c.max_seq_len
  for n in sorted({chunk, 2 * chunk, 4 * chunk, max_tokens // 4, max_tokens // 2}):
    for ctx in sorted({0, max_tokens // 4, max_tokens // 2}):
      if n <= 0 or n + ctx > max_tokens:
        continue
      ends = [min(ctx + (i + 1) * chunk, ctx + n) for i in range(-(-n // chunk))]
      samples.append((float(n), float(ctx), sum(step_s[width_of(e)] for e in ends)))
  return PrefillCurve.fit(samples)


def overlap_beside(step, reader: Reader, link: LinkCost, reps: int) -> float | None:
  """How much ``step`` (a prefill step) and reads of ``reader``'s tier hide each other:
  the step timed alone, reads of about as long (by ``link``'s cost) timed alone, then both
  at once, the reads on a thread of their own as a fetch's are; ``overlap_seen`` of the
  three medians of ``reps``. None when a time is 0."""
  recompute_s = _median_time(step, reps)
  per_block = link.latency_s + reader.block_bytes / link.bytes_per_s
  n = int(min(max(round(recompute_s / max(per_block, 1e-9)), 1), 64 * reader.most))
  fetch = reader.blocks(n)
  fetch_s = _median_time(fetch, reps)
  failed = []

  def fetch_beside():
    try:
      fetch()
    except BaseException as e:  # pylint: disable=broad-except  (raised on the caller's thread)
      failed.append(e)

  def both():
    t = threading.Thread(target=fetch_beside, name="jaxkv-calibration-read", daemon=True)
    t.start()
    try:
      step()
    finally:
      t.join(timeout=600)
    if t.is_alive() or failed:
      raise RuntimeError("calibration: the reads beside a prefill step "
                         f"{'failed' if failed else 'ran past 600 s'}") from (
                             failed[0] if failed else None)

  seconds = _median_time(both, reps)
  logging.info("calibration: prefill step %.2f ms, %d blocks read %.2f ms, both %.2f ms",
               1e3 * recompute_s, n, 1e3 * fetch_s, 1e3 * seconds)
  return overlap_seen(recompute_s, fetch_s, seconds)


def _overlap(cache, runner, reader: Reader, link: LinkCost, max_seqs_per_shard: int,
             reps: int) -> float | None:
  """``overlap_beside`` a prefill step at the middle page-table width, its rows attending
  over half of that width's context."""
  c = cache.config
  rows = cache.num_shards * min(buckets.pow2_at_least(max_seqs_per_shard), max_seqs_per_shard)
  widths = sorted({buckets.table_width(p, c) for p in range(1, c.max_pages_per_seq + 1)})
  width = widths[len(widths) // 2]
  with (_scratch_pages(cache) if c.has_windows else contextlib.nullcontext()) as pages:
    return runner.time_prefill_step(
        rows, width, lambda step: overlap_beside(step, reader, link, reps),
        kv_len=width * c.page_size // 2, pages=pages)


def calibrate(cache, runner, *, max_seqs_per_shard: int, reps: int = 3) -> CostModel:
  """A CostModel measured for ``cache`` (its config, tiers and machine) and the model
  ``runner`` runs, batching up to ``max_seqs_per_shard`` sequences per shard. Its
  ``overlap`` is measured beside the slowest lower tier it reads at start (the pool, else
  the disk, else host memory; 1, the most, without one: learned from splits)."""
  links, readers = {}, {}
  with contextlib.ExitStack() as stack:
    if cache.worker.host is not None:
      readers["host_to_device"] = stack.enter_context(_host_reader(cache))
      links["host_to_device"] = readers["host_to_device"].link(reps)
    if cache.worker.disk is not None:
      readers["disk_to_host"] = stack.enter_context(_disk_reader(cache))
      links["disk_to_host"] = readers["disk_to_host"].link(reps)
      links.setdefault("host_to_device", links["disk_to_host"])  # disk blocks land via host
    if cache.worker.pool is not None:
      try:
        reader = stack.enter_context(_pool_reader(cache))
        links["pool_to_host"] = reader.link(reps)
        readers["pool_to_host"] = reader
        links.setdefault("host_to_device", links["pool_to_host"])  # pool blocks land via host
      except Exception:  # pylint: disable=broad-except  (a pool down now: learned from fetches)
        logging.exception("calibrating the pool link failed; it is learned from fetches")
    prefill = _prefill_curve(cache, runner, max_seqs_per_shard, reps)
    overlap = None
    for name in ("pool_to_host", "disk_to_host", "host_to_device"):
      if name in readers:
        overlap = _overlap(cache, runner, readers[name], links[name], max_seqs_per_shard, reps)
        if overlap is not None:
          logging.info("calibrated overlap of a prefill and a %s read: %.2f", name, overlap)
        break
  for name, link in links.items():
    logging.info("calibrated %s: %.2f GB/s, %.3f ms latency", name, link.bytes_per_s / 1e9,
                 1e3 * link.latency_s)
  logging.info("calibrated prefill: %.2f ms + %.4f ms per token + %.3g ms per token x "
               "context token", 1e3 * prefill.t0_s, 1e3 * prefill.per_token_s,
               1e3 * prefill.per_token_context_s)
  return CostModel(links=links, prefill=prefill, source="calibrated",
                   overlap=1.0 if overlap is None else overlap)
