"""Where copies go: the manager resolves every order's destination, the cascade included.

Host only: a real ``PrefixIndex`` and ``CacheManager``, no model, no device. The worker's
half (copying what it is told) is exercised by the tier tests; here each expectation is
counted by hand from the index's capacity.
"""

import pytest

from jaxkv.manager import CacheManager
from jaxkv.manager.index import PrefixIndex, Tier
from jaxkv.scheduling.step import Copy, TierOrders
from jaxkv.stats import Stats


def _manager(*, host=2, disk=0, pool=False, attached=lambda: True, write_through=False):
  index = PrefixIndex(num_shards=2, pages_per_shard=8, page_size=4, fingerprint=b"f" * 32,
                      host_pages_per_shard=host, disk_slots=disk)
  return CacheManager(index, stats=Stats(), page_bytes=64, write_through=write_through,
                      has_disk=bool(disk), has_pool=pool, disk_attached=attached)


def _device_blocks(m, shard, n, first=0):
  """``n`` cached, unreferenced device blocks on ``shard``: (shard, page, key)."""
  pages, _ = m.allocate(shard, n)
  keys = [bytes([first + i]) * 32 for i in range(n)]
  for p, k in zip(pages, keys):
    m.publish(shard, p, k)
  m.release(shard, pages)
  return [(shard, p, k) for p, k in zip(pages, keys)]


def _report(m, orders):
  """What the worker does with resolved orders: every copy reported as made."""
  for c in orders.to_host:
    m.copied(c.shard, c.dst, c.key, Tier.HOST)
  for key, slot in orders.to_disk:
    m.copied(0, slot, key, Tier.DISK)


def test_demoted_blocks_get_host_slots_and_the_host_victims_cascade_to_disk_slots():
  m = _manager(host=2, disk=8)
  blocks = _device_blocks(m, 1, 5)
  first = m.resolve(TierOrders(demote=tuple(blocks[:2])))
  assert first.resolved and [c.key for c in first.to_host] == [b[2] for b in blocks[:2]]
  assert first.host_out == first.device_out == first.to_disk == ()
  _report(m, first)
  second = m.resolve(TierOrders(demote=tuple(blocks[2:])))
  # Two host slots: blocks 2 and 3 take them, evicting blocks 0 and 1, which are read out
  # to disk slots first; block 4 finds both host slots in flight and goes straight down.
  assert [(c.shard, c.src, c.key) for c in second.to_host] == [b for b in blocks[2:4]]
  assert sorted(b[2] for b in second.host_out) == sorted(b[2] for b in blocks[:2])
  assert [b[2] for b in second.device_out] == [blocks[4][2]]
  assert sorted(k for k, _ in second.to_disk) == sorted(b[2] for b in blocks[:2] + blocks[4:])
  assert len({slot for _, slot in second.to_disk}) == 3  # three distinct disk slots, taken
  assert sum(m.index.held_slots(0, Tier.DISK).values()) == 3
  _report(m, second)
  assert [m.index.slot_of(1, b[2], Tier.HOST) is not None for b in blocks] == [0, 0, 1, 1, 0]
  assert [m.index.slot_of(0, b[2], Tier.DISK) is not None for b in blocks] == [1, 1, 0, 0, 1]
  assert not m.index.held_slots(0, Tier.DISK) and not m.index.held_slots(1, Tier.HOST)


def test_a_block_being_written_gets_no_second_disk_slot_and_a_failed_copy_frees_its_slot():
  m = _manager(host=0, disk=4)
  blocks = _device_blocks(m, 0, 2) + _device_blocks(m, 1, 1, first=0)  # key 0 on both shards
  orders = m.resolve(TierOrders(demote=tuple(blocks)))
  assert [k for k, _ in orders.to_disk] == [blocks[0][2], blocks[1][2]]  # one slot per key
  again = m.resolve(TierOrders(demote=(blocks[0],)))  # still on its way: no second write
  assert again.to_disk == () and again.device_out == ()
  key, slot = orders.to_disk[0]
  m.copy_failed(0, slot, key, Tier.DISK)
  assert m.index.slot_of(0, key, Tier.DISK) is None and slot not in m.index.held_slots(0, Tier.DISK)
  retry = m.resolve(TierOrders(demote=(blocks[0],)))  # settled: it may be written again
  assert [k for k, _ in retry.to_disk] == [key]


def test_a_full_disk_evicts_the_oldest_record_into_drop_and_a_detached_one_takes_nothing():
  m = _manager(host=0, disk=2)
  blocks = _device_blocks(m, 0, 3)
  first = m.resolve(TierOrders(demote=tuple(blocks[:2])))
  _report(m, first)
  full = m.resolve(TierOrders(demote=(blocks[2],)))
  assert [k for k, _ in full.to_disk] == [blocks[2][2]]
  assert len(full.drop) == 1 and full.drop[0] in {b[2] for b in blocks[:2]}
  detached = _manager(host=0, disk=2, attached=lambda: False)
  orders = detached.resolve(TierOrders(demote=tuple(_device_blocks(detached, 0, 2))))
  assert orders.to_disk == () and orders.device_out == ()
  assert detached.stats["disk_detached_drops"] == 2
  assert not detached.index.held_slots(0, Tier.DISK)


def test_write_through_copies_once_to_host_and_every_block_to_the_pool():
  m = _manager(host=4, pool=True, write_through=True)
  blocks = _device_blocks(m, 0, 3)
  orders = m.resolve(TierOrders(write_through=tuple(blocks), demote=tuple(blocks[:1])))
  assert [c.key for c in orders.to_host] == [b[2] for b in blocks]  # block 0 once
  assert orders.to_pool == tuple(b[2] for b in blocks)
  assert [b[2] for b in orders.device_out] == [b[2] for b in blocks]  # read once, for the pool
  assert all(isinstance(c, Copy) for c in orders.to_host)


def test_place_returns_the_orders_that_keep_what_it_evicted():
  m = _manager(host=2, disk=4)
  cached = _device_blocks(m, 0, 8)  # every device page of shard 0 holds a cached block
  pages, orders = m.place(0, 3, Tier.DEVICE)
  assert len(pages) == 3 and orders.resolved
  evicted = {b[2] for b in cached if b[1] in pages}
  # Two go to the host slots, the third straight to disk: none is dropped.
  assert {c.key for c in orders.to_host} | {b[2] for b in orders.device_out} == evicted
  assert {k for k, _ in orders.to_disk} >= {b[2] for b in orders.device_out}
  _report(m, orders)
  slots, host_orders = m.place(0, 2, Tier.HOST)  # both host slots: their blocks go to disk
  assert len(slots) == 2 and {b[2] for b in host_orders.host_out} == {c.key for c in orders.to_host}
  assert {k for k, _ in host_orders.to_disk} == {c.key for c in orders.to_host}
  none, nothing = m.place(0, 9, Tier.DEVICE)
  assert none is None and nothing.empty


def test_resolved_orders_are_carried_out_as_they_are_not_added_to():
  with pytest.raises(ValueError, match="resolved"):
    TierOrders(resolved=True) + TierOrders(pump=True)
