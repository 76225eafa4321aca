"""Where every copy down goes: the manager's half of a plan's tier orders.

The scheduler decides *what* moves (``TierOrders.write_through``: blocks a step published;
``TierOrders.demote``: blocks whose device pages an allocation took) and the worker only
copies. Everything between is decided here, on the host, from the index alone:

- a device block goes to a host slot taken now (``to_host``); the cached host blocks that
  slot allocation evicts are read out before they are overwritten (``host_out``): this is
  the cascade, decided as orders, not while copying;
- with no host tier, or none of the shard's host slots free (all in flight), a device block
  goes below the host directly (``device_out``), and a write-through copy goes there too;
- every block going below the host is written to a disk slot taken now (``to_disk``; the
  records of the blocks evicted from those slots are deleted: ``drop``) unless the store has
  it, is writing it or is detached, and is put in the pool (``to_pool``).

A slot taken here stays referenced until the worker reports the copy
(``CacheManager.copied``) or its failure (``CacheManager.copy_failed``), so no other
allocation can take it meanwhile. Resolving is deterministic: every process of a job holds
the same index and resolves the same orders alike.
"""

from __future__ import annotations

import typing
from collections.abc import Callable

from jaxkv.manager.index import Tier
from jaxkv.scheduling.step import Block, Copy, TierOrders

if typing.TYPE_CHECKING:
  from jaxkv.manager import CacheManager


class CopyPlanner:
  """Chooses the destination slot of every copy down for one cache's manager."""

  def __init__(self, manager: CacheManager, *, has_host: bool, has_disk: bool,
               has_pool: bool, disk_attached: Callable[[], bool]):
    self.manager, self.index, self.stats = manager, manager.index, manager.stats
    self.has_host, self.has_disk, self.has_pool = has_host, has_disk, has_pool
    self._disk_attached = disk_attached
    self.writing: set[bytes] = set()  # keys given a disk slot whose write is not settled

  def resolve(self, orders: TierOrders) -> TierOrders:
    """``orders`` with the destination of each copy chosen (slots taken); resolved orders
    come back unchanged."""
    if orders.resolved:
      return orders
    to_host, host_out, device_out = self._host_copies(orders)
    to_disk, to_pool, drop = self._lower_copies(host_out + device_out)
    lower = {k for k, _ in to_disk} | set(to_pool)  # read out only what goes somewhere
    host_out = tuple(b for b in host_out if b[2] in lower)
    device_out = tuple(b for b in device_out if b[2] in lower)
    return TierOrders(drop=orders.drop + drop, write_through=orders.write_through,
                      demote=orders.demote, pump=orders.pump, resolved=True,
                      to_host=to_host, host_out=host_out, device_out=device_out,
                      to_disk=to_disk, to_pool=to_pool)

  def evicted_from(self, shard: int, tier: Tier, evicted: tuple) -> TierOrders:
    """The orders that keep what an allocation outside a plan evicted (``(key, slot)`` of
    ``tier`` on ``shard``): device blocks copied down as a demote is, host blocks read out to
    the disk and the pool, disk records deleted."""
    if not evicted:
      return TierOrders(resolved=True)
    if tier == Tier.DEVICE:
      return self.resolve(TierOrders(demote=tuple((shard, p, k) for k, p in evicted)))
    if tier == Tier.DISK:
      return TierOrders(drop=tuple(k for k, _ in evicted), resolved=True)
    host_out = tuple((shard, s, k) for k, s in evicted)
    to_disk, to_pool, drop = self._lower_copies(host_out)
    return TierOrders(drop=drop, resolved=True, host_out=host_out, to_disk=to_disk,
                      to_pool=to_pool)

  def settled(self, key: bytes) -> None:
    """A disk write of ``key`` was published or given up."""
    self.writing.discard(key)

  def _host_copies(self, orders: TierOrders) -> tuple[tuple, tuple, tuple]:
    """``(to_host, host_out, device_out)``: host slots for the device blocks the host lacks
    (a block both published and evicted is copied once), the host blocks they evict, and
    what goes below the host directly."""
    if not self.has_host:
      return (), (), _unique(orders.write_through + orders.demote)
    to_host, host_out, overflow, placed = [], [], [], set()
    for b in orders.write_through + orders.demote:
      shard, page, key = b
      if (shard, key) in placed or self.index.slot_of(shard, key, Tier.HOST) is not None:
        continue
      slots, evicted = self.manager.allocate(shard, 1, Tier.HOST)
      if slots is None:  # every host slot of this shard holds a copy in flight
        overflow.append(b)
        continue
      host_out.extend((shard, slot, k) for k, slot in evicted)
      to_host.append(Copy(shard, page, key, slots[0]))
      placed.add((shard, key))
    if overflow and not (self.has_disk or self.has_pool):
      self.stats.add("host_full_drops", len(overflow))
      overflow = []
    return tuple(to_host), tuple(host_out), _unique(tuple(overflow) + orders.write_through)

  def _lower_copies(self, blocks: tuple) -> tuple[tuple, tuple, tuple]:
    """``(to_disk, to_pool, drop)`` for blocks going below the host: a disk slot for each
    the store lacks (the records evicted from those slots: ``drop``), and the pool."""
    keys = list(dict.fromkeys(b[2] for b in blocks))
    to_pool = tuple(keys) if self.has_pool else ()
    if not self.has_disk:
      return (), to_pool, ()
    missing = [k for k in keys
               if self.index.slot_of(0, k, Tier.DISK) is None and k not in self.writing]
    if missing and not self._disk_attached():
      self.stats.add("disk_detached_drops", len(missing))
      return (), to_pool, ()
    to_disk, drop = [], []
    for key in missing:
      slots, evicted = self.manager.allocate(0, 1, Tier.DISK)
      if slots is None:
        self.stats.add("disk_full_drops")
        continue
      drop.extend(k for k, _ in evicted)  # the index forgot them: nothing names the records
      to_disk.append((key, slots[0]))
      self.writing.add(key)
    return tuple(to_disk), to_pool, tuple(drop)


def _unique(blocks: tuple) -> tuple[Block, ...]:
  """``blocks`` with each key once (the first)."""
  return tuple({b[2]: b for b in reversed(blocks)}[k] for k in dict.fromkeys(b[2] for b in blocks))
