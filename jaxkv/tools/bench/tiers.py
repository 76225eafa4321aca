"""Suite ``tiers``: jaxkv's tier paths against the physical path on the same bytes.

- host: device->host (``HostTier.store_pages``: staged on device, one transfer per block)
  and host->device (``HostTier.load_blocks`` + the landing scatter) against a numpy memcpy of the same bytes; a
  plain ``jax.device_put`` to/from the host memory kind is reported beside them (what the
  transfer alone costs: ``*_vs_device_put``).
- disk: jaxkv writes (one record per block, all in flight, the store at capacity so each
  replaces an evicted record, one ``syncfs`` for the batch), bulk reads and
  random-page gathers (all in flight, each verified) against raw ``pwrite``/``pread`` of
  one preallocated file. Reads are cold: files are written out (syncfs) and dropped from
  the page cache (``POSIX_FADV_DONTNEED``) before every repetition.
- what the deployment key costs on disk: the same writes and bulk reads of keyless records
  (CRC-32C), keyed ones (an AES-GCM tag) and encrypted ones (AES-GCM), interleaved in one
  run: ``keyed_cost_disk_{read,write}`` and ``keyed_cost_disk_{read,write}_encrypted``, keyed
  time over keyless time for the same bytes (1.0: free).
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv.worker import pages as pages_lib
from jaxkv.tools.bench import common
from jaxkv.config import CacheConfig, TierConfig
from jaxkv.worker.pages import make_mesh
from jaxkv.worker.tiers.disk import DiskTier
from jaxkv.worker.tiers import host as host_lib
from jaxkv.worker.tiers.host import HostTier


def _drop_page_cache(paths) -> None:
  """Makes the next reads of ``paths`` cold: their pages written out, then dropped from
  the page cache (a dirty page cannot be dropped). One flush of the file system instead of
  an fsync per file: on ext4 an fsync costs a journal commit even for a clean file, and a
  repetition drops hundreds of record files."""
  paths = list(paths)
  if paths:
    _flush_file_system(os.path.dirname(paths[0]))
  for path in paths:
    fd = os.open(path, os.O_RDONLY)
    try:
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _flush_file_system(directory: str) -> None:
  """Writes out every dirty page of the file system holding ``directory`` (``syncfs``;
  ``sync`` where libc has none). The bench's files all live under one work directory."""
  fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
  try:
    if ctypes.CDLL(None, use_errno=True).syncfs(fd) != 0:
      raise OSError(ctypes.get_errno(), "syncfs failed", directory)
  except AttributeError:  # no syncfs in this libc
    os.sync()
  finally:
    os.close(fd)


def _files_under(root: str) -> list[str]:
  return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]


def run(*, quick: bool = False, reps: int = 5, workdir: str | None = None) -> dict:
  """The suite; its disk figures are taken in ``workdir`` (default: a directory of its own,
  removed on every path: it holds ~100 MB of stores and files)."""
  if workdir is None:
    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-") as own:
      return run(quick=quick, reps=reps, workdir=own)
  devices = jax.devices()
  data, model = (4, 2) if len(devices) >= 8 else (len(devices), 1)
  mesh = make_mesh(data=data, model=model, devices=devices[:data * model])
  pages_per_shard = 16 if quick else 64
  config = CacheConfig(model_name="bench", num_layers=4, num_kv_heads=8, head_dim=128,
                       page_size=16, dtype="bfloat16", pages_per_shard=pages_per_shard,
                       max_pages_per_seq=pages_per_shard)
  n_arrays = 2 * config.num_layers
  rng = np.random.default_rng(0)
  pools = [jax.device_put(jnp.asarray(rng.standard_normal(pages_lib.pool_shape(mesh, config)),
                                      config.jnp_dtype), pages_lib.pool_sharding(mesh, config))
           for _ in range(n_arrays)]
  host = HostTier(mesh, config, TierConfig(host_pages_per_shard=pages_per_shard), n_arrays)
  ids_np = np.stack([rng.permutation(pages_per_shard) for _ in range(data)]).astype(np.int32)
  ids = jax.device_put(ids_np, NamedSharding(mesh, P(config.data_axis, None)))
  nbytes = data * pages_per_shard * config.page_bytes
  src = np.frombuffer(rng.bytes(nbytes), np.uint8)
  dst = np.empty_like(src)
  state = {"pools": pools}

  items = [(s, int(p), int(p)) for s in range(data) for p in ids_np[s]]
  host.warm(pools, pages_per_shard)

  def to_host():  # the serving path's store: gathered on device, sent to the slots
    host.store_pages(state["pools"], items)
    host.pool.block_until_ready()

  land = pages_lib.scatter_blocks_fn(mesh, config, pages_lib.pool_ranks(pools))

  def to_device():  # a fetch's path: page-major blocks loaded, then landed
    blocks, _ = host.load_blocks(ids_np)
    state["pools"] = list(land(tuple(state["pools"]), ids, blocks))
    jax.block_until_ready(state["pools"])

  stack_dev = pages_lib.gather_stacked(pools, ids, mesh=mesh, config=config)
  host_sharding = stack_dev.sharding.with_memory_kind(host.memory_kind)
  stack_host = jax.device_put(stack_dev, host_sharding)

  def memcpy():
    np.copyto(dst, src)

  host_res = common.interleaved({
      "jaxkv_device_to_host": to_host, "jaxkv_host_to_device": to_device, "memcpy": memcpy,
      "device_put_to_host": lambda: jax.device_put(stack_dev, host_sharding).block_until_ready(),
      "device_put_to_device": lambda: jax.device_put(stack_host,
                                                     stack_dev.sharding).block_until_ready(),
  }, reps=reps)

  # ---- disk -------------------------------------------------------------------------------
  n_blocks = data * pages_per_shard
  payload_shape = (n_arrays, config.num_kv_heads, config.page_size, config.head_dim)
  store_root = os.path.join(workdir, "store")
  key = hashlib.sha256(b"jaxkv tiers bench deployment key").digest()
  protections = {"": {}, "_keyed": {"key": key}, "_encrypted": {"key": key, "encrypt": True}}
  disks = {name: DiskTier(store_root, num_slots=n_blocks, payload_shape=payload_shape,
                          dtype=config.jnp_dtype, fingerprint=config.fingerprint(), **kw)
           for name, kw in protections.items()}
  payloads = [jnp.asarray(rng.standard_normal(payload_shape), config.jnp_dtype).__array__()
              for _ in range(8)]
  keys = [i.to_bytes(32, "little") for i in range(n_blocks)]
  rec = disks[""].record_bytes
  raw_path = os.path.join(workdir, "raw.bin")
  with open(raw_path, "wb") as f:
    f.truncate(n_blocks * rec)
  raw_records = [np.frombuffer(rng.bytes(rec), np.uint8) for _ in range(8)]
  gather_slots = sorted(rng.choice(n_blocks, n_blocks // 4, replace=False).tolist())
  held = {name: [None] * n_blocks for name in disks}  # the block each slot holds, per tier

  def disk_write(name):
    """The store at capacity, as in use: each new block takes the slot of an evicted one,
    whose record is deleted (as the mover's journal does when the index evicts it)."""
    tier, slots, generation = disks[name], held[name], [0]

    def go():
      generation[0] += 1
      ws = []
      for i, k in enumerate(keys):
        if slots[i] is not None:
          tier.delete(slots[i])
        slots[i] = hashlib.sha256(name.encode() + k + generation[0].to_bytes(8, "little")).digest()
        ws.append(tier.write(slots[i], payloads[i % 8], None))
      for w in ws:
        w.result(timeout=600)
      tier.settle()  # the evicted records' deletions too
      tier.sync()  # durable, as the tier publishes a batch
    return go

  def raw_write():
    fd = os.open(raw_path, os.O_WRONLY)
    try:
      for i in range(n_blocks):
        os.pwrite(fd, raw_records[i % 8], i * rec)
      os.fsync(fd)
    finally:
      os.close(fd)

  def disk_read(slots, name=""):
    def go():
      disks[name].read_verified([held[name][s] for s in slots], time.monotonic() + 600)
    return go

  def raw_read_bulk():
    fd = os.open(raw_path, os.O_RDONLY)
    try:
      os.pread(fd, n_blocks * rec, 0)
    finally:
      os.close(fd)

  def raw_gather():
    fd = os.open(raw_path, os.O_RDONLY)
    try:
      for s in gather_slots:
        os.pread(fd, rec, s * rec)
    finally:
      os.close(fd)

  write_res = common.interleaved({
      **{f"jaxkv_write{name}": disk_write(name) for name in disks}, "pwrite": raw_write,
  }, reps=reps)
  cold = lambda _name: _drop_page_cache(_files_under(store_root) + [raw_path])
  read_res = common.interleaved({
      **{f"jaxkv_bulk_read{name}": disk_read(list(range(n_blocks)), name) for name in disks},
      "pread_bulk": raw_read_bulk,
      "jaxkv_gather": disk_read(gather_slots), "pread_gather": raw_gather,
  }, reps=reps, setup=cold)
  cost = lambda res, a, b: res[a]["median_s"] / res[b]["median_s"]  # time a / time b
  # The proofs alone, on records in memory: the cost where the disk is not the bottleneck
  # (page-cache-warm reads, fast NVMe).
  codec = {}
  for name, tier in disks.items():
    records = [tier.record(k, p, None) for k, p in zip(keys, payloads)]
    codec[f"encode{name}"] = lambda t=tier: [t.record(k, p, None) for k, p in zip(keys, payloads)]
    codec[f"decode{name}"] = lambda t=tier, rs=records: [t.verify(r, k) for r, k in zip(rs, keys)]
  cpu_res = common.interleaved(codec, reps=max(reps, 5))

  layout = _chunk_layouts(workdir, n_blocks, rec, rng, reps)
  disk_bytes = n_blocks * rec
  gather_bytes = len(gather_slots) * rec
  out = {
      "host_to_device_vs_memcpy": common.ratio(host_res["jaxkv_host_to_device"], host_res["memcpy"]),
      "device_to_host_vs_memcpy": common.ratio(host_res["jaxkv_device_to_host"], host_res["memcpy"]),
      "host_to_device_vs_device_put": common.ratio(host_res["jaxkv_host_to_device"],
                                                   host_res["device_put_to_device"]),
      "device_to_host_vs_device_put": common.ratio(host_res["jaxkv_device_to_host"],
                                                   host_res["device_put_to_host"]),
      "disk_read_vs_pread": common.ratio(read_res["jaxkv_bulk_read"], read_res["pread_bulk"]),
      "disk_gather_vs_pread": common.ratio(read_res["jaxkv_gather"], read_res["pread_gather"]),
      "disk_write_vs_pwrite": common.ratio(write_res["jaxkv_write"], write_res["pwrite"]),
      "keyed_cost_disk_read": cost(read_res, "jaxkv_bulk_read_keyed", "jaxkv_bulk_read"),
      "keyed_cost_disk_write": cost(write_res, "jaxkv_write_keyed", "jaxkv_write"),
      "keyed_cost_disk_read_encrypted": cost(read_res, "jaxkv_bulk_read_encrypted",
                                             "jaxkv_bulk_read"),
      "keyed_cost_disk_write_encrypted": cost(write_res, "jaxkv_write_encrypted", "jaxkv_write"),
      "keyed_cost_cpu": {f"{op}{name}": cost(cpu_res, f"{op}{name}", op)
                         for op in ("encode", "decode") for name in ("_keyed", "_encrypted")},
      "bytes": {"host_moves": nbytes, "disk_bulk": disk_bytes, "disk_gather": gather_bytes,
                "block": config.page_bytes, "record": rec},
      "host": {k: common.throughput(nbytes, v) for k, v in host_res.items()},
      "disk": {
          **{f"jaxkv_write{name}": common.throughput(disk_bytes, write_res[f"jaxkv_write{name}"])
             for name in disks},
          "pwrite": common.throughput(disk_bytes, write_res["pwrite"]),
          **{f"jaxkv_bulk_read{name}": common.throughput(disk_bytes,
                                                         read_res[f"jaxkv_bulk_read{name}"])
             for name in disks},
          "pread_bulk": common.throughput(disk_bytes, read_res["pread_bulk"]),
          "jaxkv_gather": common.throughput(gather_bytes, read_res["jaxkv_gather"]),
          "pread_gather": common.throughput(gather_bytes, read_res["pread_gather"]),
      },
      "notes": ("reads are cold (syncfs + POSIX_FADV_DONTNEED before each repetition); jaxkv "
                "writes one file per record (temp file + rename), each new block replacing an "
                "evicted one's record (the store at capacity), and flushes the batch with one "
                "syncfs; pwrite overwrites a preallocated file in place and fsyncs once; jaxkv reads verify every record's "
                "header and CRC-32C (_keyed: an AES-GCM tag under a deployment key; "
                "_encrypted: AES-256-GCM, the payload sealed); keyed_cost_*: keyed time over "
                "keyless time, medians of the interleaved repetitions"),
      "chunk_layout": layout,
      "mesh": {"data": data, "model": model},
  }
  # Move sizes, pool-size sensitivity and the compiled moves (the device check reads them).
  out["host_sweep"] = host_sweep(
      mesh, config, sizes_mib=(1, 4) if quick else (4, 16, 64),
      pool_pages=(pages_per_shard, 4 * pages_per_shard) if quick else (64, 4096),
      reps=reps)
  return out


# Op names of compiled HLO that say how a move runs (on a GPU: ``copy-start`` /
# ``copy-done`` are asynchronous copies; a host computation shows as a host-execute pair or
# an op tagged ``_xla_compute_type="host"``).
HLO_MARKERS = ("copy-start", "copy-done", "dynamic-update-slice", "dynamic-slice", "while",
               "scatter", "host-execute", "_xla_compute_type", "custom-call")


def hlo_markers(text: str) -> dict:
  """How often each of ``HLO_MARKERS`` occurs in a compiled module's text."""
  return {m: text.count(m + ("(" if m in ("dynamic-update-slice", "dynamic-slice", "while",
                                          "scatter", "custom-call", "copy-start", "copy-done")
                             else "")) for m in HLO_MARKERS}


def host_sweep(mesh, config, *, sizes_mib=(4, 16, 64), pool_pages=(64, 4096), reps: int = 5
               ) -> dict:
  """The host tier's store and load at several move sizes, each beside a bare
  ``device_put`` of the same bytes (``{size}mib``: GB/s and ratios); the store's time into a
  small and a large pool (``pool_store_ms``: a move that copied the pool would scale with
  it); and the compiled moves' HLO markers (``hlo``)."""
  data = pages_lib.data_shards(mesh, config)
  n_arrays = 2 * config.num_layers
  per_mib = data * config.page_bytes / 2**20
  # A device pool that holds the largest move.
  pages = max(1, int(round(max(sizes_mib) / per_mib)))
  config = dataclasses.replace(config, pages_per_shard=pages, max_pages_per_seq=pages,
                               attention_chunk_pages=1)
  pools = [jax.device_put(jnp.zeros(pages_lib.pool_shape(mesh, config), config.jnp_dtype),
                          pages_lib.pool_sharding(mesh, config)) for _ in range(n_arrays)]
  ids_sharding = NamedSharding(mesh, P(config.data_axis, None))
  out: dict = {"sizes": {}, "pool_store_ms": {}}
  top = config.pages_per_shard
  for mib in sizes_mib:
    n = max(1, min(top, int(round(mib / per_mib))))
    host = HostTier(mesh, config, TierConfig(host_pages_per_shard=max(n, min(pool_pages))),
                    n_arrays)
    host.warm(pools, n)
    items = [(s, p, p) for s in range(data) for p in range(n)]
    ids_np = np.tile(np.arange(n, dtype=np.int32), (data, 1))
    ids = jax.device_put(ids_np, ids_sharding)
    stack = pages_lib.gather_stacked(pools, ids, mesh=mesh, config=config)
    on_host = stack.sharding.with_memory_kind(host.memory_kind)
    stack_host = jax.device_put(stack, on_host)

    def store(host=host, items=items):
      host.store_pages(pools, items)
      host.pool.block_until_ready()

    res = common.interleaved({
        "store": store,
        "load": lambda host=host, ids_np=ids_np: jax.block_until_ready(
            host.load_blocks(ids_np)),
        "device_put_to_host": lambda: jax.device_put(stack, on_host).block_until_ready(),
        "device_put_to_device": lambda: jax.device_put(stack_host,
                                                       stack.sharding).block_until_ready(),
    }, reps=reps)
    nbytes = n * data * config.page_bytes
    out["sizes"][f"{mib}mib"] = {
        "bytes": nbytes, **{k: common.throughput(nbytes, v) for k, v in res.items()},
        "store_vs_device_put": common.ratio(res["store"], res["device_put_to_host"]),
        "load_vs_device_put": common.ratio(res["load"], res["device_put_to_device"])}
    if mib == sizes_mib[-1]:
      fns = host_lib.host_fns(mesh, config, host.memory_kind, pages_lib.pool_ranks(pools))
      page_ids = jax.device_put(ids_np, ids_sharding)
      blocks, _ = fns.stage(tuple(pools), page_ids)
      out["hlo"] = {
          "stage": hlo_markers(fns.stage.lower(tuple(pools), page_ids).compile().as_text()),
          "place": hlo_markers(fns.place.lower(host.pool, blocks, page_ids).compile().as_text()),
          "load": hlo_markers(fns.load.lower(host.pool, page_ids).compile().as_text())}
    del host
  n = max(1, min(top, int(round(sizes_mib[0] / per_mib))))
  items = [(s, p, p) for s in range(data) for p in range(n)]
  stores = {}
  for slots in pool_pages:
    host = HostTier(mesh, config, TierConfig(host_pages_per_shard=max(slots, n)), n_arrays)
    host.warm(pools, n)

    def store(host=host):
      host.store_pages(pools, items)
      host.pool.block_until_ready()
    stores[f"{slots}_pages"] = store
  res = common.interleaved(stores, reps=reps)
  out["pool_store_ms"] = {k: 1e3 * v["median_s"] for k, v in res.items()}
  out["pool_store_bytes"] = n * data * config.page_bytes
  return out


def _chunk_layouts(workdir: str, n_blocks: int, rec: int, rng, reps: int) -> dict:
  """Random-block writes and gathers with one record per chunk (one object per block, as the
  disk tier stores them) against 8 records per chunk, plain zarr3 + crc32c on the file
  driver, same bytes: why a block is its own object."""
  import tensorstore as ts
  out = {}
  data = np.frombuffer(rng.bytes(rec), np.uint8)
  picks = sorted(rng.choice(n_blocks, max(1, n_blocks // 4), replace=False).tolist())
  stores = {}
  for per_chunk in (1, 8):
    root = os.path.join(workdir, f"layout{per_chunk}")
    stores[per_chunk] = (root, ts.open({
        "driver": "zarr3", "kvstore": {"driver": "file", "path": root + "/"},
        "metadata": {"shape": [n_blocks, rec], "data_type": "uint8",
                     "chunk_grid": {"name": "regular",
                                    "configuration": {"chunk_shape": [per_chunk, rec]}},
                     "codecs": [{"name": "bytes"}, {"name": "crc32c"}], "fill_value": 0},
        "create": True, "delete_existing": True}).result())
    arr = stores[per_chunk][1]
    for f in [arr[i].write(data) for i in range(n_blocks)]:
      f.result()

  def writes(arr):
    def go():
      for f in [arr[i].write(data) for i in picks]:
        f.result()
    return go

  def gathers(arr):
    def go():
      for f in [arr[i].read() for i in picks]:
        f.result()
    return go

  cand = {}
  for k, (_, arr) in stores.items():
    cand[f"write_{k}_per_chunk"] = writes(arr)
    cand[f"gather_{k}_per_chunk"] = gathers(arr)
  cold = lambda _name: _drop_page_cache(
      [p for root, _ in stores.values() for p in _files_under(root)])
  res = common.interleaved(cand, reps=reps, setup=cold)
  nbytes = len(picks) * rec
  for name, r in res.items():
    out[name] = common.throughput(nbytes, r)
  out["write_1_vs_8_per_chunk"] = common.ratio(res["write_1_per_chunk"], res["write_8_per_chunk"])
  out["gather_1_vs_8_per_chunk"] = common.ratio(res["gather_1_per_chunk"],
                                                res["gather_8_per_chunk"])
  return out
