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
Nothing here is a constant: a different machine, model or config measures differently.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import time

import jax
import numpy as np
from absl import logging

from jaxkv import buckets
from jaxkv.worker.tiers.base import Landing
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve


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


def _host_link(cache, reps: int) -> LinkCost:
  worker, c = cache.worker, cache.config
  points = []
  for n in (buckets.transfer_pages(1), 8 * buckets.transfer_pages(1)):
    ids = np.zeros((cache.num_shards, n), np.int32)  # reads slot 0 n times: same bytes moved
    dest = np.full((cache.num_shards, n), c.pages_per_shard, np.int32)  # dropped

    def move():  # a fetch's path: page-major blocks loaded, then landed (all padding)
      blocks, _ = worker.host.load_blocks(ids)
      worker.land(Landing(dest, blocks, blocks=True))
      jax.block_until_ready(worker.pools)

    points.append((n * cache.num_shards * c.page_bytes, _median_time(move, reps)))
  return _line(points)


def _disk_link(cache, reps: int) -> LinkCost:
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

    points = [(k * scratch.record_bytes, _median_time(read(k), reps)) for k in (1, n)]
  finally:
    for key in keys:
      scratch.delete(key)
    scratch.settle()
    if scratch.local:
      shutil.rmtree(scratch.prefix_path, ignore_errors=True)
  return _line(points)


def _pool_link(cache, reps: int) -> LinkCost:
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
    points = [(k * scratch.value_bytes,
               _median_time(lambda k=k: scratch.read_verified(keys[:k], time.monotonic() + 60),
                            reps)) for k in (1, n)]
  finally:
    for k in keys:
      live.client.remove(scratch.name(k), True)
  return _line(points)


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


def calibrate(cache, runner, *, max_seqs_per_shard: int, reps: int = 3) -> CostModel:
  """A CostModel measured for ``cache`` (its config, tiers and machine) and the model
  ``runner`` runs, batching up to ``max_seqs_per_shard`` sequences per shard."""
  links = {}
  if cache.worker.host is not None:
    links["host_to_device"] = _host_link(cache, reps)
  if cache.worker.disk is not None:
    links["disk_to_host"] = _disk_link(cache, reps)
    links.setdefault("host_to_device", links["disk_to_host"])  # disk blocks land via host
  if cache.worker.pool is not None:
    try:
      links["pool_to_host"] = _pool_link(cache, reps)
      links.setdefault("host_to_device", links["pool_to_host"])  # pool blocks land via host
    except Exception:  # pylint: disable=broad-except  (a pool down now: learned from fetches)
      logging.exception("calibrating the pool link failed; it is learned from fetches")
  prefill = _prefill_curve(cache, runner, max_seqs_per_shard, reps)
  for name, link in links.items():
    logging.info("calibrated %s: %.2f GB/s, %.3f ms latency", name, link.bytes_per_s / 1e9,
                 1e3 * link.latency_s)
  logging.info("calibrated prefill: %.2f ms + %.4f ms per token + %.3g ms per token x "
               "context token", 1e3 * prefill.t0_s, 1e3 * prefill.per_token_s,
               1e3 * prefill.per_token_context_s)
  return CostModel(links=links, prefill=prefill, source="calibrated")
