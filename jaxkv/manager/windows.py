"""The window group's pages: what a sliding-window layer still needs, decided on the host.

A model with hybrid attention (Gemma 3: five local layers to one global) keeps its local
layers' K/V in the cache's *window group*, a device pool of its own
(``CacheConfig.window_pages_per_shard`` pages per shard, ``jaxkv.nnx.WindowPages``). A local
layer's query at position ``t`` reads only keys after ``t - sliding_window``, so a running
sequence needs just the last ``window_blocks`` blocks of that group, not all of them:

* each running sequence writes its window group's K/V into a *ring* of ``ring_blocks``
  pages (block ``j`` in ``ring[j % ring_blocks]``), long enough that no block a query of
  the current step can see is overwritten by the same step (the window plus one prefill
  chunk, plus one). Its page table never changes while it runs.
* a block the sequence publishes (its global layers' block enters the prefix index) is also
  *kept* here: its window KV is copied from the ring into a page of its own, under the same
  key (an order, ``TierOrders.window_copies``, that the worker carries out before the next
  step writes anything). Kept blocks are evicted least recently used first, never while a
  sequence reads them.
* a prefix hit needs the global layers' blocks (the prefix index, any tier) **and** the window
  before the cut: the blocks ``[c - window_blocks, c)`` kept here (``cover``). A sequence
  admitted with such a hit pins those pages for its life and reads them in place.

With ``host_slots`` (``TierConfig.host_window_pages_per_shard``), a kept block evicted
for room keeps a copy in host memory: its window KV is copied to a host slot of its own
(a plan's ``window_demotes``), least recently used slots reused first. A request whose
hit would be longer with the windows kept there than with those on the device has them
loaded back into pages of the device pool first (``load``: a plan's ``window_loads``,
after its window copies; the worker checks each block against the checksum its bytes had
when stored, and one that fails is dropped) and is placed at the next step, when they are
kept on the device again: nothing is placed on bytes not yet checked.

With a pool tier (``pool``), a finished sequence's last window (the blocks before the end
of what it published, and one more) goes to the pool too (``put``: a plan's
``window_puts``, read out before its window copies), under names of its own
(``window_key``), sealed as the pool's blocks are. Another engine that finds the blocks in
the pool (a decode node after a prefill node's hand-off, a replica taking the next turn)
asks it for those windows in the same lookup; a hit that reaches further with them (where
their bytes are predicted to come sooner than recomputing what they add: admission asks
the planner) has them loaded (``pool_loads``, checked as the pool's values are; their time
is learned into the pool's link, as a promotion's) and is placed on them a step later, as
from host memory.

With a disk store (``disk_records``), the same windows are written there as records of
their own (``put``: a plan's ``window_disk_puts``; a separate prefix of the store, sealed
as the disk's blocks are), at most ``disk_records`` of them, least recently used deleted
first (``window_disk_deletes``). The manager keeps their keys (``DiskWindows``): a hit whose
window is there is loaded from it as from host memory (``disk_loads``, priced over the
disk's link as pool loads are over the pool's), and a restarted engine adopts the records
an earlier run left (``DiskWindows.keep``), so its hits from the disk reach across the window
edge without a checkpoint. A record that fails its check or is gone is forgotten. Nothing
of the window group goes to a peer: a cut whose window is kept nowhere is recomputed, as
far back as the longest prefix whose window still is. A checkpoint saves the kept blocks,
on the device and in host memory, and a restore keeps them again where they were
(``jaxkv.worker.checkpoint``), so a restarted engine's hits reach across the window edge
as before. Page 0 of every shard is never handed out: unused table entries and the
padding of a copy order point at it.
"""

from __future__ import annotations

import collections
import hashlib
import math
import typing

from jaxkv.errors import CapacityError
from jaxkv.manager.index import Tier


def window_key(key: bytes) -> bytes:
  """The name a block's window KV goes under in a store shared by engines (the pool): a
  one-way function of its block key under a tag of its own, so a window value and a block
  value never take each other's place (their names, and the keys they are sealed with,
  differ)."""
  return hashlib.sha256(b"jaxkv-window\x00" + key).digest()


class WindowMoves(typing.NamedTuple):
  """The window group's moves a plan carries out (``WindowPages.take_moves``), each chosen
  here, in the order the worker runs them: ``demotes`` ``(shard, device page, host slot)``
  and ``puts`` ``(shard, device page, key)`` read pages before the plan's window copies
  write any; ``loads`` ``(shard, host slot, device page, key)`` and ``pool_loads``
  ``(shard, device page, key)`` come after them; so do ``disk_loads`` ``(shard, device
  page, key)``, while ``disk_puts`` (as ``puts``) read pages before the copies and
  ``disk_deletes`` (keys of records evicted) run before any write."""

  demotes: tuple = ()
  loads: tuple = ()
  pool_loads: tuple = ()
  puts: tuple = ()
  disk_puts: tuple = ()
  disk_deletes: tuple = ()
  disk_loads: tuple = ()
  remote_loads: tuple = ()  # (shard, device page, key, peer): from a remote peer


def window_blocks(sliding_window: int, page_size: int) -> int:
  """Blocks before a cut that a query at the cut may read."""
  return math.ceil(sliding_window / page_size)


def ring_blocks(sliding_window: int, page_size: int, chunk_pages: int) -> int:
  """Pages of a running sequence's ring: its window, a prefill chunk, and one to spare."""
  return window_blocks(sliding_window, page_size) + chunk_pages + 1


class WindowPages:
  """Host-side bookkeeping of one cache's window group, per data shard: free pages, the
  rings of running sequences, kept blocks (key -> page, least recently used first) and the
  references that keep a kept block in place."""

  def __init__(self, *, num_shards: int, pages_per_shard: int, sliding_window: int,
               page_size: int, chunk_pages: int, stats=None, host_slots: int = 0,
               pool: bool = False, disk_records: int = 0):
    self.window = window_blocks(sliding_window, page_size)
    self.ring = ring_blocks(sliding_window, page_size, chunk_pages)
    check_room(pages_per_shard, self.ring, self.window, 1)
    self.num_shards, self.pages_per_shard = num_shards, pages_per_shard
    self.stats = stats
    self._free = [list(range(pages_per_shard - 1, 0, -1)) for _ in range(num_shards)]
    self._kept = [collections.OrderedDict() for _ in range(num_shards)]  # key -> page
    self._key_of = [dict() for _ in range(num_shards)]  # page -> key (kept pages)
    self._refs = [collections.Counter() for _ in range(num_shards)]  # page -> readers
    # Host copies of evicted kept blocks (``host_slots`` per shard): key -> slot, least
    # recently used first; free slots; slots a load of the plan being built reads.
    self.host_slots = host_slots
    self._hkept = [collections.OrderedDict() for _ in range(num_shards)]
    self._hfree = [list(range(host_slots - 1, -1, -1)) for _ in range(num_shards)]
    self._hbusy = [set() for _ in range(num_shards)]
    # Kept pages whose copy out of a ring is ordered but not carried out yet: page -> the
    # ring page holding its bytes until then (what a demote of it reads instead).
    self._source = [dict() for _ in range(num_shards)]
    # The moves of the plan being built, and the host copies the plan in flight made.
    self._demotes: list = []  # (shard, device page, host slot)
    self._loads: list = []  # (shard, host slot, device page, key)
    self._stored: list = []  # (shard, key) of _demotes
    self._in_flight: list = []  # (shard, key) demoted by the last plan taken
    # With ``pool`` (a pool tier shared with other engines), each finished sequence's last
    # window goes there too (``put``) and a hit may load a window from there (``load``).
    self.pool = pool
    # With ``disk_records`` (a disk store), they go there too (``DiskWindows``).
    self.records = DiskWindows(disk_records, self._told)
    self._dkept = self.records.kept
    self._disk_loads: list = []  # (shard, device page, key)
    self._remote_loads: list = []  # (shard, device page, key, peer)
    self._pool_loads: list = []  # (shard, device page, key)
    self._puts: list = []  # (shard, device page, key)
    # Told each kept block that enters or leaves the device or host memory, per shard
    # (``stored(key, tier)`` / ``forgotten(key, tier)``, as the prefix index tells its
    # observer): the window group's KV events (``jaxkv.manager.events``). None: not told.
    self.observer = None

  # ---- lookups ---------------------------------------------------------------------------
  def cover(self, shard: int, keys, cached: int, host: bool = False,
            pooled: frozenset = frozenset(), disk: bool = False) -> int:
    """The longest cut ``c <= cached`` whose window (blocks ``[c - window, c)``, or all of
    ``[0, c)`` when shorter) is kept on ``shard`` (on its device; with ``host``, on its
    device or in host memory; with ``disk``, or on the disk; keys in ``pooled`` count too:
    their windows are in the pool): how much of a ``cached``-block hit the window group can
    serve. 0: none."""
    kept, hkept = self._kept[shard], (self._hkept[shard] if host else {})
    dkept = self._dkept if disk else {}
    run = 0  # consecutive kept blocks ending at the block before the cut
    best = 0
    for c in range(1, cached + 1):
      key = keys[c - 1]
      run = run + 1 if key in kept or key in hkept or key in dkept or key in pooled else 0
      if run >= min(c, self.window):
        best = c
    return best

  def missing(self, shard: int, keys, cut: int, disk: bool = False) -> tuple[int, int]:
    """Blocks of the window before ``cut`` kept neither on ``shard``'s device nor in its
    host memory: ``(on the disk, the others)`` (what a hit there would load from the disk,
    and from the pool); with ``disk`` False, none count as on the disk."""
    kept, hkept = self._kept[shard], self._hkept[shard]
    away = [keys[j] for j in range(max(0, cut - self.window), cut)
            if keys[j] not in kept and keys[j] not in hkept]
    on_disk = sum(k in self._dkept for k in away) if disk else 0
    return on_disk, len(away) - on_disk

  def available(self, shard: int) -> int:
    """Pages a new ring could take now (free, or kept and unreferenced)."""
    return len(self._free[shard]) + sum(1 for p in self._kept[shard].values()
                                        if not self._refs[shard][p])

  # ---- placing a sequence ------------------------------------------------------------------
  def place(self, shard: int, keys, cuts, demote: bool = True) -> tuple[tuple, dict] | None:
    """A sequence admitted with a hit: pins the kept window before each of ``cuts`` (where
    it may resume computing: the end of its blocks on device, the end of its hit) and takes
    a ring. Returns ``(ring pages, {block: kept page})``, or None (nothing taken) when the
    shard has no room for the ring now. ``demote``: whether the kept blocks it evicts keep
    host copies (only while a plan is being built: its demotes read the pages before
    anything of that plan writes them)."""
    blocks = sorted({j for cut in cuts for j in range(max(0, cut - self.window), cut)})
    held = {j: self._kept[shard][keys[j]] for j in blocks}
    for p in held.values():  # pinned first, so the ring's evictions cannot take them
      self._refs[shard][p] += 1
    ring = self._take(shard, self.ring, demote)
    if ring is None:
      self.release(shard, (), held.values())
      return None
    for j in blocks:
      self._kept[shard].move_to_end(keys[j])
    return ring, held

  def load(self, shard: int, keys, cuts, pooled: frozenset = frozenset(),
           disk: bool = False, peer: int | None = None) -> int:
    """Orders the blocks of the window before each of ``cuts`` that are kept only in host
    memory (or, with ``disk``, on the disk; or, for keys in ``pooled``, are in the pool, or
    with ``peer``, at that remote peer) loaded into pages of the device pool (``loads``,
    ``disk_loads``, ``pool_loads`` and ``remote_loads`` of the plan being built, from the
    first of those places that has each), kept there and
    pinned until the plan is taken; their host slots and records are not reused by that
    plan. Returns how many (0: none to load, or no room for them now)."""
    kept, hkept = self._kept[shard], self._hkept[shard]
    dkept = self._dkept if disk else {}
    blocks = sorted({j for cut in cuts for j in range(max(0, cut - self.window), cut)})
    wanted = [j for j in blocks if keys[j] not in kept
              and (keys[j] in hkept or keys[j] in dkept or keys[j] in pooled)]
    if not wanted:
      return 0
    pinned = [kept[keys[j]] for j in blocks if keys[j] in kept]
    for p in pinned:  # (the window's other blocks stay while pages are taken)
      self._refs[shard][p] += 1
    for j in wanted:
      if keys[j] in hkept:
        self._hbusy[shard].add(hkept[keys[j]])
      elif keys[j] in dkept:
        self.records.busy.add(keys[j])
    got = self._take(shard, len(wanted))
    self.release(shard, (), pinned)
    if got is None:
      return 0
    for j, page in zip(wanted, got):
      key = keys[j]
      kept[key], self._key_of[shard][page] = page, key
      self._told(key, Tier.DEVICE)
      self._refs[shard][page] += 1
      if key in hkept:
        hkept.move_to_end(key)
        self._loads.append((shard, hkept[key], page, key))
      elif key in dkept:
        dkept.move_to_end(key)
        self._disk_loads.append((shard, page, key))
      elif peer is not None:
        self._remote_loads.append((shard, page, key, peer))
      else:
        self._pool_loads.append((shard, page, key))
    for j in blocks:
      if keys[j] in kept:
        kept.move_to_end(keys[j])
    return len(wanted)

  def put(self, shard: int, keys, cut: int, spare: int = 0) -> int:
    """A finished sequence's window before ``cut`` (its last published block's end; and
    ``spare`` blocks more, for cuts up to that many blocks earlier) goes to the pool, where
    another engine (a decode node, a replica) finds it, and to the disk, where a restarted
    engine does: a put order for each of its blocks kept on ``shard``, read from where its
    bytes are until the plan's copies run (on the disk, only those it has no record of).
    Returns how many blocks (0 with neither)."""
    if not (self.pool or self.records.quota):
      return 0
    n = 0
    for j in range(max(0, cut - self.window - spare), cut):
      page = self._kept[shard].get(keys[j])
      if page is not None:
        source = self._source[shard].get(page, page)
        if self.pool:
          self._puts.append((shard, source, keys[j]))
        if self.records.quota:
          self.records.put(shard, source, keys[j])
        n += 1
    return n

  def hold(self, shard: int, keys, cut: int) -> list[int] | None:
    """Pins the kept window before ``cut`` (``Engine.pin``: a pinned prefix stays a hit);
    None, nothing pinned, when it is not kept whole. ``release(shard, (), pages)`` ends it."""
    if self.cover(shard, keys, cut) != cut:
      return None
    pages = []
    for j in range(max(0, cut - self.window), cut):
      self._kept[shard].move_to_end(keys[j])
      pages.append(self._kept[shard][keys[j]])
      self._refs[shard][pages[-1]] += 1
    return pages

  def release(self, shard: int, ring, held) -> None:
    """A sequence's ring goes back to the free pages and its pins on kept blocks end."""
    self._free[shard].extend(ring)
    for p in held:
      self._refs[shard][p] -= 1
      if self._refs[shard][p] <= 0:
        del self._refs[shard][p]
        if p not in self._key_of[shard]:  # forgotten while pinned: free now
          self._free[shard].append(p)

  def release_placement(self, p) -> None:
    """``release`` of what a ``Placement`` took (its ring and pins)."""
    self.release(p.shard, p.window_ring, [page for _, page in p.window_held])

  def keep(self, shard: int, key: bytes, source: int | None = None,
           demote: bool = True) -> int | None:
    """A block whose window KV is to be kept (a published block's, copied out of its ring
    page ``source`` by the next plan; or a restored one's, landed at once: ``demote`` False,
    see ``place``): the page it goes to, now kept under ``key``; None when ``key`` is kept
    already (it is touched) or no page can be had (counted)."""
    kept = self._kept[shard]
    if key in kept:
      kept.move_to_end(key)
      return None
    got = self._take(shard, 1, demote)
    if got is None:
      if self.stats is not None:
        self.stats.add("window_keep_dropped")
      return None
    kept[key] = got[0]
    self._key_of[shard][got[0]] = key
    self._told(key, Tier.DEVICE)
    if source is not None:
      self._source[shard][got[0]] = source
    if self.stats is not None:
      self.stats.add("window_blocks_kept")
    return got[0]

  # ---- the host copies' orders ------------------------------------------------------------
  def take_moves(self) -> WindowMoves:
    """The plan being built takes its moves (``WindowMoves``). The worker carries out the
    demotes and puts before the plan's window copies (they read what the pages held before
    it) and the loads after them."""
    moves = WindowMoves(tuple(self._demotes), tuple(self._loads), tuple(self._pool_loads),
                        tuple(self._puts), *self.records.take(), tuple(self._disk_loads),
                        tuple(self._remote_loads))
    for shard, page in self._loaded_pages():
      self.release(shard, (), (page,))  # (pinned while the plan was built)
    self._in_flight, self._stored = self._stored, []
    self._demotes, self._loads, self._pool_loads, self._puts = [], [], [], []
    self._disk_loads, self._remote_loads = [], []
    for shard in range(self.num_shards):
      self._hbusy[shard].clear()
      self._source[shard].clear()  # (this plan's copies land them)
    return moves

  def _loaded_pages(self) -> list[tuple[int, int]]:
    """``(shard, device page)`` of every load of the plan being built (each pinned)."""
    return ([(s, p) for s, _, p, _ in self._loads]
            + [(s, p) for s, p, _ in self._pool_loads + self._disk_loads]
            + [(s, p) for s, p, _, _ in self._remote_loads])

  def has_moves(self) -> bool:
    """Whether moves wait for a plan to take them."""
    return bool(self._demotes or self._loads or self._pool_loads or self._puts
                or self._disk_loads or self._remote_loads or self.records.has_moves())

  def drop_loaded(self, shard: int, key: bytes, disk: bool = False) -> None:
    """A loaded block whose bytes failed their check (or, from the pool or the disk, did
    not come): kept neither on the device (its page is free once its readers end) nor in
    host memory (its slot is free); with ``disk`` (it was read from there), its record is
    forgotten too."""
    if disk:
      self.records.drop(key)
    page = self._kept[shard].pop(key, None)
    if page is not None:
      del self._key_of[shard][page]
      self._told(key, Tier.DEVICE, left=True)
      if not self._refs[shard][page]:
        self._free[shard].append(page)
    slot = self._hkept[shard].pop(key, None)
    if slot is not None:
      self._told(key, Tier.HOST, left=True)
      self._hfree[shard].append(slot)

  def forget(self) -> None:
    """The window pools were lost (a failed step): nothing is kept any more. Rings and pins
    of running sequences stay theirs; a pinned page is free once its last pin ends. Host
    copies stay, but those the failed plan (or the one being built) ordered: their bytes
    may never have been written."""
    for shard, key in self._in_flight + self._stored:
      slot = self._hkept[shard].pop(key, None)
      if slot is not None:
        self._told(key, Tier.HOST, left=True)
        self._hfree[shard].append(slot)
    for shard, page in self._loaded_pages():
      self.release(shard, (), (page,))  # (their pins, below: the pages go back)
    self._in_flight, self._stored, self._demotes, self._loads = [], [], [], []
    self._pool_loads, self._puts = [], []
    # (records ordered written may never be: a load of one fails and forgets it)
    self._disk_loads, self._remote_loads = [], []
    self.records.take()
    for shard in range(self.num_shards):
      self._hbusy[shard].clear()
      self._source[shard].clear()
      for key, page in self._kept[shard].items():
        self._told(key, Tier.DEVICE, left=True)
        if not self._refs[shard][page]:
          self._free[shard].append(page)
      self._kept[shard].clear()
      self._key_of[shard].clear()

  def find(self, key: bytes) -> tuple[int, Tier, int] | None:
    """Where ``key``'s window KV is kept: ``(shard, Tier.DEVICE, page)``, else ``(shard,
    Tier.HOST, host slot)``; None (what a peer's block server serves)."""
    for shard, kept in enumerate(self._kept):
      if key in kept:
        return shard, Tier.DEVICE, kept[key]
    for shard, hkept in enumerate(self._hkept):
      if key in hkept:
        return shard, Tier.HOST, hkept[key]
    return None

  def kept_blocks(self, shard: int) -> int:
    return len(self._kept[shard])

  def kept_items(self, shard: int) -> list[tuple[bytes, int]]:
    """``(key, page)`` of every block kept on ``shard``, least recently used first (what a
    checkpoint saves, in the order a restore keeps them again)."""
    return list(self._kept[shard].items())

  def host_items(self, shard: int) -> list[tuple[bytes, int]]:
    """``(key, host slot)`` of every block kept in host memory on ``shard``, least recently
    used first (what a checkpoint saves, in the order a restore keeps them again)."""
    return list(self._hkept[shard].items())

  def keep_host(self, shard: int, key: bytes) -> int | None:
    """A restored block's window kept in host memory (the caller writes its bytes there at
    once): the host slot it goes to, now kept under ``key``; None when ``key`` has a host
    copy already (touched), there are no host slots, or none can be reused now (counted)."""
    return self._host_slot(shard, key)

  def _host_slot(self, shard: int, key: bytes) -> int | None:
    """A host slot for ``key``'s window, now kept there: a free one, else the least
    recently used one no load of the plan being built reads. None when ``key`` has one
    already (touched), there are no host slots, or every slot is being read (counted)."""
    if not self.host_slots:
      return None
    hkept = self._hkept[shard]
    if key in hkept:
      hkept.move_to_end(key)
      return None
    if not self._hfree[shard]:
      victim = next((k for k, s in hkept.items() if s not in self._hbusy[shard]), None)
      if victim is None:
        if self.stats is not None:
          self.stats.add("window_host_dropped")
        return None
      self._hfree[shard].append(hkept.pop(victim))
      self._told(victim, Tier.HOST, left=True)
    slot = self._hfree[shard].pop()
    hkept[key] = slot
    self._told(key, Tier.HOST)
    return slot

  def _take(self, shard: int, n: int, demote: bool = True) -> list | None:
    """``n`` pages: free ones first, then the least recently used unreferenced kept ones
    (each keeping a host copy, with ``demote``)."""
    free, kept, refs = self._free[shard], self._kept[shard], self._refs[shard]
    if len(free) < n:
      victims = [k for k, p in kept.items() if not refs[p]][:n - len(free)]
      if len(free) + len(victims) < n:
        return None
      for k in victims:
        page = kept.pop(k)
        del self._key_of[shard][page]
        self._told(k, Tier.DEVICE, left=True)
        free.append(page)
        if self.stats is not None:
          self.stats.add("window_blocks_evicted")
        source = self._source[shard].pop(page, page)  # (its bytes before this plan's copies)
        if demote:
          self._demote(shard, k, source)
    return [free.pop() for _ in range(n)]

  def _told(self, key: bytes, tier: Tier, left: bool = False) -> None:
    """Tells the observer that one shard's copy of ``key``'s window entered ``tier`` (or,
    with ``left``, left it)."""
    if self.observer is not None:
      (self.observer.forgotten if left else self.observer.stored)(key, tier)

  def _demote(self, shard: int, key: bytes, source: int) -> None:
    """An evicted kept block keeps a host copy (a demote order: ``source``, the page its
    bytes are in until the plan's copies run), unless it has one (touched) or there is no
    host slot to give it (counted)."""
    slot = self._host_slot(shard, key)
    if slot is None:
      return
    self._demotes.append((shard, source, slot))
    self._stored.append((shard, key))
    if self.stats is not None:
      self.stats.add("window_host_stored")


class DiskWindows:
  """The window records on the disk, as the manager keeps them: at most ``quota`` (one per
  block key, whatever the shard: every shard computes the same bytes), least recently used
  first, and the writes and deletes the plan being built orders. ``told(key, tier, left)``
  hears of every record that enters or leaves (the window group's KV events)."""

  def __init__(self, quota: int, told):
    self.quota, self._told = quota, told
    self.kept: collections.OrderedDict = collections.OrderedDict()  # key -> None
    self.busy: set = set()  # keys a load of the plan being built reads
    self._puts: list = []  # (shard, device page, key)
    self._deletes: list = []  # keys of records evicted

  def put(self, shard: int, page: int, key: bytes) -> None:
    """A write of ``key``'s record (read from ``page``) unless it has one (touched); the
    least recently used records past ``quota`` that no load of this plan reads are
    deleted."""
    if key in self.kept:
      self.kept.move_to_end(key)
      return
    self.kept[key] = None
    self._told(key, Tier.DISK)
    self._puts.append((shard, page, key))
    over = len(self.kept) - self.quota
    if over > 0:  # (from the oldest on, only as far as the victims go: a quota is large)
      victims = []
      for k in self.kept:
        if len(victims) == over:
          break
        if k not in self.busy and k != key:
          victims.append(k)
      for victim in victims:
        del self.kept[victim]
        self._told(victim, Tier.DISK, left=True)
        unwritten = [p for p in self._puts if p[2] == victim]
        if unwritten:  # ordered by this plan: not written at all
          self._puts.remove(unwritten[0])
        else:
          self._deletes.append(victim)

  def keep(self, key: bytes) -> bool:
    """A record an earlier run left (checked when read): kept, unless ``quota`` records
    are kept already. Returns whether it was."""
    if key in self.kept or len(self.kept) >= self.quota:
      return False
    self.kept[key] = None
    self._told(key, Tier.DISK)
    return True

  def drop(self, key: bytes) -> None:
    """A record that failed its check or was gone when read: forgotten."""
    if self.kept.pop(key, 0) is None:
      self._told(key, Tier.DISK, left=True)

  def has_moves(self) -> bool:
    return bool(self._puts or self._deletes)

  def take(self) -> tuple[tuple, tuple]:
    """The writes and deletes of the plan being built, which takes them."""
    moves = tuple(self._puts), tuple(self._deletes)
    self._puts, self._deletes = [], []
    self.busy.clear()
    return moves


def table_row(ring, held, num_pages: int, front: tuple[int, int], resume: int) -> tuple:
  """A sequence's window-group page for each of its ``num_pages`` blocks. The blocks it
  writes (the plan's recompute ``front = (a, b)``, and everything from ``resume`` on) use
  its ring: a kept page is never written. The others use the kept page it holds (``held``:
  ``(block, page)`` pairs), or page 0 (never read: outside every window the sequence's
  queries have)."""
  r, held = len(ring), dict(held)
  return tuple(ring[j % r] if front[0] <= j < front[1] or j >= resume else held.get(j, 0)
               for j in range(num_pages))


def placement_row(p, split: int, resume: int) -> tuple:
  """``table_row`` of a ``Placement`` whose plan recomputes ``[hot, split)`` and which
  computes on from block ``resume``; () without a window group."""
  if not p.window_ring:
    return ()
  return table_row(p.window_ring, p.window_held, p.request.num_pages_needed,
                   (p.hot_blocks, split), resume)


def check_room(pages_per_shard: int, ring: int, window: int, rows: int) -> None:
  """Refuses a window pool too small for ``rows`` running sequences per shard: each holds
  a ring and pins the kept windows before two cuts (its hit's and its device part's)."""
  need = rows * (ring + 2 * window) + 1
  if pages_per_shard < need:
    raise CapacityError(
        f"CacheConfig.window_pages_per_shard={pages_per_shard} is below {need}: {rows} "
        f"running sequences per shard each need a ring of {ring} pages and up to "
        f"{2 * window} kept blocks before their cuts (plus page 0). Raise it, or set 0 to "
        "let the engine size it.")
