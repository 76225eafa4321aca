"""HOST tier: a preallocated page pool in host memory, sharded like the device pool.

The pool is one page-major array ``[data_shards * (host_pages + 1), 2 * layers, kv_heads,
page_size, head_dim]`` of raw bits on the ``pinned_host`` (or ``unpinned_host``) memory
kind with sharding ``P(data, None, model, None, None)`` (``pages.host_spec``): every data
shard's slots sit beside the devices that use them, with shard-local ids like the device
pool, and one block of one shard is one contiguous region. Each shard's last row
(local id ``host_pages``) is scratch: a store's padding is written there and never read.

No move computes on the host. Every one is one jitted program per bucket of blocks:
- store (device -> host): the blocks' pages gathered from the device pools on device,
  their checksums computed there from the same bytes, and each block sent to its slot by
  ``dynamic_update_slice`` of a host-bound copy into the donated pool (on an accelerator,
  an asynchronous copy straight into place: one transfer of exactly one block's bytes);
- load (host -> device): the mirror: each slot's block read by ``dynamic_slice`` into
  device memory (one transfer each), stacked on device, its checksums computed there.
Block counts are decomposed into power-of-two buckets of at most ``MOVE_BUCKET_MAX``
blocks per shard (``buckets.pieces``), so nothing but the blocks crosses the link; only
shards with fewer blocks than the busiest one in a bucket pad (into the scratch row).
Each stored page's checksum is kept per slot and compared with the checksum of the bytes
that come back, so a page that changed in host memory is never used.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.compute_on import compute_on
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxkv import buckets
from jaxkv.worker import pages as pages_lib
from jaxkv.config import CacheConfig, TierConfig
from jaxkv.distributed import to_host
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.base import Failure, Fetch, FetchOutcome, Landing

# A move's bucket holds at most this many blocks per shard (its staging on the way).
MOVE_BUCKET_MAX = 64

# JAX up to 0.10 gives ``compute_on`` as a context manager; from 0.11 it wraps a function
# and names its outputs' memory space.
_COMPUTE_ON_WRAPS = "out_memory_spaces" in inspect.signature(compute_on).parameters


def on_host(fn):
  """``fn`` run as a host computation (``compute_on('device_host')``), its outputs in host
  memory. No tier move uses it; a checkpoint's save and restore (rare, whole-pool) do."""
  if _COMPUTE_ON_WRAPS:
    return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)

  def run(*args):
    with compute_on("device_host"):  # pylint: disable=not-context-manager
      return fn(*args)
  return run


def _to_space(x, space):
  """``x`` moved to memory ``space`` inside a jitted function (a no-op where it is there:
  JAX types an ``unpinned_host`` operand as device memory)."""
  return x if jax.typeof(x).memory_space == space else jax.device_put(x, space)


def _place(pool, block, slot):
  """``block`` ``[2L, h, S, D]`` (device) into row ``slot`` of a host pool (local)."""
  return jax.lax.dynamic_update_slice_in_dim(
      pool, _to_space(block[None], jax.typeof(pool).memory_space), slot, axis=0)


def _take(pool, slot):
  """Row ``slot`` of a host pool (local), copied to device: ``[2L, h, S, D]``."""
  return _to_space(jax.lax.dynamic_slice_in_dim(pool, slot, 1, axis=0),
                   jax.memory.Space.Device)[0]


@dataclasses.dataclass(frozen=True)
class HostFns:
  """The jitted moves of a host pool (``HostTier`` runs them; ``jaxkv.tools.lowering``
  lowers them for other platforms). Each is specialised on its ids' width (the bucket).

  - ``stage(pools, page_ids) -> (blocks, sums)``: device pages of every pool gathered on
    device into page-major blocks ``[n, 2L, H, S, D]`` (each contiguous) and their
    checksums (``pages.page_checksums``' layout). Its own program: a step that reuses the
    pages waits for this gather only, never for the link.
  - ``place(pool, blocks, slots) -> pool``: staged blocks into host slots (pool donated),
    one transfer per block straight into place.
  - ``store(pool, stack, slots) -> pool``: a raw-bits device stack in the stacked layout
    (a checkpoint's rows, a stream's staged records) into host slots.
  - ``load(pool, slots) -> (blocks, sums)``: host slots -> page-major device blocks, one
    transfer per block, and their checksums.
  """

  stage: object
  place: object
  store: object
  load: object


@functools.lru_cache(maxsize=None)
def host_fns(mesh: Mesh, config: CacheConfig, memory_kind: str,
             ranks: tuple[int, ...]) -> HostFns:
  """The moves of a host pool in ``memory_kind`` beside device pools of ``ranks``."""
  host_spec, stack = pages_lib.host_spec(config), pages_lib.stacked_spec(config)
  ids, sums = P(config.data_axis, None), pages_lib.checksums_spec(config)
  pool_specs = tuple(pages_lib.pool_spec(config) if r == 4 else pages_lib.layer_stack_spec(config)
                     for r in ranks)
  model = mesh.shape[config.model_axis]
  host = NamedSharding(mesh, host_spec).with_memory_kind(memory_kind)
  on = lambda spec: NamedSharding(mesh, spec)

  def local_stage(pools, page_ids):
    blocks = pages_lib.local_gather_blocks(pools, page_ids, ranks)  # [n, 2L, h, S, D]
    return blocks, pages_lib.local_block_checksums(blocks, config, model)

  # One block per iteration of a loop of static trip count (the bucket): the pattern XLA
  # offloads activations with, so each iteration is one asynchronous copy; unrolled, the
  # program would compile in time linear in the bucket.
  def local_place(pool, blocks, slots):
    return jax.lax.fori_loop(0, slots.shape[1], lambda i, pool: _place(
        pool, jax.lax.dynamic_index_in_dim(blocks, i, keepdims=False), slots[0, i]), pool)

  def local_store(pool, values, slots):
    return local_place(pool, jnp.moveaxis(values, 2, 0), slots)

  def local_load(pool, slots):  # page-major blocks on device, and their checksums
    n = slots.shape[1]
    out = jnp.zeros((n, *pool.shape[1:]), pool.dtype)
    got = jax.lax.fori_loop(0, n, lambda i, out: jax.lax.dynamic_update_index_in_dim(
        out, _take(pool, slots[0, i]), i, axis=0), out)
    return got, pages_lib.local_block_checksums(got, config, model)

  def shard(fn, in_specs, out_specs):  # device_put to a memory space trips the vma check
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)

  return HostFns(
      stage=jax.jit(jax.shard_map(local_stage, mesh=mesh, in_specs=(pool_specs, ids),
                                  out_specs=(host_spec, sums)),
                    out_shardings=(on(host_spec), on(sums))),
      place=jax.jit(shard(local_place, (host_spec, host_spec, ids), host_spec),
                    donate_argnums=(0,), out_shardings=host),
      store=jax.jit(shard(local_store, (host_spec, stack, ids), host_spec),
                    donate_argnums=(0,), out_shardings=host),
      load=jax.jit(shard(local_load, (host_spec, ids), (host_spec, sums)),
                   out_shardings=(on(host_spec), on(sums))))


def _stacked_of(blocks, mesh: Mesh, config: CacheConfig):
  """Page-major device blocks as a stack in the device layout (a device transpose)."""
  return _to_stacked_fn(mesh, config)(blocks)


@functools.lru_cache(maxsize=None)
def _to_stacked_fn(mesh: Mesh, config: CacheConfig):
  return jax.jit(jax.shard_map(lambda b: jnp.moveaxis(b, 0, 2), mesh=mesh,
                               in_specs=pages_lib.host_spec(config),
                               out_specs=pages_lib.stacked_spec(config)))


@functools.lru_cache(maxsize=None)
def _stacked_fn(mesh: Mesh, config: CacheConfig, memory_kind: str):
  """A whole host pool in the stacked layout ``[2L, H, shards * host_pages, S, D]`` (host
  memory; its scratch rows left out): the form checkpoints save."""
  host_spec, stack = pages_lib.host_spec(config), pages_lib.stacked_spec(config)

  def local(pool):
    return jnp.moveaxis(pool[:-1], 0, 2)

  return jax.jit(on_host(jax.shard_map(local, mesh=mesh, in_specs=host_spec, out_specs=stack)),
                 out_shardings=NamedSharding(mesh, stack).with_memory_kind(memory_kind))


class HostTier:
  """The host page pool of every data shard of this process (a ``FetchSource``)."""

  tier = Tier.HOST

  def __init__(self, mesh: Mesh, config: CacheConfig, tiers: TierConfig, num_arrays: int):
    self.mesh, self.config = mesh, config
    self.memory_kind = tiers.host_memory_kind
    self.pages_per_shard = tiers.host_pages_per_shard
    self.num_shards = pages_lib.data_shards(mesh, config)
    shape = (self.num_shards * (self.pages_per_shard + 1), num_arrays, config.num_kv_heads,
             config.page_size, config.head_dim)
    sharding = NamedSharding(mesh, pages_lib.host_spec(config)).with_memory_kind(
        self.memory_kind)
    # Raw bits (see pages.bits_dtype): a host copy never changes a NaN payload.
    self.pool = jax.jit(lambda: jnp.zeros(shape, pages_lib.bits_dtype(config.jnp_dtype)),
                        out_shardings=sharding)()
    self._fns = host_fns(mesh, config, self.memory_kind, ())  # store and load
    self._ids = NamedSharding(mesh, P(config.data_axis, None))
    # Checksum of every slot's bytes as sent (device arrays until first needed).
    model = mesh.shape[config.model_axis]
    self._checksums = np.zeros((self.num_shards, self.pages_per_shard, model), np.uint32)
    self._pending: list = []  # (slots per shard, device checksum array) not yet fetched
    # The largest bucket a move uses (``warm`` lowers it to what it compiled).
    self.bucket_max = MOVE_BUCKET_MAX

  @property
  def nbytes(self) -> int:
    return self.pool.nbytes

  def _put_ids(self, ids: np.ndarray) -> jax.Array:
    return jax.device_put(np.asarray(ids, np.int32), self._ids)

  def _pieces(self, per: list[list]) -> list[tuple[int, int]]:
    """``(offset, size)`` buckets covering the longest of ``per``'s lists."""
    return buckets.pieces(max((len(p) for p in per), default=0), self.bucket_max)

  # ---- device -> host ------------------------------------------------------------------------
  def store_pages(self, pools, items: list[tuple[int, int, int]]) -> None:
    """Copies device pages into host slots: ``items`` ``(shard, device page, host slot)``.
    Dispatched, not waited for: later reads of the slots are ordered after it."""
    stage = host_fns(self.mesh, self.config, self.memory_kind,
                     pages_lib.pool_ranks(pools)).stage
    per: list[list] = [[] for _ in range(self.num_shards)]
    for shard, page, slot in items:
      per[shard].append((page, slot))
    for offset, size in self._pieces(per):
      page_ids = np.zeros((self.num_shards, size), np.int32)
      slots = np.full((self.num_shards, size), self.pages_per_shard, np.int32)  # scratch
      for s, its in enumerate(per):
        for i, (page, slot) in enumerate(its[offset:offset + size]):
          page_ids[s, i], slots[s, i] = page, slot
      blocks, sums = stage(tuple(pools), self._put_ids(page_ids))
      self.pool = self._fns.place(self.pool, blocks, self._put_ids(slots))
      self._pending.append((slots, sums))

  def store(self, stack: jax.Array, host_ids: np.ndarray) -> None:
    """Writes a device stack of raw bits (``pages.gather_stacked``) into host slots.

    ``host_ids``: ``[data_shards, n]`` shard-local host slots; ids ``>= host pages``
    (padding) go to the scratch row.
    """
    host_ids = np.minimum(np.asarray(host_ids, np.int32), self.pages_per_shard)
    self._pending.append((host_ids, self.checksums(stack)))
    self.pool = self._fns.store(self.pool, stack, self._put_ids(host_ids))

  # ---- host -> device ------------------------------------------------------------------------
  def load_blocks(self, host_ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Starts copying host slots ``[data_shards, n]`` to device. Returns ``(page-major
    blocks [data_shards * n, 2L, H, S, D], checksums)`` (async)."""
    return self._fns.load(self.pool, self._put_ids(np.minimum(host_ids, self.pages_per_shard)))

  def load(self, host_ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """``load_blocks`` as a stack in the device layout ``[2L, H, data_shards * n, S, D]``
    (``pages.gather_stacked``'s)."""
    blocks, sums = self.load_blocks(host_ids)
    return _stacked_of(blocks, self.mesh, self.config), sums

  def checksums(self, stack: jax.Array) -> jax.Array:
    return pages_lib.page_checksums(stack, mesh=self.mesh, config=self.config)

  def read_numpy(self, host_ids: np.ndarray) -> np.ndarray:
    """Host slots ``[data_shards, n]`` as a numpy raw-bits stack (blocks until copied):
    through device memory, in buckets (no computation runs on host memory)."""
    return self.read_later(host_ids)()

  def read_later(self, host_ids: np.ndarray):
    """``read_numpy`` in two halves: the copies out of the slots are issued now (ordered
    before any later store into them), and the returned function waits for them and
    assembles the numpy stack."""
    shards, n = host_ids.shape
    parts = [(offset, size, self.load_blocks(host_ids[:, offset:offset + size])[0])
             for offset, size in buckets.pieces(n, self.bucket_max)]

    def assemble() -> np.ndarray:
      out = None
      for offset, size, part in parts:
        got = to_host(part)  # [shards * size, 2L, H, S, D]
        if out is None:
          out = np.empty((got.shape[1], got.shape[2], shards * n, *got.shape[3:]), got.dtype)
        for s in range(shards):
          out[:, :, s * n + offset:s * n + offset + size] = np.moveaxis(
              got[s * size:(s + 1) * size], 0, 2)
      return out
    return assemble

  def stacked(self) -> jax.Array:
    """The whole pool as ``[2L, H, shards * host_pages, S, D]`` raw bits in host memory
    (what a checkpoint saves; a host computation: not for the serving path)."""
    return _stacked_fn(self.mesh, self.config, self.memory_kind)(self.pool)

  def expected_checksums(self, host_ids: np.ndarray) -> np.ndarray:
    """Checksums recorded for ``host_ids`` ``[data_shards, n]`` when they were stored:
    ``[data_shards, n, model]``, laid out like ``np.asarray(checksums(...))`` reshaped."""
    self._settle()
    out = np.zeros((*host_ids.shape, self._checksums.shape[2]), np.uint32)
    for s in range(host_ids.shape[0]):
      valid = host_ids[s] < self.pages_per_shard
      out[s, valid] = self._checksums[s, host_ids[s, valid]]
    return out

  def warm(self, pools, max_pages: int) -> list[int]:
    """Compiles every move bucket up to ``max_pages`` blocks per shard (moves of more go in
    several), all padding (the scratch row is written, slot 0 read): nothing a block lives
    in changes. Returns the bucket sizes (what a fetch lands in)."""
    shards, size, sizes = self.num_shards, 1, []
    top = self.bucket_max = min(buckets.pow2_at_least(max_pages), MOVE_BUCKET_MAX)
    while size <= top:
      self.store_pages(pools, [(s, 0, self.pages_per_shard) for s in range(shards)
                               for _ in range(size)])
      jax.block_until_ready(self.load(np.zeros((shards, size), np.int32)))
      sizes.append(size)
      size *= 2
    return sizes

  # ---- FetchSource -------------------------------------------------------------------------
  def start_fetch(self, fetches: list[Fetch], drop: int | None = None
                  ) -> tuple[list[Landing], tuple]:
    """Dispatches the copy of every fetched slot to device (async, in buckets) and the
    checksums of what arrives; the pages can be scattered now, they are verified in
    ``finish_fetch``. ``drop``: the page id a landing's padding goes to, none of the
    destination pool's (default: the block pool's ``pages_per_shard``)."""
    per: list[list] = [[] for _ in range(self.num_shards)]
    for position, f in enumerate(fetches):
      per[f.shard].append((position, f))
    landings, loads = [], []
    for offset, size in self._pieces(per):
      slots = np.zeros((self.num_shards, size), np.int32)  # padding reads slot 0
      dest = np.full((self.num_shards, size),
                     self.config.pages_per_shard if drop is None else drop, np.int32)  # dropped
      where = [its[offset:offset + size] for its in per]
      for s, its in enumerate(where):
        slots[s, :len(its)] = [f.slot for _, f in its]
        dest[s, :len(its)] = [f.page for _, f in its]
      blocks, sums = self.load_blocks(slots)
      landings.append(Landing(dest, blocks, blocks=True))
      loads.append((slots, where, sums))
    return landings, (len(fetches), loads)

  def finish_fetch(self, pending: tuple, t_end: float, stage=None) -> FetchOutcome:
    """Compares the checksums of the bytes that arrived with those recorded at store time
    (``t_end`` is unused: the device copy was dispatched already and cannot be late). The
    blocks landed in ``start_fetch``; one that fails here is in its page but never used."""
    del t_end, stage
    n, loads = pending
    failures: list[Failure | None] = [None] * n
    for slots, where, sums in loads:
      expected = self.expected_checksums(slots)
      got = to_host(sums).reshape(expected.shape)
      for s, its in enumerate(where):
        for i, (position, _) in enumerate(its):
          if not (got[s, i] == expected[s, i]).all():
            failures[position] = Failure.CHECKSUM
    return FetchOutcome(None, tuple(failures))

  def _settle(self) -> None:
    for ids, sums in self._pending:
      sums = to_host(sums).reshape(*ids.shape, -1)
      for s in range(ids.shape[0]):
        valid = ids[s] < self.pages_per_shard
        self._checksums[s, ids[s, valid]] = sums[s, valid]
    self._pending.clear()
