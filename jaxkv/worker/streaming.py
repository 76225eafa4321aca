"""Long contexts: sequences longer than a device pool holds, streamed through attention.

A streamed sequence runs alone on the shard with the most free host slots. Its first
``sink_pages`` and latest ``window_pages`` pages stay on device; when the window moves on,
its oldest page is copied down (to a host slot, or with ``source="disk"`` to a private disk
record that must commit before it is used) and its device page is reused. Every prefill
chunk and decode step attends over the hot pages and streams the cold ones from host
memory (``jaxkv.ops.streamed``: sliced page by page, double-buffered, merged into the same
online softmax). With ``source="disk"`` the cold records are read back and verified into
host slots before each step and released after it. All tier I/O and every wait go through
the cache's ``TierMover`` with the read deadline. Every slot it takes (device pages, host slots, disk records) comes
from the manager with the orders that keep what the slot held (``CacheManager.place``),
carried out by the worker before the slot is written: a streamed sequence evicts like a
step does.

A model with a window group (hybrid attention) streams its global layers alone: its local
layers write and read a ring of the window pool (``jaxkv.manager.windows``), taken for the
sequence like a running one's, which holds every key their queries can see.

Staging shapes are fixed per bucket, so a repeated long request compiles nothing. The
sequence's blocks are not published for reuse; every page, host slot and disk record it
held is given back on every path.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
import typing

import jax
import numpy as np

from jaxkv import buckets
from jaxkv import nnx as kvnnx
from jaxkv.worker import pages as pages_lib
from jaxkv.distributed import to_host
from jaxkv.errors import CapacityError, InputError, InvariantError
from jaxkv.manager import windows as windows_lib
from jaxkv.manager.index import Tier
from jaxkv.scheduling.step import StepResult
from jaxkv.worker import sampling as sampling_lib

if typing.TYPE_CHECKING:
  from jaxkv.scheduling.admission import Request  # the worker takes a request as a value


@dataclasses.dataclass
class _State:
  """Where one streamed sequence's pages are (changes as the window moves)."""

  shard: int
  free: list  # device pages not holding a block of the sequence
  block_page: dict  # logical block -> device page (the hot blocks)
  cold: list  # host slots of the cold blocks, oldest first (blocks sink, sink+1, ...)
  dev: list  # every device page the sequence holds
  # source="disk": the disk slots (quota) its cold blocks' records take; the records are
  # named by ``_record_key``, block sink + i for slot i
  disk: list = dataclasses.field(default_factory=list)
  nonce: bytes = b""  # names this sequence's disk records
  # A model with a window group: the ring of window-pool pages the sequence's local layers
  # write and read (every key their queries see is in it; nothing of it streams), and
  # the window table naming them for every block (``windows.table_row``), on device.
  ring: tuple = ()
  window_table: object = None


class StreamRunner:
  """Prefills and decodes streamed sequences over one cache with one model runner."""

  def __init__(self, cache, runner, stream, *, prefill_chunk_pages: int):
    self.cache, self.runner, self.stream = cache, runner, stream
    self.prefill_chunk_pages = prefill_chunk_pages
    self.stats = cache.stats
    # XLA:CPU runs a mesh's devices on one thread pool: two programs with collectives in
    # flight at once can take every thread a rendezvous needs (ModelRunner.quiesce). A
    # streamed step dispatches page moves between its steps and nothing else waits, so on
    # CPU each step is waited for before the next program; accelerators keep the overlap.
    self._one_at_a_time = cache.mesh.devices.flat[0].platform == "cpu" and cache.mesh.size > 1

  def step(self, plan) -> StepResult:
    """A plan whose step is one streamed request (``plan.streamed``), run to its end, after
    its window-group moves (the kept windows of the requests before it)."""
    failed, window_fetched = self.runner.move_windows(plan)
    tokens, logits, t_first = self.run(plan.streamed, plan.want_logits)
    scores = None
    if plan.streamed.sampling.logprobs is not None:  # from the logits, on the host
      scores = {plan.streamed.id: sampling_lib.logprobs_host(
          logits, np.asarray(tokens, np.int32))}
    return StepResult(tokens={}, logits=None, t_tokens=time.perf_counter(),
                      streamed=(tokens, logits, t_first), logprobs=scores,
                      window_failures=tuple(failed), window_fetched=window_fetched)

  def run(self, r: Request, want_logits: bool):
    """Runs one request to its end; returns ``(tokens, logits or None, perf_counter time
    of its first token)``. Completion (requests, tokens, TTFT) is the scheduler's to count."""
    c, st, index = self.cache.config, self.stream, self.cache.index
    shards, page = self.cache.num_shards, c.page_size
    shard = max(range(shards), key=lambda s: (index.num_available(s, Tier.HOST), -s))
    n_dev = st.sink_pages + st.window_pages + self.prefill_chunk_pages
    dev, evicted = self.cache.manager.place(shard, n_dev, Tier.DEVICE)
    if dev is None:
      raise CapacityError(f"shard {shard} cannot give {n_dev} device pages to a streamed "
                          "sequence now; pages are held elsewhere.")
    state = _State(shard=shard, free=list(dev), block_page={}, cold=[], dev=list(dev),
                   nonce=secrets.token_bytes(16))
    width = buckets.pow2_at_least(r.num_pages_needed)
    put = self.cache.put_rows
    sp = r.sampling
    sampling = self.runner.row_sampling({shard: sp} if sp.temperature > 0 else {}, shards)
    stops = set(sp.stop_token_ids)
    try:
      self.cache.worker.carry_out(evicted)  # what the pages held goes down first
      self._take_ring(state, width)
      carry = put(np.zeros((shards,), np.int32))
      chunk = self.runner.chunk_tokens
      for a in range(0, len(r.tokens), chunk):  # one row per shard: this shard's is ours
        b = min(a + chunk, len(r.tokens))
        self._make_room(state, a // page, -(-b // page))
        batch = self.runner.prefill_batch([(shard, r.tokens[a:b], a, b == len(r.tokens))],
                                          shards, sampling)
        table, stream = self._stage_and_batch(state, width)
        carry, selected = self.runner.prefill(batch, table, carry, stream)
        self._settle(carry)
        self._unstage(state)
      carry.block_until_ready()
      t_first = time.perf_counter()
      produced, logits = [carry], [to_host(selected)[shard]] if want_logits else []
      for step in range(1, r.max_new_tokens):
        if stops and int(to_host(carry)[shard]) in stops:
          break
        pos = len(r.tokens) + step - 1
        self._make_room(state, pos // page, pos // page + 1)
        table, stream = self._stage_and_batch(state, width)
        carry, selected, _ = self.runner.decode(
            self.runner.decode_batch([(shard, pos)], shards, sampling), table, carry, stream)
        self._settle(carry)
        self._unstage(state)
        produced.append(carry)
        if want_logits:
          logits.append(to_host(selected)[shard])
      tokens_out = np.stack([to_host(t) for t in produced], axis=1)[shard].tolist()
    finally:
      self._release(state)
    for name, n in (("streamed_requests", 1), ("prompt_tokens", len(r.tokens)),
                    ("computed_tokens", len(r.tokens)),
                    ("streamed_pages", max(len(state.cold), len(state.disk)))):
      self.stats.add(name, n)
    return tokens_out, (np.stack(logits) if want_logits else None), t_first

  # ---- compiling ahead -----------------------------------------------------------------------
  def shapes(self, max_tokens: int) -> list[tuple[int, int]]:
    """Every ``(table width, cold width)`` a streamed sequence of up to ``max_tokens``
    tokens passes through (its table is as wide as its whole length; its cold slots grow
    chunk by chunk up to that width)."""
    c = self.cache.config
    pages = -(-int(max_tokens) // c.page_size)
    out = set()
    for width in sorted({buckets.pow2_at_least(n)
                         for n in range(c.max_pages_per_seq + 1, pages + 1)}):
      cold = 0
      while True:
        out.add((width, self._cold_width(cold)))
        if cold >= min(width, pages):
          break
        cold = max(1, 2 * cold)
    return sorted(out)

  def _cold_width(self, cold: int) -> int:
    chunk = self.stream.chunk_pages
    return -(-max(chunk, buckets.pow2_at_least(cold)) // chunk) * chunk

  def warm(self, max_tokens: int) -> int:
    """Compiles the streamed steps (every prefill width, and decode) of each of
    ``shapes(max_tokens)`` with all-padding steps on the host pool (no page, no slot is
    read into or written). Returns how many shapes."""
    shards, put = self.cache.num_shards, self.cache.put_rows
    shapes = self.shapes(max_tokens)
    for width, cold in shapes:
      table = put(np.zeros((shards, width), np.int32))
      if self.cache.manager.windows is not None:  # page 0 of the window pool: padding
        table = (table, put(np.zeros((shards, width), np.int32)))
      stream = kvnnx.StreamBatch(
          block_valid=put(np.zeros((shards, width), bool)), host_pool=self.cache.worker.host.pool,
          cold_slots=put(np.zeros((shards, cold), np.int32)),
          cold_first=put(np.zeros((shards,), np.int32)),
          cold_count=put(np.zeros((shards,), np.int32)), pages_per_chunk=self.stream.chunk_pages)
      carry = put(np.zeros((shards,), np.int32))
      for step_width in self.runner.prefill_widths:
        carry, _ = self.runner.prefill(self.runner.prefill_batch([], shards, width=step_width),
                                       table, carry, stream, count=False)
      carry, _, _ = self.runner.decode(self.runner.decode_batch([], shards), table, carry,
                                       stream, count=False)
      self._settle(carry)
    return len(shapes)

  def _settle(self, carry: jax.Array) -> None:
    if self._one_at_a_time:
      jax.block_until_ready((carry, self.cache.worker.pools))

  def _take_ring(self, state: _State, width: int) -> None:
    """A model with a window group: a ring of window-pool pages for the sequence (kept
    blocks unreferenced may be evicted for it), and its window table."""
    windows = self.cache.manager.windows
    if windows is None:
      return
    got = windows.place(state.shard, (), (), demote=False)  # (a step runs: no plan's orders)
    if got is None:
      raise CapacityError(f"shard {state.shard}'s window pool cannot give a streamed sequence "
                          f"a ring of {windows.ring} pages now; they are held by running "
                          "sequences (raise CacheConfig.window_pages_per_shard).")
    state.ring = tuple(got[0])
    table = np.zeros((self.cache.num_shards, width), np.int32)  # page 0: never read
    table[state.shard] = windows_lib.table_row(state.ring, (), width, (0, 0), 0)
    state.window_table = self.cache.put_rows(table)

  def _release(self, state: _State) -> None:
    manager = self.cache.manager
    if state.ring:
      manager.windows.release(state.shard, state.ring, ())
      state.ring = ()
    manager.release(state.shard, state.dev)
    manager.release(state.shard, state.cold, Tier.HOST)
    if state.disk:  # the records name no block anyone can ask for: remove them
      manager.release(0, state.disk, Tier.DISK)
      self.cache.worker.mover.delete_records([self._record_key(state, self.stream.sink_pages + i)
                                       for i in range(len(state.disk))])

  def _make_room(self, state: _State, lo: int, hi: int) -> None:
    """Gives blocks ``[lo, hi)`` device pages, moving the oldest window pages down."""
    st, cache = self.stream, self.cache
    worker = cache.worker
    need = [j for j in range(lo, hi) if j not in state.block_page]
    short = len(need) - len(state.free)
    if short > 0:
      movable = sorted(j for j in state.block_page if j >= st.sink_pages and j < lo)
      victims = movable[:short]
      if len(victims) < short:
        raise CapacityError("a streamed sequence ran out of device pages for its window.")
      slots = []
      for _ in victims:
        slot, evicted = cache.manager.place(state.shard, 1, Tier.HOST)
        if slot is None:
          raise CapacityError("the host tier has no room left for a streamed sequence.")
        worker.carry_out(evicted)  # the host block it held goes on down first
        slots.append(slot[0])
      ids = np.zeros((cache.num_shards, len(victims)), np.int32)
      host_ids = np.full(ids.shape, worker.host.pages_per_shard, np.int32)
      ids[state.shard] = [state.block_page[j] for j in victims]
      host_ids[state.shard] = slots
      if st.source == "disk":
        stack = pages_lib.gather_stacked(worker.pools, cache.put_rows(ids), mesh=cache.mesh,
                                         config=cache.config)
        self._to_disk(state, victims, to_host(stack), slots)
      else:  # the host tier's own buckets: nothing compiles per count of victims
        worker.host.store_pages(worker.pools, [(state.shard, state.block_page[j], slot)
                                             for j, slot in zip(victims, slots)])
      for j, slot in zip(victims, slots):
        if st.source == "host":
          if j != st.sink_pages + len(state.cold):
            raise InvariantError("a streamed sequence's cold pages must stay contiguous")
          state.cold.append(slot)
        state.free.append(state.block_page.pop(j))
      self.stats.add("stream_demotions", len(victims))
    for j in need:
      state.block_page[j] = state.free.pop()

  @staticmethod
  def _record_key(state: _State, block: int) -> bytes:
    return hashlib.sha256(state.nonce + block.to_bytes(8, "little")).digest()

  def _to_disk(self, state: _State, victims, stack: np.ndarray, host_slots) -> None:
    """source='disk': the victims' pages go to disk records (durable before use)."""
    st = self.stream
    self.cache.manager.release(state.shard, host_slots, Tier.HOST)  # the pages go straight down
    n = stack.shape[2] // self.cache.num_shards
    payloads, keys = [], []
    for i, j in enumerate(victims):
      if j != st.sink_pages + len(state.disk):
        raise InvariantError("a streamed sequence's cold pages must stay contiguous")
      slot, evicted = self.cache.manager.place(0, 1, Tier.DISK)  # its quota of the store
      if slot is None:
        raise CapacityError("the disk tier has no room left for a streamed sequence.")
      self.cache.worker.carry_out(evicted)  # the records evicted from it are deleted
      state.disk.append(slot[0])
      payloads.append(np.ascontiguousarray(stack[:, :, state.shard * n + i]).view(
          self.cache.config.jnp_dtype))
      keys.append(self._record_key(state, j))
    self.cache.worker.mover.write_records(payloads, keys, self.cache.tiers.read_deadline_s)

  def _stage(self, state: _State) -> None:
    """source='disk': reads every cold record into host slots for the coming step."""
    cache, st = self.cache, self.stream
    worker = cache.worker
    if len(state.cold) == len(state.disk):
      return
    self._unstage(state)
    slots, evicted = cache.manager.place(state.shard, len(state.disk), Tier.HOST)
    if slots is None:
      raise CapacityError("the host tier has no room to stage a streamed sequence's pages.")
    worker.carry_out(evicted)  # what the slots held goes on down first
    keys = [self._record_key(state, st.sink_pages + i) for i in range(len(state.disk))]
    payloads = worker.mover.read_records(keys, cache.tiers.read_deadline_s)
    n = len(slots)
    bits = pages_lib.bits_dtype(cache.config.jnp_dtype)
    shape = cache.payload_shape
    stack = np.zeros((*shape[:2], cache.num_shards * n, *shape[2:]), bits)
    for i, payload in enumerate(payloads):
      stack[:, :, state.shard * n + i] = payload.view(bits)
    host_ids = np.full((cache.num_shards, n), worker.host.pages_per_shard, np.int32)
    host_ids[state.shard] = slots
    worker.host.store(jax.device_put(stack, worker.mover.stack_sharding), host_ids)
    state.cold = list(slots)
    self.stats.add("stream_disk_reads", len(slots))

  def _unstage(self, state: _State) -> None:
    if self.stream.source == "disk" and state.cold:
      self.cache.manager.release(state.shard, state.cold, Tier.HOST)
      state.cold = []

  def _stage_and_batch(self, state: _State, width: int):
    """The step's page table and the ``StreamBatch`` naming its cold pages."""
    if self.stream.source == "disk":
      self._stage(state)
    st, shards, put = self.stream, self.cache.num_shards, self.cache.put_rows
    table = np.zeros((shards, width), np.int32)
    valid = np.zeros((shards, width), bool)
    for j, p in state.block_page.items():
      table[state.shard, j], valid[state.shard, j] = p, True
    cold_width = self._cold_width(len(state.cold))
    slots = np.zeros((shards, cold_width), np.int32)
    slots[state.shard, :len(state.cold)] = state.cold
    first = np.full((shards,), st.sink_pages, np.int32)
    count = np.zeros((shards,), np.int32)
    count[state.shard] = len(state.cold)
    stream = kvnnx.StreamBatch(
        block_valid=put(valid), host_pool=self.cache.worker.host.pool, cold_slots=put(slots),
        cold_first=put(first), cold_count=put(count), pages_per_chunk=st.chunk_pages)
    if state.ring:  # the window group's layers read and write the ring
      return (put(table), state.window_table), stream
    return put(table), stream


def check_stream_config(stream, cache, config) -> None:
  """Refuses a ``StreamConfig`` the cache or engine config cannot serve (``InputError``)."""
  if stream is None:
    return
  need = stream.sink_pages + stream.window_pages + config.prefill_chunk_pages
  if need > cache.config.pages_per_shard:
    raise InputError(
        f"StreamConfig keeps sink_pages={stream.sink_pages} + window_pages="
        f"{stream.window_pages} + a prefill chunk of {config.prefill_chunk_pages} "
        f"pages on device, more than pages_per_shard={cache.config.pages_per_shard}.")
  if cache.worker.host is None:
    raise InputError("StreamConfig needs a host tier to stream from: set "
                     "TierConfig(host_pages_per_shard=...).")
  if stream.source == "disk" and cache.worker.disk is None:
    raise InputError("StreamConfig(source='disk') needs a disk tier: set "
                     "TierConfig(disk_kvstore=..., disk_pages=...).")
