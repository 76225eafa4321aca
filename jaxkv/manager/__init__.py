"""The cache manager: what is cached where, decided on the host, with no JAX.

The manager is the host-side half of a ``KVCache``. It holds the ``PrefixIndex`` (which
slot of which tier holds which block, with the chain between blocks), the references that
keep blocks in place (a request's pages, a fetch's source, a ``hold`` on a prefix), and the
decisions that change them: allocating slots (evicting the least valuable cached blocks),
releasing pins, publishing what a step computed and what the worker's copies reached
(``copied``: the worker reports, the manager writes), and settling fetch groups
(``fetched``: pins released, failed chains forgotten). It is the index's one
writer. What a decision needs moved comes back as a value: the blocks an allocation evicted
are returned beside its pages, and the scheduler puts them in the step's ``TierOrders`` for
the cache worker (``jaxkv.worker.worker``), which alone touches pools and tiers. It also
asks remote peers about a prefix, off the step loop (``peer_prefix``).

The scheduler and admission see only this object (never the pools, tiers or mover),
so they can be built and tested with no model, no mesh and no device.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import typing
from collections.abc import Callable, Sequence

import numpy as np
from absl import logging

from jaxkv.errors import CapacityError, InputError
from jaxkv.manager.copies import CopyPlanner
from jaxkv.manager.events import BlockEvents
from jaxkv.manager.index import LOCAL_TIERS, PrefixIndex, Tier
from jaxkv.scheduling.step import Block, Failure, TierOrders

if typing.TYPE_CHECKING:
  from jaxkv.stats import Stats
  from jaxkv.scheduling.step import Fetch


class _Pending:
  def __repr__(self) -> str:
    return "PENDING"


PENDING = _Pending()  # ``CacheManager.peer_prefix``: the peer's answer has not come yet
POOL_PEER = -1  # a lookup's ``(peer, blocks)`` answer whose blocks are in the pool tier


class CacheManager:
  """Host-side bookkeeping of one cache: its index, pins, allocation and eviction.

  ``disk_attached``: asks the cache worker whether the disk tier is attached now (it
  detaches for a cool-down after repeated failures; a lookup then leaves it out).
  ``remote``: the remote tier's prefix lookup (``longest_prefix``), or None. A peer
  lookup is asked on a thread of its own, and the request waits in the queue for its
  answer (``peer_prefix``); the loop does not. ``share_answers``: in a multi-process job,
  process 0's broadcast (``distributed.broadcast_bytes``). Only the process with
  ``asks_peers`` asks; the answers reach every process together, at the start of a
  schedule (``agree_peer_answers``), so every process admits alike.
  """

  def __init__(self, index: PrefixIndex, *, stats: Stats, page_bytes: int,
               write_through: bool, has_disk: bool, has_pool: bool = False,
               disk_attached: Callable[[], bool] = lambda: True, remote=None,
               share_answers: Callable[[bytes], bytes] | None = None,
               asks_peers: bool = True):
    self.index, self.stats = index, stats
    # What the index holds, told to routers (``jaxkv.manager.events``; None: not published).
    self.events: BlockEvents | None = None
    self.window_events: BlockEvents | None = None  # the window group's (a hybrid model's)
    # The window group's pages (``jaxkv.manager.windows.WindowPages``), for a model with
    # sliding-window layers; None otherwise (``KVCache.size_windows`` sets it).
    self.windows = None
    self.num_shards, self.page_size, self.page_bytes = (index.num_shards, index.page_size,
                                                        page_bytes)
    self.write_through, self.has_disk = write_through, has_disk
    self.remote = remote
    self._disk_attached = disk_attached
    self._pins: dict = {}  # (tenant, last key) -> [[(shard, pages), ...] per hold]
    self.share_answers, self.asks_peers = share_answers, asks_peers
    # request id -> its peer lookup (None where another process asks)
    self._asked: dict[int, concurrent.futures.Future | None] = {}
    self._agreed: dict[int, tuple[int, int] | None] = {}  # a job's answers, not yet taken
    self._lookups: concurrent.futures.ThreadPoolExecutor | None = None
    self._answered = threading.Event()  # set when any lookup finishes
    # Where every copy down goes (``resolve``): host and disk slots chosen here, not by the
    # worker that copies.
    self.copies = CopyPlanner(self, has_host=index.host_pages_per_shard > 0,
                              has_disk=has_disk, has_pool=has_pool, disk_attached=disk_attached)

  def set_remote(self, remote) -> None:
    """The remote tier whose ``longest_prefix`` lookups admission asks (opened with the
    cache's tiers, once the model is known)."""
    self.remote = remote

  def set_events(self, events: BlockEvents, window_events: BlockEvents | None = None) -> None:
    """Tells ``events`` every change of the index from now on (before anything is cached);
    ``window_events`` (a hybrid model's window group, told by ``windows``) learn the
    blocks' tokens too."""
    self.events, self.window_events = events, window_events
    self.index.observer = events

  def block_keys(self, tokens, tenant: str) -> list[bytes]:
    """Keys of every full block of ``tokens`` for ``tenant`` (``PrefixIndex.block_keys``);
    with KV events on, the blocks' tokens are noted for the events that name them."""
    keys = self.index.block_keys(tokens, tenant)
    for told in (self.events, self.window_events):
      if told is not None:
        told.learn(keys, tokens, salt=self.index.tenant_salt(tenant))
    return keys

  # ---- lookups ---------------------------------------------------------------------------------
  def lookup_tiers(self) -> tuple[Tier, ...]:
    """The local tiers a lookup may hit now (a detached disk tier holds nothing meanwhile)."""
    if not self.has_disk or self._disk_attached():
      return LOCAL_TIERS
    return (Tier.DEVICE, Tier.HOST)

  def peer_prefix(self, request: int, keys: Sequence[bytes]):
    """``(peer, blocks)`` of the remote peer holding the longest prefix of ``keys`` (None:
    none holds any), or ``PENDING`` while the question is out: the first call asks on the
    lookup thread and returns at once; a later call for the same request takes the answer
    (in a job: once ``agree_peer_answers`` brought it). A lookup that fails answers None
    (the request recomputes; the client counted why)."""
    if request in self._agreed:
      return self._agreed.pop(request)
    if request not in self._asked:
      self._asked[request] = self._ask(keys) if self.asks_peers else None
    future = self._asked[request]
    if self.share_answers is not None or not future.done():
      return PENDING
    del self._asked[request]
    return self._answer(request, future)

  def _ask(self, keys: Sequence[bytes]) -> concurrent.futures.Future:
    if self._lookups is None:
      self._lookups = concurrent.futures.ThreadPoolExecutor(
          max_workers=1, thread_name_prefix="jaxkv-peer-lookup")
    self.stats.add("peer_lookups")
    future = self._lookups.submit(self.remote.longest_prefix, list(keys), 0)
    future.add_done_callback(lambda _: self._answered.set())
    return future

  def _answer(self, request: int, future: concurrent.futures.Future):
    try:
      return future.result()
    except Exception:  # pylint: disable=broad-except  (a peer never breaks admission)
      logging.exception("the peer lookup of request %d failed; it recomputes", request)
      self.stats.add("peer_lookup_errors")
      return None

  def agree_peer_answers(self) -> None:
    """A job's step: the answers process 0 has now reach every process (a collective
    while any lookup is out; every process calls it at the start of each schedule, and
    every process has the same lookups out). Nothing happens in one process."""
    if self.share_answers is None or not self._asked:
      return
    done = {}
    if self.asks_peers:
      done = {r: self._answer(r, f) for r, f in self._asked.items() if f.done()}
    text = json.dumps([[r, list(a) if a else None] for r, a in done.items()])
    for request, answer in json.loads(self.share_answers(text.encode()).decode()):
      self._asked.pop(request, None)
      self._agreed[request] = tuple(answer) if answer else None

  def peers_pending(self) -> bool:
    """Whether a peer lookup is still out."""
    if self.share_answers is not None:  # the same on every process of a job
      return bool(self._asked)
    return any(not f.done() for f in self._asked.values())

  def wait_for_peer_answer(self, timeout_s: float) -> bool:
    """Waits (at most ``timeout_s``) until a lookup that is out answers: what a loop with
    nothing else to do calls instead of spinning. Returns whether one did (at once where
    another process asks: the job's next schedule waits for its answers)."""
    self._answered.clear()
    if not any(f is not None and not f.done() for f in self._asked.values()):
      return True
    return self._answered.wait(timeout_s)

  def forget_peer_lookups(self, requests) -> None:
    """Requests that left the queue (aborted, failed) no longer wait for their answers."""
    for request in requests:
      self._agreed.pop(request, None)
      future = self._asked.pop(request, None)
      if future is not None:
        future.cancel()

  def close(self) -> None:
    """Stops the lookup thread (answers still out are dropped)."""
    self._asked.clear()
    self._agreed.clear()
    if self._lookups is not None:
      self._lookups.shutdown(wait=False, cancel_futures=True)
      self._lookups = None

  # ---- the index's slots: every change to them goes through here ------------------------------
  # The worker reports what its copies did (``copied``, ``dropped``), the scheduler what
  # its steps computed (``publish``); references are taken and released here. No other
  # module calls the index's mutators (tests/test_layout.py).
  def allocate(self, shard: int, n: int, tier: Tier = Tier.DEVICE
               ) -> tuple[list[int] | None, tuple]:
    """``(slots, evicted)``: ``n`` fresh referenced slots of ``tier`` (None when it cannot
    give them now) and the ``(key, slot)`` of the cached blocks evicted to make room (their
    bytes are still there until the caller overwrites them)."""
    return self.index.allocate_evicting(shard, n, tier)

  def allocate_empty(self, shard: int, n: int, tier: Tier = Tier.DEVICE) -> list[int] | None:
    """``n`` referenced slots of ``tier`` that held no block (nothing evicted), or None:
    scratch pages (``PrefixIndex.allocate_empty``); ``release`` gives them back."""
    return self.index.allocate_empty(shard, n, tier)

  def acquire(self, shard: int, slots: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
    self.index.acquire(shard, slots, tier)

  def release(self, shard: int, slots: Sequence[int], tier: Tier = Tier.DEVICE) -> None:
    self.index.release(shard, slots, tier)

  def publish(self, shard: int, slot: int, key: bytes, tier: Tier = Tier.DEVICE,
              parent: bytes | None = None) -> bool:
    """Referenced ``slot`` holds block ``key`` now (``PrefixIndex.publish``)."""
    return self.index.publish(shard, slot, key, tier, parent=parent)

  def copied(self, shard: int, slot: int, key: bytes, tier: Tier,
             parent: bytes | None = None) -> bool:
    """The worker's report of a copy down that finished: ``slot`` of ``tier`` holds ``key``
    (chained after ``parent``, by default the parent the index knows) and the worker's
    reference on it ends. Returns whether it was published (False: held elsewhere)."""
    parent = self.index.parent_of(key) if parent is None else parent
    published = self.index.publish(shard, slot, key, tier, parent=parent)
    self.index.release(shard, [slot], tier)
    if tier == Tier.DISK:
      self.copies.settled(key)
    return published

  def copy_failed(self, shard: int, slot: int, key: bytes, tier: Tier) -> None:
    """The worker's report of a copy down that did not happen: the slot ``resolve`` took for
    ``key`` is released, holding nothing."""
    self.index.release(shard, [slot], tier)
    if tier == Tier.DISK:
      self.copies.settled(key)

  # ---- where copies go: every move's destination is chosen here -----------------------------
  def resolve(self, orders: TierOrders) -> TierOrders:
    """``orders`` with every copy's destination slot chosen, the cascade included
    (``jaxkv.manager.copies``): what the worker carries out."""
    return self.copies.resolve(orders)

  def place(self, shard: int, n: int, tier: Tier) -> tuple[list[int] | None, TierOrders]:
    """``n`` referenced slots of ``tier`` for a writer outside a plan (a streamed sequence,
    a restore) and the resolved orders that keep what they evicted (carried out before the
    slots are written). ``(None, no orders)`` when the tier cannot give them now."""
    slots, evicted = self.allocate(shard if tier != Tier.DISK else 0, n, tier)
    if slots is None:
      return None, TierOrders(resolved=True)
    return slots, self.copies.evicted_from(shard, tier, evicted)

  def fetched(self, fetches: Sequence[Fetch], failures: Sequence[Failure | None]
              ) -> tuple[bytes, ...]:
    """A settled fetch group, as the worker reported it (``FetchReport``): every fetch's
    pin on its source (taken at admission) is released, and each failed copy is forgotten
    with the chain after it, except where nothing of ours is wrong (a remote copy is the
    peer's, a pool value the pool's; a record that raised while read is kept to read again). Returns the disk
    records of what was forgotten, for the worker to delete (``TierOrders.drop``)."""
    for f in fetches:
      self.release_pin(f)
    records = []
    for f, why in zip(fetches, failures):
      if why is None or f.tier in (Tier.REMOTE, Tier.POOL) or why == Failure.READ_RETRY:
        continue
      shard = 0 if f.tier == Tier.DISK else f.shard
      dropped = self.index.drop_chain(shard, f.key, f.tier)
      if f.tier == Tier.DISK:  # nothing names these records now (a gone one is not there)
        records += [k for k in dropped if not (k == f.key and why == Failure.GONE)]
    return tuple(records)

  def record_hits(self, keys: Sequence[bytes]) -> None:
    self.index.record_hits(keys)

  def bind_fingerprint(self, fingerprint: bytes) -> None:
    self.index.bind_fingerprint(fingerprint)

  # ---- allocation ------------------------------------------------------------------------------
  def allocate_pages(self, shard: int, n: int) -> tuple[list[int] | None, tuple[Block, ...]]:
    """``n`` device pages on ``shard`` (referenced), evicting unreferenced cached blocks
    (reused ones last). Returns ``(pages, evicted)``: ``pages`` None when the shard cannot
    give them now (then nothing was evicted); ``evicted`` the blocks whose pages were taken,
    whose bytes are still there until the step that uses the pages writes them, so a
    write-back copy ordered in that step's ``TierOrders.demote`` comes first."""
    pages, evicted = self.allocate(shard, n, Tier.DEVICE)
    return pages, tuple((shard, p, k) for k, p in evicted)

  def release_pin(self, f: Fetch) -> None:
    """Drops the reference a fetch took at admission on its source (one the plan will
    not make; a remote source holds none)."""
    if f.tier == Tier.SHARD:  # the source page on another shard
      self.index.release(f.slot[0], [f.slot[1]], Tier.DEVICE)
    elif f.tier in LOCAL_TIERS:
      self.index.release(f.shard, [f.slot], f.tier)

  # ---- residency -------------------------------------------------------------------------------
  def hold(self, tokens: Sequence[int], tenant: str) -> int:
    """Takes a reference on a prefix's full blocks on every data shard (all must be on
    device there), so no eviction touches them until ``release_hold``. Returns the number
    of blocks held per shard."""
    keys = self.block_keys(np.asarray(tokens, np.int32), tenant)
    held = []  # (shard, device pages, kept window pages)
    try:
      for s in range(self.num_shards):
        pages = self.index.match(s, keys)
        if len(pages) < len(keys):
          raise CapacityError(f"could not keep {len(keys)} blocks on shard {s}.")
        self.index.acquire(s, pages)
        held.append((s, pages, []))
        if self.windows is not None:  # and the window before its end, or it is no hit
          window = self.windows.hold(s, keys, len(keys))
          if window is None:
            raise CapacityError(f"the window before block {len(keys)} is not kept on "
                                f"shard {s}.")
          held[-1] = (s, pages, window)
    except BaseException:
      self._release_held(held)
      raise
    self._pins.setdefault((tenant, keys[-1]), []).append(held)
    return len(keys)

  def holds_whole(self, shard: int, keys) -> bool:
    """Whether ``keys`` (a prefix's blocks) are a whole hit on ``shard`` now: every block
    on device and, with a window group, the window before the last kept (``Engine.pin``
    computes the prefix where not)."""
    if len(self.index.match(shard, keys)) < len(keys):
      return False
    return self.windows is None or self.windows.cover(shard, keys, len(keys)) == len(keys)

  def _release_held(self, held) -> None:
    for s, pages, window in held:
      self.index.release(s, pages)
      if window:
        self.windows.release(s, (), window)

  def release_hold(self, tokens: Sequence[int], tenant: str) -> None:
    """Releases one ``hold`` of the same prefix."""
    keys = self.index.block_keys(np.asarray(tokens, np.int32), tenant)
    held = self._pins.get((tenant, keys[-1]) if keys else None)
    if not held:
      raise InputError("unpin of a prefix that is not pinned (same tokens and tenant as pin).")
    self._release_held(held.pop())

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

