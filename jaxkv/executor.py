"""TierMover: moves blocks between device, host and disk, and verifies what comes back.

The engine calls it from its one thread, always in the same order for the same work, so
every transfer is issued deterministically (multi-host jobs need that). Device and host
transfers are asynchronous JAX dispatches ordered by data dependencies: a gather that
reads a device page is dispatched before any step that overwrites it. Disk I/O runs on
TensorStore futures; this module is the only place that waits on them, always with a
deadline.

Moves
- ``demote``: blocks evicted from the device pool are copied down before their pages are
  reused (write-back): to the host pool if there is one, else to disk. Blocks the host
  pool evicts to make room go on to disk the same way.
- ``copy_down``: write-through of freshly published device blocks.
- ``promote``: lower-tier hits are copied into the device pages a request was given.
  Every page is verified (host: a device-side checksum of the bytes sent and received;
  disk: jaxkv's record header and SHA-256). The first block that fails, is missing or is
  late ends the request's hit: it recomputes from there, and the bad copy leaves the
  index with every block chained after it.
Blocks are published in a lower tier only when their bytes are there: host slots when
the copy is dispatched (later reads are ordered after it), disk slots when the write has
committed. A slot in flight holds a reference, so eviction cannot reuse it meanwhile.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import pages as pages_lib
from jaxkv.distributed import to_host
from jaxkv.index import LOCAL_TIERS, Tier

Block = tuple  # (shard, device page, key)


# Transfers are padded to power-of-two page counts, at least this many, so a handful of
# shapes (compiled by ``warmup``) cover every batch.
MIN_BUCKET = 4


def bucket(n: int) -> int:
  return max(MIN_BUCKET, 1 << max(0, (int(n) - 1).bit_length()))


@dataclasses.dataclass
class Fetch:
  """One lower-tier block to copy into a request's device page."""

  owner: object  # the request
  block: int  # index of the block in the request's chain
  shard: int
  tier: Tier
  slot: int
  key: bytes
  page: int  # destination device page
  ok: bool = False
  reason: str = ""


class TierMover:
  """Block movement and verification for one engine and its cache."""

  def __init__(self, cache):
    self.cache = cache
    self.index = cache.index
    self.host = cache.host
    self.disk = cache.disk
    self.mesh = cache.mesh
    self.config = cache.config
    self.counters: collections.Counter = collections.Counter()
    self.failures: collections.Counter = collections.Counter()  # by reason
    self._pending_writes: list = []
    self.last_fetch: dict = {}
    self._ids_sharding = NamedSharding(self.mesh, P(self.config.data_axis, None))
    self._stack_sharding = NamedSharding(self.mesh, pages_lib.stacked_spec(self.config))

  # ---- helpers -----------------------------------------------------------------------------
  def _grid(self, items, fill: int) -> tuple[np.ndarray, list[list]]:
    """Lays ``items`` (each with ``.shard`` or a leading shard) out as ``[shards, n]``."""
    per = [[] for _ in range(self.cache.num_shards)]
    for it in items:
      per[it[0]].append(it)
    n = bucket(max(len(p) for p in per))
    return np.full((self.cache.num_shards, n), fill, np.int32), per

  def _gather_device(self, pools, blocks) -> tuple[jax.Array, list[list]]:
    ids, per = self._grid(blocks, 0)
    for s, items in enumerate(per):
      ids[s, :len(items)] = [b[1] for b in items]
    stack = pages_lib.gather_stacked(pools, jax.device_put(ids, self._ids_sharding),
                                     mesh=self.mesh, config=self.config)
    return stack, per

  def _bytes(self, n: int) -> int:
    return n * self.config.page_bytes

  def warmup(self, pools, max_pages: int) -> list:
    """Compiles every transfer for each bucket up to ``max_pages`` pages per shard, with
    all-padding ids (nothing is read into or written over a page). Returns the pools."""
    shards = self.cache.num_shards
    n = MIN_BUCKET
    while shards > 1:  # copies between shards (destinations all padding: dropped)
      src = np.zeros((n,), np.int32)
      dst = np.full((n,), shards * self.config.pages_per_shard, np.int32)
      pools = pages_lib.copy_across_shards(pools, src, dst, mesh=self.mesh, config=self.config)
      if n >= max_pages:
        break
      n *= 2
    if self.host is None and self.disk is None:
      return list(pools)
    n = MIN_BUCKET
    while True:
      pad_dev = jax.device_put(np.full((shards, n), self.config.pages_per_shard, np.int32),
                               self._ids_sharding)
      stack = pages_lib.gather_stacked(pools, jax.device_put(np.zeros((shards, n), np.int32),
                                                             self._ids_sharding),
                                       mesh=self.mesh, config=self.config)
      if self.host is not None:
        pad_host = np.full((shards, n), self.host.pages_per_shard, np.int32)
        self.host.store(stack, pad_host)
        stack, _ = self.host.load(np.zeros((shards, n), np.int32))
        self.host.read_numpy(np.zeros((shards, n), np.int32))
        self.host.expected_checksums(pad_host)
      pools = pages_lib.scatter_stacked(pools, pad_dev, stack, mesh=self.mesh,
                                        config=self.config)
      jax.block_until_ready(pools)
      if n >= max_pages:
        return list(pools)
      n *= 2

  # ---- downwards ---------------------------------------------------------------------------
  def demote(self, pools, evicted: list[Block]) -> None:
    """Write-back of blocks just evicted from device pages (before the pages are reused)."""
    if self.host is not None:
      self._device_to_host(pools, [b for b in evicted
                                   if self.index.slot_of(b[0], b[2], Tier.HOST) is None])
    elif self.disk is not None:
      self._device_to_disk(pools, [b for b in evicted
                                   if self.index.slot_of(0, b[2], Tier.DISK) is None])

  def copy_down(self, pools, published: list[Block]) -> None:
    """Write-through: copies freshly published device blocks to every lower tier."""
    if self.host is not None:
      self._device_to_host(pools, [b for b in published
                                   if self.index.slot_of(b[0], b[2], Tier.HOST) is None])
    if self.disk is not None:
      self._device_to_disk(pools, [b for b in published
                                   if self.index.slot_of(0, b[2], Tier.DISK) is None])

  def _device_to_host(self, pools, blocks: list[Block]) -> None:
    if not blocks:
      return
    placed, host_victims, overflow = [], [], []
    for b in blocks:
      evicted = []
      slot = self.index.allocate(b[0], 1, Tier.HOST, evicted=evicted)
      if slot is None:  # every host slot of this shard is taken by blocks in flight
        overflow.append(b)
        continue
      host_victims.extend((b[0], p, k) for k, p in evicted)
      placed.append((b[0], b[1], b[2], slot[0]))
    if self.disk is not None:
      if host_victims:  # read them out before they are overwritten
        self._host_to_disk([v for v in host_victims
                            if self.index.slot_of(0, v[2], Tier.DISK) is None])
      self._device_to_disk(pools, [b for b in overflow
                                   if self.index.slot_of(0, b[2], Tier.DISK) is None])
    else:
      self.counters["host_full_drops"] += len(overflow)
    if not placed:
      return
    stack, per = self._gather_device(pools, placed)
    host_ids = np.full(stack_ids_shape(stack, self.cache.num_shards), self.host.pages_per_shard,
                       np.int32)
    for s, items in enumerate(per):
      host_ids[s, :len(items)] = [it[3] for it in items]
    self.host.store(stack, host_ids)
    for shard, _, key, slot in placed:
      self.index.publish(shard, slot, key, Tier.HOST, parent=self.index.parent_of(key))
      self.index.release(shard, [slot], Tier.HOST)
    self.counters["demoted_host"] += len(placed)
    self.counters["bytes_moved"] += self._bytes(len(placed))

  def _host_to_disk(self, blocks: list[Block]) -> None:
    """``blocks``: (shard, host slot, key) of host slots about to be overwritten."""
    if not blocks:
      return
    ids, per = self._grid(blocks, 0)
    for s, items in enumerate(per):
      ids[s, :len(items)] = [b[1] for b in items]
    stack = self.host.read_numpy(ids)
    self._write_disk(stack, per, ids.shape[1])

  def _device_to_disk(self, pools, blocks: list[Block]) -> None:
    if not blocks:
      return
    stack, per = self._gather_device(pools, blocks)
    self._write_disk(to_host(stack), per, stack.shape[2] // self.cache.num_shards)

  def _write_disk(self, stack: np.ndarray, per: list[list], n: int) -> None:
    for s, items in enumerate(per):
      for i, b in enumerate(items):
        key = b[2]
        if self.index.slot_of(0, key, Tier.DISK) is not None:
          continue
        slot = self.index.allocate(0, 1, Tier.DISK)
        if slot is None:
          self.counters["disk_full_drops"] += 1
          continue
        payload = np.ascontiguousarray(stack[:, :, s * n + i]).view(self.config.jnp_dtype)
        self._pending_writes.append(self.disk.write(slot[0], payload, key,
                                                    self.index.parent_of(key)))
        self.counters["bytes_moved"] += self._bytes(1)
    self.pump()

  def pump(self) -> None:
    """Publishes disk writes that committed; releases the slots of failed ones."""
    still = []
    for w in self._pending_writes:
      if not w.future.done():
        still.append(w)
        continue
      self._finish_write(w)
    self._pending_writes = still

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits (up to ``timeout_s``) for every disk write; returns how many are left."""
    t_end = time.monotonic() + timeout_s
    for w in self._pending_writes:
      try:
        w.future.result(timeout=max(0.0, t_end - time.monotonic()))
      except Exception:  # pylint: disable=broad-except  (handled in _finish_write)
        pass
    self.pump()
    return len(self._pending_writes)

  def _finish_write(self, w) -> None:
    try:
      w.future.result(timeout=0)
      ok = True
    except Exception:  # pylint: disable=broad-except
      ok = False
    if ok:
      self.index.publish(0, w.slot, w.key, Tier.DISK, parent=w.parent)
      self.counters["demoted_disk"] += 1
    else:
      self.counters["disk_write_failures"] += 1
    self.index.release(0, [w.slot], Tier.DISK)

  # ---- upwards -----------------------------------------------------------------------------
  def promote(self, pools, fetches: list[Fetch], deadline_s: float):
    """Copies lower-tier blocks into device pages and verifies them. Returns new pools."""
    pools, pending = self.start_promote(pools, fetches)
    return self.finish_promote(pools, pending, time.monotonic() + deadline_s)

  def start_promote(self, pools, fetches: list[Fetch]):
    """Issues every fetch without waiting: disk reads go in flight, host copies are
    dispatched. Returns ``(pools, pending)``; compute dispatched meanwhile overlaps."""
    host = [f for f in fetches if f.tier == Tier.HOST]
    disk = [f for f in fetches if f.tier == Tier.DISK]
    reads = [(f, self.disk.read(f.slot)) for f in disk]  # all disk reads in flight at once
    host_check = None
    t0 = time.perf_counter()
    shard = [f for f in fetches if f.tier == Tier.SHARD]
    if shard:  # device to device inside the job: a collective, no verification needed
      pools = self._promote_shard(pools, shard)
    if host:
      pools, host_check = self._promote_host(pools, host)
    return pools, (fetches, reads, host_check, t0)

  def _promote_shard(self, pools, fetches: list[Fetch]):
    per_shard = self.config.pages_per_shard
    n = bucket(len(fetches))
    src = np.zeros((n,), np.int32)
    dst = np.full((n,), self.cache.num_shards * per_shard, np.int32)  # padding: dropped
    for i, f in enumerate(fetches):
      src_shard, src_page = f.slot
      src[i], dst[i] = src_shard * per_shard + src_page, f.shard * per_shard + f.page
      f.ok = True
    return pages_lib.copy_across_shards(pools, src, dst, mesh=self.mesh, config=self.config)

  def release_pin(self, f: Fetch) -> None:
    """Drops the reference a fetch took at admission on its source."""
    if f.tier == Tier.SHARD:
      self.index.release(f.slot[0], [f.slot[1]], Tier.DEVICE)
    elif f.tier in LOCAL_TIERS:
      self.index.release(f.shard, [f.slot], f.tier)

  def _promote_remote(self, pools, fetches: list[Fetch], t_end: float):
    """Pulls each request's remote blocks (one offer per request and peer), verifies them
    and scatters them into their device pages."""
    groups: dict = {}
    for f in fetches:
      groups.setdefault((id(f.owner), f.slot), []).append(f)
    n_arrays, heads, page, dim = self.cache.payload_shape
    items = []
    for (_, peer), group in groups.items():
      group.sort(key=lambda f: f.block)
      client = self.cache.remotes[peer]
      try:
        stack = client.fetch([f.key for f in group], self.cache.payload_shape,
                             self.config.jnp_dtype, t_end)
      except Exception as e:  # pylint: disable=broad-except  (any failed pull is a miss)
        for f in group:
          f.reason = getattr(e, "reason", "remote")
        continue
      for i, f in enumerate(group):
        f.ok = True
        items.append((f.shard, f.page, stack[i]))
    if not items:
      return pools
    dest, per = self._grid(items, self.config.pages_per_shard)
    n = dest.shape[1]
    staged = np.zeros((n_arrays, heads, self.cache.num_shards * n, page, dim),
                      pages_lib.bits_dtype(self.config.jnp_dtype))
    for s, its in enumerate(per):
      for i, (_, page_id, block) in enumerate(its):
        staged[:, :, s * n + i] = block
        dest[s, i] = page_id
    return pages_lib.scatter_stacked(pools, jax.device_put(dest, self._ids_sharding),
                                     jax.device_put(staged, self._stack_sharding),
                                     mesh=self.mesh, config=self.config)

  def finish_promote(self, pools, pending, t_end: float):
    """Waits (until ``t_end``, monotonic) for the fetches of ``start_promote``, verifies
    them and scatters the disk ones. Sets ``ok``/``reason`` on every fetch; the caller
    truncates each request's hit at its first failed block and calls ``drop_failed``."""
    fetches, reads, host_check, t_start = pending
    t_wait = time.perf_counter()
    if host_check is not None:
      self._verify_host(*host_check)
    if reads:
      pools = self._promote_disk(pools, reads, t_end)
    remote = [f for f in fetches if f.tier == Tier.REMOTE]
    if remote:
      pools = self._promote_remote(pools, remote, t_end)
    jax.block_until_ready(pools)
    t_done = time.perf_counter()
    self.counters["fetch_wait_s"] += t_done - t_wait
    self.counters["fetch_s"] += t_done - t_start
    for f in fetches:
      self.release_pin(f)  # the pin taken at admission
    ok = sum(f.ok for f in fetches)
    self.counters["blocks_fetched"] += ok
    self.counters["bytes_moved"] += self._bytes(ok)
    self.last_fetch = {"blocks": ok, "bytes": self._bytes(ok), "seconds": t_done - t_start,
                       "tiers": sorted({int(f.tier) for f in fetches})}
    return pools

  def _promote_host(self, pools, fetches: list[Fetch]):
    items = [(f.shard, f.slot, f.page, f) for f in fetches]
    host_ids, per = self._grid(items, self.host.pages_per_shard)
    dest = np.full(host_ids.shape, self.config.pages_per_shard, np.int32)  # pad: dropped
    for s, its in enumerate(per):
      host_ids[s, :len(its)] = [it[1] for it in its]
      dest[s, :len(its)] = [it[2] for it in its]
    stack, sums = self.host.load(host_ids)
    pools = pages_lib.scatter_stacked(pools, jax.device_put(dest, self._ids_sharding), stack,
                                      mesh=self.mesh, config=self.config)
    return pools, (host_ids, per, sums)

  def _verify_host(self, host_ids, per, sums) -> None:
    expected = self.host.expected_checksums(host_ids)
    got = to_host(sums).reshape(expected.shape)
    for s, its in enumerate(per):
      for i, it in enumerate(its):
        f = it[3]
        f.ok = bool((got[s, i] == expected[s, i]).all())
        f.reason = "" if f.ok else "checksum"

  def _promote_disk(self, pools, reads, t_end: float):
    n_arrays, heads, page, dim = self.cache.payload_shape
    items = [(f.shard, f.page, f, r) for f, r in reads]
    dest, per = self._grid(items, self.config.pages_per_shard)
    n = dest.shape[1]
    stack = np.zeros((n_arrays, heads, self.cache.num_shards * n, page, dim),
                     pages_lib.bits_dtype(self.config.jnp_dtype))
    any_ok = False
    for s, its in enumerate(per):
      for i, (_, page_id, f, r) in enumerate(its):
        try:
          record = r.future.result(timeout=max(0.0, t_end - time.monotonic()))
          stack[:, :, s * n + i] = self.disk.verify(record, f.key).view(stack.dtype)
          f.ok, any_ok = True, True
          dest[s, i] = page_id
        except TimeoutError:
          f.reason = "deadline"
          r.future.cancel()
        except Exception as e:  # pylint: disable=broad-except  (any failed read is a miss)
          f.reason = getattr(e, "reason", "read_error")
    if any_ok:
      staged = jax.device_put(stack, self._stack_sharding)  # lands per shard, in place
      pools = pages_lib.scatter_stacked(pools, jax.device_put(dest, self._ids_sharding), staged,
                                        mesh=self.mesh, config=self.config)
    return pools

  def drop_failed(self, fetch: Fetch) -> None:
    """Records a failed fetch and drops the bad copy and the chain after it."""
    self.failures[fetch.reason] += 1
    self.counters["verify_failures"] += fetch.reason not in ("deadline", "breaker", "io",
                                                             "refused", "closed", "pull")
    self.counters["read_timeouts"] += fetch.reason == "deadline"
    if fetch.tier == Tier.REMOTE:
      self.counters["remote_failures"] += 1
      return  # nothing of ours to drop: the peer's copy is the peer's
    shard = 0 if fetch.tier == Tier.DISK else fetch.shard
    self.index.drop_chain(shard, fetch.key, fetch.tier)
    if fetch.tier == Tier.DISK and fetch.reason != "deadline":
      self.disk.delete(fetch.slot)


def stack_ids_shape(stack: jax.Array, num_shards: int) -> tuple[int, int]:
  return (num_shards, stack.shape[2] // num_shards)
