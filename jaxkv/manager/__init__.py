"""The cache manager: what is cached where, decided on the host, with no JAX.

The manager is the host-side half of a ``KVCache``. It holds the ``PrefixIndex`` (which
slot of which tier holds which block, with the chain between blocks), the references that
keep blocks in place (a request's pages, a fetch's source, a ``hold`` on a prefix), and the
decisions that change them: allocating device pages (evicting the least valuable cached
blocks), releasing pins. What such a decision needs moved comes back as a value: the blocks
an allocation evicted are returned beside its pages, and the scheduler puts them in the
step's ``TierOrders`` for the cache worker, which alone touches pools and tiers
(``jaxkv.worker.transfers``, ``jaxkv.cache``).

The scheduler and admission see only this object (never the pools, tiers or mover),
so they can be built and tested with no model, no mesh and no device.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Sequence

import numpy as np

from jaxkv.errors import CapacityError, InputError
from jaxkv.manager.index import LOCAL_TIERS, PrefixIndex, Tier
from jaxkv.scheduling.step import Block

if typing.TYPE_CHECKING:
  from jaxkv.stats import Stats
  from jaxkv.worker.tiers.base import Fetch


class CacheManager:
  """Host-side bookkeeping of one cache: its index, pins, allocation and eviction.

  ``disk_attached``: asks the cache worker whether the disk tier is attached now (it
  detaches for a cool-down after repeated failures; a lookup then leaves it out).
  ``remote``: the remote tier's prefix lookup (``longest_prefix``), or None.
  """

  def __init__(self, index: PrefixIndex, *, stats: Stats, page_bytes: int,
               write_through: bool, has_disk: bool,
               disk_attached: Callable[[], bool] = lambda: True, remote=None):
    self.index, self.stats = index, stats
    self.num_shards, self.page_size, self.page_bytes = (index.num_shards, index.page_size,
                                                        page_bytes)
    self.write_through, self.has_disk = write_through, has_disk
    self.remote = remote
    self._disk_attached = disk_attached
    self._pins: dict = {}  # (tenant, last key) -> [[(shard, pages), ...] per hold]

  def set_remote(self, remote) -> None:
    """The remote tier whose ``longest_prefix`` lookups admission asks (opened with the
    cache's tiers, once the model is known)."""
    self.remote = remote

  # ---- lookups ---------------------------------------------------------------------------------
  def lookup_tiers(self) -> tuple[Tier, ...]:
    """The local tiers a lookup may hit now (a detached disk tier holds nothing meanwhile)."""
    if not self.has_disk or self._disk_attached():
      return LOCAL_TIERS
    return (Tier.DEVICE, Tier.HOST)

  # ---- allocation ------------------------------------------------------------------------------
  def allocate_pages(self, shard: int, n: int) -> tuple[list[int] | None, tuple[Block, ...]]:
    """``n`` device pages on ``shard`` (referenced), evicting unreferenced cached blocks
    (reused ones last). Returns ``(pages, evicted)``: ``pages`` None when the shard cannot
    give them now (then nothing was evicted); ``evicted`` the blocks whose pages were taken,
    whose bytes are still there until the step that uses the pages writes them, so a
    write-back copy ordered in that step's ``TierOrders.demote`` comes first."""
    evicted: list = []
    pages = self.index.allocate(shard, n, Tier.DEVICE, evicted=evicted)
    return pages, tuple((shard, p, k) for k, p in evicted)

  def release_pin(self, f: Fetch) -> None:
    """Drops the reference a fetch took at admission on its source (one the plan will
    not make)."""
    release_pin(self.index, f)

  # ---- residency -------------------------------------------------------------------------------
  def hold(self, tokens: Sequence[int], tenant: str) -> int:
    """Takes a reference on a prefix's full blocks on every data shard (all must be on
    device there), so no eviction touches them until ``release_hold``. Returns the number
    of blocks held per shard."""
    keys = self.index.block_keys(np.asarray(tokens, np.int32), tenant)
    held = []
    try:
      for s in range(self.num_shards):
        pages = self.index.match(s, keys)
        if len(pages) < len(keys):
          raise CapacityError(f"could not keep {len(keys)} blocks on shard {s}.")
        self.index.acquire(s, pages)
        held.append((s, pages))
    except BaseException:
      for s, pages in held:
        self.index.release(s, pages)
      raise
    self._pins.setdefault((tenant, keys[-1]), []).append(held)
    return len(keys)

  def release_hold(self, tokens: Sequence[int], tenant: str) -> None:
    """Releases one ``hold`` of the same prefix."""
    keys = self.index.block_keys(np.asarray(tokens, np.int32), tenant)
    held = self._pins.get((tenant, keys[-1]) if keys else None)
    if not held:
      raise InputError("unpin of a prefix that is not pinned (same tokens and tenant as pin).")
    for s, pages in held.pop():
      self.index.release(s, pages)

  def unreferenced_device_blocks(self) -> list[Block]:
    """Every cached device block no request, fetch or hold references (``offload``)."""
    index, out = self.index, []
    for s in range(self.num_shards):
      for key in index.cached_keys(s, Tier.DEVICE):
        page = index.slot_of(s, key, Tier.DEVICE)
        if index.refcount(s, page) == 0:
          out.append((s, page, key))
    return out

  def forget_device_blocks(self) -> int:
    """Forgets every unreferenced cached device block (its page becomes free): after
    ``offload`` copied them down, or after a failed step lost the pools' bytes. Returns
    how many were forgotten."""
    return sum(self.index.evict_all_unreferenced(s, Tier.DEVICE)
               for s in range(self.num_shards))

  def adopt_disk(self, records: Sequence[tuple[int, bytes, bytes | None]]) -> None:
    """Blocks a previous run left on disk (``(slot, key, parent)``, verified by the
    worker's scan) come back into the index, unreferenced."""
    for slot, key, parent in records:
      self.index.acquire(0, [slot], Tier.DISK)
      self.index.publish(0, slot, key, Tier.DISK, parent=parent)
      self.index.release(0, [slot], Tier.DISK)


def release_pin(index: PrefixIndex, f: Fetch) -> None:
  """Drops the reference fetch ``f`` took at admission on its source (another shard's
  device page, or a local tier's slot; a remote source holds none)."""
  if f.tier == Tier.SHARD:
    index.release(f.slot[0], [f.slot[1]], Tier.DEVICE)
  elif f.tier in LOCAL_TIERS:
    index.release(f.shard, [f.slot], f.tier)
