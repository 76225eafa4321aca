"""Measures the costs the scheduler decides with, on this machine, model and config.

- ``host_to_device``: ``HostTier.load`` + the device scatter for two batch sizes; latency
  and bandwidth from the line through both points.
- ``disk_to_host``: verified reads of freshly written records from a scratch store beside
  the disk tier (cold when the store is a local directory), one read and a batch in flight.
- prefill: the engine's own prefill step, timed for every page-table width bucket; the
  curve ``t(n, c)`` is fitted to what ``n`` tokens after ``c`` cached ones cost in steps.
Nothing here is a constant: a different machine, model or config measures differently.
"""

from __future__ import annotations

import os
import shutil
import time

import jax
import numpy as np

from jaxkv import pages as pages_lib
from jaxkv.scheduler import CostModel, LinkCost, PrefillCurve


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
  slope = max((t1 - t0) / (b1 - b0), 1e-15)
  return LinkCost(latency_s=max(t0 - slope * b0, 0.0), bytes_per_s=1.0 / slope)


def _host_link(engine, reps: int) -> LinkCost:
  mover, host, c = engine._mover, engine.cache.host, engine.cache.config
  shards = engine.cache.num_shards
  points = []
  for n in (mover_bucket(1), 8 * mover_bucket(1)):
    ids = np.zeros((shards, n), np.int32)  # reads slot 0 n times: the bytes move all the same
    dest = jax.device_put(np.full((shards, n), c.pages_per_shard, np.int32), mover._ids_sharding)

    def move():
      stack, _ = host.load(ids)
      engine._set_flat_pools(pages_lib.scatter_stacked(engine._flat_pools(), dest, stack,
                                                       mesh=engine.mesh, config=c))
      jax.block_until_ready(engine._flat_pools())

    points.append((n * shards * c.page_bytes, _median_time(move, reps)))
  return _line(points)


def mover_bucket(n: int) -> int:
  from jaxkv.executor import bucket
  return bucket(n)


def _disk_link(engine, reps: int) -> LinkCost:
  from jaxkv.tiers.disk import DiskTier
  disk = engine.cache.disk
  spec = dict(disk.kvstore)
  spec["path"] = spec.get("path", "") + "calibration/"
  n = 16
  scratch = DiskTier(spec, num_slots=n, payload_shape=disk.payload_shape, dtype=disk.dtype,
                     fingerprint=disk.fingerprint)
  rng = np.random.default_rng(0)
  payload = rng.standard_normal(disk.payload_shape).astype(np.float32).astype(disk.dtype)
  keys = [i.to_bytes(32, "little") for i in range(n)]
  for w in [scratch.write(i, payload, keys[i], None) for i in range(n)]:
    w.future.result(timeout=120)

  def read(k):
    def go():
      if spec["driver"] == "file":
        root = os.path.join(spec["path"], "blocks")
        for name in os.listdir(root):
          fd = os.open(os.path.join(root, name), os.O_RDONLY)
          os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
          os.close(fd)
      for i, r in enumerate([scratch.read(i) for i in range(k)]):
        scratch.verify(r.future.result(timeout=120), keys[i])
    return go

  points = [(k * scratch.record_bytes, _median_time(read(k), reps)) for k in (1, n)]
  if spec["driver"] == "file":
    shutil.rmtree(spec["path"], ignore_errors=True)
  return _line(points)


def _prefill_curve(engine, reps: int) -> PrefillCurve:
  c = engine.cache.config
  chunk = engine.config.prefill_chunk_pages * c.page_size
  rows = pages_lib.data_shards(engine.mesh, c) * min(
      1 << (engine.config.max_seqs_per_shard - 1).bit_length(), engine.config.max_seqs_per_shard)
  widths = sorted({engine._table_width(p) for p in range(1, c.max_pages_per_seq + 1)})
  step_s = {}
  for w in widths:
    z = lambda *shape: engine._put_rows(np.zeros(shape, np.int32))
    table, tokens = z(rows, w), z(rows, chunk)
    pad = engine._put_rows(np.full((rows, chunk), -1, np.int32))
    mask = engine._put_rows(np.zeros((rows,), bool))

    def step():
      engine._pages, carry, _ = engine._prefill(engine._pages, engine._rest, tokens, z(rows),
                                                table, pad, z(rows), z(rows), mask)
      carry.block_until_ready()

    step_s[w] = _median_time(step, reps)
  samples = []
  max_tokens = c.max_seq_len
  for n in sorted({chunk, 2 * chunk, 4 * chunk, max_tokens // 4, max_tokens // 2}):
    for ctx in sorted({0, max_tokens // 4, max_tokens // 2}):
      if n <= 0 or n + ctx > max_tokens:
        continue
      steps = -(-n // chunk)
      width = engine._table_width(-(-(n + ctx) // c.page_size))
      samples.append((float(n), float(ctx), steps * step_s[width]))
  return PrefillCurve.fit(samples)


def calibrate(engine, *, reps: int = 3) -> CostModel:
  """A CostModel measured for ``engine`` (its model, cache config, tiers and machine)."""
  links = {}
  if engine.cache.host is not None:
    links["host_to_device"] = _host_link(engine, reps)
  if engine.cache.disk is not None:
    links["disk_to_host"] = _disk_link(engine, reps)
    links.setdefault("host_to_device", links["disk_to_host"])  # disk blocks land via host
  return CostModel(links=links, prefill=_prefill_curve(engine, reps), source="calibrated")
