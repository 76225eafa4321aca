"""HOST tier: a preallocated page pool in host memory, sharded like the device pool.

The pool is one array ``[2 * layers, kv_heads, data_shards * host_pages, page_size,
head_dim]`` on the ``pinned_host`` (or ``unpinned_host``) memory kind with sharding
``P(None, model, data, None, None)``: every data shard's host pages sit beside the
devices that use them, with shard-local ids like the device pool.

Moves, all dispatched asynchronously from the one thread that runs the engine:
- store (device -> host): a jitted shard-local gather of the victim pages on device, an
  async transfer of that stack to the host memory kind, and a scatter into the host pool
  that runs *as a host computation* (``compute_on('device_host')``) on the donated pool,
  so the pool is updated in place and no model computation ever reads host memory.
- load (host -> device): the mirror: a host-side gather into a small stack, a transfer to
  device memory; the caller scatters it into the device pool (donated).
Each stored page's checksum (``pages.page_checksums``, computed on device from the bytes
that were sent) is kept per slot and compared with the checksum of the bytes that come
back, so a page that changed in host memory is never used.
"""

from __future__ import annotations

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


# JAX up to 0.10 gives ``compute_on`` as a context manager; from 0.11 it wraps a function
# and names its outputs' memory space.
_COMPUTE_ON_WRAPS = "out_memory_spaces" in inspect.signature(compute_on).parameters


def on_host(fn):
  """``fn`` run as a host computation (``compute_on('device_host')``), its outputs in host
  memory."""
  if _COMPUTE_ON_WRAPS:
    return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)

  def run(*args):
    with compute_on("device_host"):  # pylint: disable=not-context-manager
      return fn(*args)
  return run


@functools.lru_cache(maxsize=None)
def host_fns(mesh: Mesh, config: CacheConfig, memory_kind: str):
  """The jitted ``(store, load, read)`` of a host pool in ``memory_kind``: device stack ->
  host slots, host slots -> device stack, host slots -> host stack (``HostTier`` runs
  them; ``jaxkv.tools.lowering`` lowers them for other platforms)."""
  stack = pages_lib.stacked_spec(config)
  ids_spec = P(config.data_axis, None)
  host = NamedSharding(mesh, stack).with_memory_kind(memory_kind)
  host_ids = NamedSharding(mesh, ids_spec).with_memory_kind(memory_kind)
  device = NamedSharding(mesh, stack)

  def local_scatter(pool, ids, values):
    return pool.at[:, :, ids[0]].set(values, mode="drop")

  def local_gather(pool, ids):
    return pool[:, :, ids[0]]

  scatter = jax.shard_map(local_scatter, mesh=mesh, in_specs=(stack, ids_spec, stack),
                          out_specs=stack)
  gather = jax.shard_map(local_gather, mesh=mesh, in_specs=(stack, ids_spec), out_specs=stack)

  def store(pool, ids, values):
    values = jax.device_put(values, host)  # the device -> host transfer
    ids = jax.device_put(ids, host_ids)
    return on_host(scatter)(pool, ids, values)

  def load(pool, ids):
    ids = jax.device_put(ids, host_ids)
    part = on_host(gather)(pool, ids)
    return jax.device_put(part, device)  # the host -> device transfer

  def read(pool, ids):
    ids = jax.device_put(ids, host_ids)
    return on_host(gather)(pool, ids)

  return (jax.jit(store, donate_argnums=(0,), out_shardings=host),
          jax.jit(load, out_shardings=device), jax.jit(read, out_shardings=host))


class HostTier:
  """The host page pool of every data shard of this process (a ``FetchSource``)."""

  tier = Tier.HOST

  def __init__(self, mesh: Mesh, config: CacheConfig, tiers: TierConfig, num_arrays: int):
    self.mesh, self.config = mesh, config
    self.memory_kind = tiers.host_memory_kind
    self.pages_per_shard = tiers.host_pages_per_shard
    self.num_shards = pages_lib.data_shards(mesh, config)
    shape = (num_arrays, config.num_kv_heads, self.num_shards * self.pages_per_shard,
             config.page_size, config.head_dim)
    sharding = NamedSharding(mesh, pages_lib.stacked_spec(config)).with_memory_kind(
        self.memory_kind)
    # Raw bits (see pages.bits_dtype): a host copy never changes a NaN payload.
    self.pool = jax.jit(lambda: jnp.zeros(shape, pages_lib.bits_dtype(config.jnp_dtype)),
                        out_shardings=sharding)()
    self._store, self._load, self._read = host_fns(mesh, config, self.memory_kind)
    # Checksum of every slot's bytes as sent (device arrays until first needed).
    model = mesh.shape[config.model_axis]
    self._checksums = np.zeros((self.num_shards, self.pages_per_shard, model), np.uint32)
    self._pending: list = []  # (slots per shard, device checksum array) not yet fetched

  @property
  def nbytes(self) -> int:
    return self.pool.nbytes

  def store(self, stack: jax.Array, host_ids: np.ndarray) -> None:
    """Writes a device stack of raw bits (``pages.gather_stacked``) into host slots.

    ``host_ids``: ``[data_shards, n]`` shard-local host slots; ids ``>= host pages``
    (padding) are dropped.
    """
    ids = jax.device_put(host_ids.astype(np.int32), NamedSharding(
        self.mesh, P(self.config.data_axis, None)))
    self._pending.append((host_ids, self.checksums(stack)))
    self.pool = self._store(self.pool, ids, stack)

  def load(self, host_ids: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """Starts copying host slots to device. Returns ``(bits stack, checksums)`` (async)."""
    ids = jax.device_put(host_ids.astype(np.int32), NamedSharding(
        self.mesh, P(self.config.data_axis, None)))
    stack = self._load(self.pool, ids)
    return stack, self.checksums(stack)

  def checksums(self, stack: jax.Array) -> jax.Array:
    return pages_lib.page_checksums(stack, mesh=self.mesh, config=self.config)

  def read_numpy(self, host_ids: np.ndarray) -> np.ndarray:
    """Host slots ``[data_shards, n]`` as a numpy raw-bits stack (blocks until copied)."""
    ids = jax.device_put(host_ids.astype(np.int32), NamedSharding(
        self.mesh, P(self.config.data_axis, None)))
    return to_host(self._read(self.pool, ids))

  def expected_checksums(self, host_ids: np.ndarray) -> np.ndarray:
    """Checksums recorded for ``host_ids`` ``[data_shards, n]`` when they were stored:
    ``[data_shards, n, model]``, laid out like ``np.asarray(checksums(...))`` reshaped."""
    self._settle()
    out = np.zeros((*host_ids.shape, self._checksums.shape[2]), np.uint32)
    for s in range(host_ids.shape[0]):
      valid = host_ids[s] < self.pages_per_shard
      out[s, valid] = self._checksums[s, host_ids[s, valid]]
    return out

  # ---- FetchSource -------------------------------------------------------------------------
  def start_fetch(self, fetches: list[Fetch]) -> tuple[Landing, tuple]:
    """Dispatches the copy of every fetched slot to device (async) and the checksums of
    what arrives; the pages can be scattered now, they are verified in ``finish_fetch``."""
    host_ids, per = buckets.shard_ids(list(enumerate(fetches)), self.num_shards,
                                      self.pages_per_shard, lambda p: p[1].slot,
                                      shard_of=lambda p: p[1].shard)
    dest = np.full(host_ids.shape, self.config.pages_per_shard, np.int32)  # padding: dropped
    for s, items in enumerate(per):
      dest[s, :len(items)] = [f.page for _, f in items]
    stack, sums = self.load(host_ids)
    return Landing(dest, stack), (len(fetches), host_ids, per, sums)

  def finish_fetch(self, pending: tuple, t_end: float, stage=None) -> FetchOutcome:
    """Compares the checksums of the bytes that arrived with those recorded at store time
    (``t_end`` is unused: the device copy was dispatched already and cannot be late). The
    blocks landed in ``start_fetch``; one that fails here is in its page but never used."""
    del t_end, stage
    n, host_ids, per, sums = pending
    expected = self.expected_checksums(host_ids)
    got = to_host(sums).reshape(expected.shape)
    failures: list[Failure | None] = [None] * n
    for s, items in enumerate(per):
      for i, (position, _) in enumerate(items):
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
