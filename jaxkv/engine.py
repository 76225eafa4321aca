"""Engine: batched greedy generation over a Flax NNX model with tiered prefix reuse.

How a call to ``generate`` runs
1. Validate every prompt before any work (empty prompt, token outside the vocabulary,
   non-integer tokens, more tokens than any tier can hold).
2. Admit requests into a *wave* of at most ``max_seqs_per_shard`` sequences per data
   shard. Each request goes to the shard holding its longest cached prefix, wherever the
   blocks are (device, host, disk, another shard, another job); it pins those blocks and
   allocates device pages for everything it will write. Allocation evicts unreferenced
   cached blocks (reused ones last), copying them down first under write-back.
3. Plan (``jaxkv.plan``, from measured costs): for each request, blocks ``[hot, s)`` are
   recomputed while blocks ``[s, end)`` are fetched. Fetches are issued first, the
   recompute runs meanwhile, then every fetched block is verified; a failed one ends the
   hit there. The rest of the prompt is prefilled in block-aligned chunks of
   ``prefill_chunk_pages`` pages (a block's KV comes from the same computation whether
   or not its prefix was cached), all rows of the wave in one jitted step. A hit always
   leaves at least one prompt token to compute: its logits give the first token.
4. Decode greedily, one jitted step per token, with the token ids staying on device.
5. Publish the full blocks that were written (prompt, and the answer when
   ``cache_decode_blocks``), copy them down under write-through, release the references.
Sequences longer than a device pool holds run one at a time with ``StreamConfig``: sink
and window pages on device, the rest streamed from host memory through attention.

The page pools are donated to every step, so they are updated in place. Steps compile
once per shape bucket: batch rows per shard and page-table width are rounded up to
powers of two (``trace_counts`` records every trace; tests check it).

The engine asks only this of a model: ``model(tokens [B, T] int32, batch: PageBatch)
-> logits [B, T, vocab]``, with its attention layers holding ``jaxkv.nnx.PagedKV``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import nnx as kvnnx
from jaxkv import pages as pages_lib
from jaxkv import scheduler as sched
from jaxkv.cache import CapacityError, KVCache
from jaxkv.config import EngineConfig, SchedulerConfig, StreamConfig
from jaxkv.distributed import to_host
from jaxkv.executor import Fetch, TierMover
from jaxkv.index import LOCAL_TIERS, TIER_NAMES, Tier


def _pow2_at_least(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass
class _Request:
  index: int  # position in the caller's prompt list
  tokens: np.ndarray  # int32 prompt
  max_new_tokens: int
  tenant: str
  keys: list  # block keys of the prompt's full blocks
  num_pages_needed: int  # KV is written for the prompt and all generated tokens but the last
  streamed: bool = False  # longer than a device pool holds: cold pages stream from host
  shard: int = -1
  row: int = -1
  pages: list = dataclasses.field(default_factory=list)  # device pages, one per block
  hit_blocks: int = 0  # leading blocks whose KV is reused (device or fetched)
  hit_tiers: list = dataclasses.field(default_factory=list)  # tier of each hit block
  fetches: list = dataclasses.field(default_factory=list)  # lower-tier blocks to bring up
  hot_blocks: int = 0  # leading hit blocks already on this shard's device pool
  cold_end: int = 0  # end of the cached chain found at admission
  split: int = 0  # plan: blocks [hot_blocks, split) recomputed, [split, cold_end) fetched


class _Steps:
  """The jitted prefill and decode steps of one model structure on one mesh.

  Engines whose models have the same structure (graphdef), mesh and cache config share
  one ``_Steps``: they run the same compiled executables (so a side-by-side comparison
  of two engines compares policies, not compilations) and compile each bucket once.
  """

  def __init__(self, graphdef, mesh, config):
    self.graphdef, self.mesh, self.config = graphdef, mesh, config
    self.trace_counts: collections.Counter = collections.Counter()
    self.prefill = jax.jit(self._prefill_impl, donate_argnums=(0,))
    self.decode = jax.jit(self._decode_impl, donate_argnums=(0,))

  def _forward(self, pages, rest, tokens, page_table, positions, kv_lens, stream=None):
    model = nnx.merge(self.graphdef, pages, rest)
    batch = kvnnx.PageBatch(page_table=page_table, positions=positions, kv_lens=kv_lens,
                            mesh=self.mesh, config=self.config, stream=stream)
    logits = model(tokens, batch)
    return logits, nnx.state(model, kvnnx.KVPages)

  def _prefill_impl(self, pages, rest, tokens, carry, page_table, positions, kv_lens,
                    select_idx, select_mask, stream=None):
    self.trace_counts[("prefill", tokens.shape, page_table.shape, _stream_key(stream))] += 1
    logits, pages = self._forward(pages, rest, tokens, page_table, positions, kv_lens, stream)
    selected = jnp.take_along_axis(logits, select_idx[:, None, None], axis=1)[:, 0]  # [B, V]
    next_tokens = jnp.argmax(selected, axis=-1).astype(jnp.int32)
    return pages, jnp.where(select_mask, next_tokens, carry), selected

  def _decode_impl(self, pages, rest, carry, page_table, positions, kv_lens, stream=None):
    self.trace_counts[("decode", carry.shape, page_table.shape, _stream_key(stream))] += 1
    logits, pages = self._forward(pages, rest, carry[:, None], page_table, positions, kv_lens,
                                  stream)
    selected = logits[:, 0]
    return pages, jnp.argmax(selected, axis=-1).astype(jnp.int32), selected

  def vocab_size(self, pages, rest, num_rows: int) -> int:
    """The model's vocabulary, read off the shape of its logits (no compile, no trace count)."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    before = collections.Counter(self.trace_counts)
    out = jax.eval_shape(self._decode_impl, pages, rest, i32(num_rows), i32(num_rows, 1),
                         i32(num_rows, 1), i32(num_rows))
    self.trace_counts.clear()
    self.trace_counts.update(before)
    return int(out[2].shape[-1])


@dataclasses.dataclass
class _StreamState:
  free: list  # device pages not holding a block of the sequence
  block_page: dict  # logical block -> device page (the hot blocks)
  cold: list  # host slots of the cold blocks, oldest first (blocks sink, sink+1, ...)
  dev: list  # every device page the sequence holds
  disk: list = dataclasses.field(default_factory=list)  # source="disk": cold blocks' slots
  nonce: bytes = b""  # names this sequence's disk records


def _stream_key(stream):
  return None if stream is None else tuple(stream.cold_slots.shape)


@functools.lru_cache(maxsize=16)
def _compiled_steps(graphdef, mesh, config) -> _Steps:
  return _Steps(graphdef, mesh, config)


class Engine:
  """Prefill/decode with prefix reuse over a Flax NNX model and a ``KVCache``."""

  def __init__(self, model: nnx.Module, cache: KVCache, config: EngineConfig | None = None, *,
               scheduler: SchedulerConfig | None = None, costs: sched.CostModel | None = None,
               stream: StreamConfig | None = None):
    if not isinstance(cache, KVCache):
      raise TypeError(f"cache must be a jaxkv.KVCache, got {type(cache).__name__}.")
    self.cache = cache
    self.config = config or EngineConfig()
    self.scheduler = scheduler or SchedulerConfig()
    if costs is None and self.scheduler.cost_model_path:
      costs = sched.CostModel.load(self.scheduler.cost_model_path)
    self.costs = costs
    self.stream = stream
    if stream is not None:
      need = stream.sink_pages + stream.window_pages + self.config.prefill_chunk_pages
      if need > cache.config.pages_per_shard:
        raise ValueError(
            f"StreamConfig keeps sink_pages={stream.sink_pages} + window_pages="
            f"{stream.window_pages} + a prefill chunk of {self.config.prefill_chunk_pages} "
            f"pages on device, more than pages_per_shard={cache.config.pages_per_shard}.")
      if cache.host is None:
        raise ValueError("StreamConfig needs a host tier to stream from: set "
                         "TierConfig(host_pages_per_shard=...).")
      if stream.source == "disk" and cache.disk is None:
        raise ValueError("StreamConfig(source='disk') needs a disk tier: set "
                         "TierConfig(disk_kvstore=..., disk_pages=...).")
    self.mesh = cache.mesh
    cfg = cache.config
    cache.attach(model)
    self.model = model
    graphdef, pages, rest = nnx.split(model, kvnnx.KVPages, ...)
    self._graphdef = graphdef
    self._pages = pages
    self._rest = jax.device_put(rest, NamedSharding(self.mesh, P()))  # weights replicated
    self._steps = _compiled_steps(graphdef, self.mesh, cfg)
    self._mover = TierMover(cache)
    self._pins: dict = {}
    self._force_shard: int | None = None
    self.vocab_size = self._steps.vocab_size(self._pages, self._rest, self.cache.num_shards)
    self._row_sharding = lambda ndim: NamedSharding(
        self.mesh, P(cfg.data_axis, *([None] * (ndim - 1))))
    self.reset_stats()

  @property
  def trace_counts(self) -> collections.Counter:
    """Traces per (step, shape bucket), shared by engines over the same model structure."""
    return self._steps.trace_counts

  def _prefill(self, *args):
    return self._steps.prefill(*args)

  def _decode(self, *args):
    return self._steps.decode(*args)

  # ---- public API ----------------------------------------------------------------------------
  def reset_stats(self) -> None:
    self._stats = collections.Counter()
    self._hits = collections.Counter()
    self._ttft: list[float] = []
    self._mover.counters.clear()
    self._mover.failures.clear()

  def stats(self) -> dict:
    """Counters since construction (or ``reset_stats``); ``ttft_s`` lists every request."""
    out = dict(self._stats)
    for k, v in self._mover.counters.items():
      out[k] = out.get(k, 0) + v
    out["hits"] = {name: self._hits[name]
                   for name in ("device", "host", "disk", "remote", "shard")}
    out["verify_failures_by_reason"] = dict(self._mover.failures)
    out["ttft_s"] = list(self._ttft)
    out["evictions"] = self.cache.index.counters.evictions
    for k in ("requests", "prompt_tokens", "hit_tokens", "computed_tokens", "generated_tokens",
              "blocks_fetched", "blocks_recomputed", "blocks_split", "bytes_moved",
              "prefill_steps", "decode_steps", "waves", "verify_failures", "read_timeouts",
              "disk_write_failures", "demoted_host", "demoted_disk", "plans_fetch",
              "plans_recompute", "plans_split", "plan_s", "calibration_s", "fetch_s",
              "fetch_wait_s"):
      out.setdefault(k, 0)
    return out

  def pin(self, tokens: Sequence[int], tenant: str = "default") -> int:
    """Keeps a prefix (a system prompt, a shared document) resident on device.

    Computes its full blocks on every data shard that lacks them, then holds a reference
    on them, so no eviction touches them and requests on any shard reuse them, until
    ``unpin`` with the same arguments. Returns the number of blocks pinned per shard.
    """
    index = self.cache.index
    keys = index.block_keys(np.asarray(tokens, np.int32), tenant)
    if not keys:
      raise ValueError(f"pin needs at least one full block ({self.cache.config.page_size} "
                       f"tokens); got {len(tokens)} tokens.")
    pinned = []
    try:
      for s in range(self.cache.num_shards):
        if len(index.match(s, keys)) < len(keys):
          self._force_shard = s
          self.generate([list(tokens)], 1, tenant)
        pages = index.match(s, keys)
        if len(pages) < len(keys):
          raise CapacityError(f"could not keep {len(keys)} blocks on shard {s}.")
        index.acquire(s, pages)
        pinned.append((s, pages))
    except BaseException:
      for s, pages in pinned:
        index.release(s, pages)
      raise
    finally:
      self._force_shard = None
    self._pins.setdefault((tenant, keys[-1]), []).append(pinned)
    return len(keys)

  def unpin(self, tokens: Sequence[int], tenant: str = "default") -> None:
    """Releases one ``pin`` of the same prefix."""
    index = self.cache.index
    keys = index.block_keys(np.asarray(tokens, np.int32), tenant)
    held = self._pins.get((tenant, keys[-1]) if keys else None)
    if not held:
      raise ValueError("unpin of a prefix that is not pinned (same tokens and tenant as pin).")
    for s, pages in held.pop():
      index.release(s, pages)

  def offload(self) -> int:
    """Moves every unreferenced cached block out of device memory (copying it down first
    under write-back) and frees its page. Returns the number of blocks moved out."""
    index = self.cache.index
    victims = []
    for s in range(self.cache.num_shards):
      for key in index.cached_keys(s, Tier.DEVICE):
        page = index.slot_of(s, key, Tier.DEVICE)
        if index.refcount(s, page) == 0:
          victims.append((s, page, key))
    self._mover.demote(self._flat_pools(), victims)
    for s in range(self.cache.num_shards):
      index.evict_all_unreferenced(s, Tier.DEVICE)
    return len(victims)

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits for lower-tier writes in flight; returns how many did not finish in time."""
    return self._mover.flush(timeout_s)

  def warmup(self, max_seq_len: int | None = None, rows_per_shard: Sequence[int] | None = None
             ) -> int:
    """Compiles the prefill and decode steps for every shape bucket a workload can use.

    ``max_seq_len`` bounds prompt + generated tokens (default: the config's maximum);
    ``rows_per_shard`` lists batch buckets (default: every power of two up to
    ``max_seqs_per_shard``). With lower tiers, also compiles their page transfers. Runs
    all-padding steps, which change no page. Returns the number of (prefill, decode)
    bucket pairs compiled.
    """
    c = self.cache.config
    max_seq_len = c.max_seq_len if max_seq_len is None else min(int(max_seq_len), c.max_seq_len)
    if rows_per_shard is None:
      top = _pow2_at_least(self.config.max_seqs_per_shard)
      rows_per_shard = [1 << i for i in range(top.bit_length()) if 1 << i <= top]
    widths = sorted({self._table_width(n) for n in range(1, -(-max_seq_len // c.page_size) + 1)})
    chunk = self.config.prefill_chunk_pages * c.page_size
    n = 0
    for rows in sorted({_pow2_at_least(r) for r in rows_per_shard}):
      num_rows = rows * self.cache.num_shards
      z = lambda *shape: self._put_rows(np.zeros(shape, np.int32))
      pad = lambda *shape: self._put_rows(np.full(shape, -1, np.int32))
      for width in widths:
        table = z(num_rows, width)
        self._pages, carry, _ = self._prefill(
            self._pages, self._rest, z(num_rows, chunk), z(num_rows), table, pad(num_rows, chunk),
            z(num_rows), z(num_rows), self._put_rows(np.zeros((num_rows,), bool)))
        self._pages, carry, _ = self._decode(self._pages, self._rest, carry, table,
                                             pad(num_rows, 1), z(num_rows))
        n += 1
    top = max(sorted({_pow2_at_least(r) for r in rows_per_shard}))
    self._set_flat_pools(self._mover.warmup(self._flat_pools(), top * max(widths)))
    if self.scheduler.policy == "cost" and (self.cache.host or self.cache.disk):
      if self.costs is None:
        from jaxkv import calibration
        self.costs = calibration.calibrate(self)
      for m in sorted({max(8, _pow2_at_least(w)) for w in widths}):
        self._plan_shape(8, m, self.cache.num_shards)  # placement: one request, every shard
      r = 8
      while True:  # the plan's buckets: requests (>= 8) x blocks (>= 8)
        for m in sorted({max(8, _pow2_at_least(w)) for w in widths}):
          self._plan_shape(r, m)
        if r >= top * self.cache.num_shards:
          break
        r *= 2
    jax.block_until_ready(self._pages)
    return n

  def _table_width(self, pages_needed: int) -> int:
    """Page-table width bucket: a power of two, at least one attention chunk."""
    c = self.cache.config
    return min(max(_pow2_at_least(pages_needed), c.attention_chunk_pages), c.max_pages_per_seq)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
               tenant: str = "default", *, return_logits: bool = False):
    """Greedy generation. Returns the new token ids per prompt (a list of lists).

    With ``return_logits=True`` returns ``(tokens, logits)`` where ``logits[i]`` is a
    ``[max_new_tokens, vocab]`` float32 array: the logits each token was chosen from.
    """
    t_start = time.perf_counter()
    requests = self._validate(prompts, max_new_tokens, tenant)
    outputs: list = [None] * len(requests)
    logits_out: list = [None] * len(requests)
    long = [r for r in requests if r.streamed]
    pending = collections.deque(r for r in requests if not r.streamed)
    while pending:
      wave = self._admit(pending)
      self._run_wave(wave, t_start, outputs, logits_out if return_logits else None)
    for r in long:
      self._run_stream(r, t_start, outputs, logits_out if return_logits else None)
    if return_logits:
      return outputs, logits_out
    return outputs

  # ---- admission -----------------------------------------------------------------------------
  def _validate(self, prompts, max_new_tokens, tenant) -> list[_Request]:
    c = self.cache.config
    if not isinstance(tenant, str) or not tenant:
      raise ValueError(f"tenant={tenant!r} must be a non-empty string, e.g. 'default'.")
    if (not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool)
        or max_new_tokens < 1):
      raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1.")
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
      prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
      raise ValueError("prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3]].")
    requests = []
    for i, p in enumerate(prompts):
      arr = np.asarray(p)
      if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"prompt {i} must be a non-empty 1-D list of token ids; got shape "
                         f"{arr.shape}.")
      if arr.dtype.kind not in "iu":
        raise ValueError(f"prompt {i} has dtype {arr.dtype}; token ids must be integers "
                         "(convert with np.asarray(prompt, np.int32)).")
      bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
      if bad.size:
        j = int(bad[0])
        raise ValueError(f"prompt {i} token {j} is {int(arr[j])}, outside the vocabulary "
                         f"[0, {self.vocab_size}).")
      total = len(arr) + max_new_tokens - 1
      streamed = total > c.max_seq_len
      if streamed:
        self._check_streamable(i, len(arr), max_new_tokens, total)
      tokens = arr.astype(np.int32)
      keys = (self.cache.index.block_keys(tokens, tenant)
              if self.config.prefix_reuse and not streamed else [])
      req = _Request(index=i, tokens=tokens, max_new_tokens=int(max_new_tokens), tenant=tenant,
                     keys=keys, num_pages_needed=-(-total // c.page_size), streamed=streamed)
      requests.append(req)
    # Refuse before any work what no wave could ever hold (pages held outside this call,
    # e.g. pinned blocks, can make the free budget smaller than the pool).
    index = self.cache.index
    room = max(index.num_available(s) for s in range(self.cache.num_shards))
    for req in requests:
      if not req.streamed and req.num_pages_needed > room:
        raise CapacityError(
            f"prompt {req.index} needs {req.num_pages_needed} device pages but at most {room} "
            f"are free or evictable on any shard (pages_per_shard={c.pages_per_shard}); "
            "release pinned blocks or raise pages_per_shard.")
    return requests

  def _check_streamable(self, i: int, prompt_len: int, max_new_tokens: int, total: int) -> None:
    """Refuses, before any work, a sequence that even the lower tiers cannot hold."""
    c, st = self.cache.config, self.stream
    if st is None:
      raise ValueError(
          f"prompt {i} has {prompt_len} tokens + max_new_tokens={max_new_tokens} needs KV for "
          f"{total} tokens, more than a sequence can hold (max_pages_per_seq="
          f"{c.max_pages_per_seq} x page_size={c.page_size} = {c.max_seq_len}). Shorten the "
          "prompt, lower max_new_tokens, raise max_pages_per_seq, or stream long contexts "
          "from host memory (Engine(..., stream=jaxkv.StreamConfig(...))).")
    cold = -(-total // c.page_size) - st.sink_pages - st.window_pages
    room = min(st.max_cold_pages, max(self.cache.index.num_available(s, Tier.HOST)
                                      for s in range(self.cache.num_shards)))
    if st.source == "disk":
      room = min(room, self.cache.index.num_available(0, Tier.DISK))
    if cold > room:
      raise CapacityError(
          f"prompt {i} needs {cold} pages in host memory beyond the {st.sink_pages} sink and "
          f"{st.window_pages} window pages on device, but a shard can give it {room} "
          f"(StreamConfig.max_cold_pages={st.max_cold_pages}, host pages free or evictable); "
          "raise host_pages_per_shard or max_cold_pages, or shorten the request.")

  def _admit(self, pending: collections.deque) -> list[_Request]:
    index = self.cache.index
    num_shards = self.cache.num_shards
    slots = self.config.max_seqs_per_shard
    load = [0] * num_shards
    wave: list[_Request] = []
    waiting = collections.deque()
    while pending:
      req = pending.popleft()
      usable = (len(req.tokens) - 1) // self.cache.config.page_size  # >= 1 token to compute
      keys = req.keys[:usable]
      found = [index.locate(s, keys) if keys else [] for s in range(num_shards)]
      found = self._with_other_shards(found)
      remote = self._remote_prefix(keys, max(len(f) for f in found))
      if remote:
        peer, n = remote
        found = [f + [(Tier.REMOTE, peer)] * (n - len(f)) for f in found]
      on_device = [sum(t == Tier.DEVICE for t, _ in f) for f in found]
      predicted = self._shard_costs(req, found)
      if predicted is not None:  # the plan's predicted time on each shard decides
        order = sorted(range(num_shards), key=lambda s: (predicted[s], load[s], s))
      else:
        order = sorted(range(num_shards),
                       key=lambda s: (-len(found[s]), -on_device[s], load[s], s))
      if self._force_shard is not None:
        order = [self._force_shard]
      for s in order:
        if load[s] < slots and self._place(req, s, found[s]):
          load[s] += 1
          wave.append(req)
          break
      else:
        waiting.append(req)
    pending.extend(waiting)
    if not wave:  # cannot happen after _validate's room check unless pages leaked
      raise CapacityError("no request fits in an empty wave; the cache's page budget is held "
                          "elsewhere.")
    return wave

  def _shard_costs(self, req: _Request, found: list) -> np.ndarray | None:
    """Predicted time of ``req`` on every shard (cost policy, and only when some shard's
    prefix is not all on device: otherwise the longest device prefix wins anyway)."""
    if (self.scheduler.policy != "cost" or self.costs is None or self.cache.num_shards == 1
        or all(t == Tier.DEVICE for f in found for t, _ in f)):
      return None
    c = self.cache.config
    code = {Tier.HOST: sched.HOST, Tier.DISK: sched.DISK, Tier.REMOTE: sched.REMOTE,
            Tier.DEVICE: sched.HOT, Tier.SHARD: sched.SHARD}
    d = self.cache.num_shards
    end = max(len(f) for f in found)
    m_pad = max(8, _pow2_at_least(end))
    tiers = np.full((8, d, m_pad), sched.ABSENT, np.int32)
    hot = np.zeros((8, d), np.int32)
    for s, f in enumerate(found):
      tiers[0, s, :len(f)] = [code[t] for t, _ in f]
      hot[0, s] = next((j for j, (t, _) in enumerate(f) if t != Tier.DEVICE), len(f))
    inputs = sched.PlanInputs(
        tiers=tiers, block_bytes=np.full(tiers.shape, c.page_bytes, np.float32), hot=hot,
        cached_end=np.full((8, d), end, np.int32),
        tail_tokens=np.full((8,), len(req.tokens) - end * c.page_size, np.int32),
        free_pages=np.full((d,), m_pad, np.int32),
        inflight_blocks=np.full((d,), self.scheduler.inflight_blocks or m_pad, np.int32),
        link_group=np.zeros((d,), np.int32), valid=np.arange(8) == 0, page_size=c.page_size,
        chunk_tokens=self.config.prefill_chunk_pages * c.page_size)
    t0 = time.perf_counter()
    out = to_host(sched.plan(inputs, self.costs.arrays()).t_pred_s)[0]
    self._stats["plan_s"] += time.perf_counter() - t0
    return out

  def _with_other_shards(self, found: list) -> list:
    """Extends each shard's cached prefix with blocks another shard holds on device: a
    request placed there can copy them across (a collective) instead of recomputing."""
    lead = [next((j for j, (t, _) in enumerate(f) if t != Tier.DEVICE), len(f)) for f in found]
    best = max(range(len(found)), key=lambda s: (lead[s], -s))
    if lead[best] == 0 or len(found) == 1:
      return found
    src = [(Tier.SHARD, (best, slot)) for _, slot in found[best][:lead[best]]]
    return [f if s == best or len(f) >= lead[best] else f + src[len(f):]
            for s, f in enumerate(found)]

  def _remote_prefix(self, keys: list, local: int) -> tuple[int, int] | None:
    """``(peer, blocks)`` of the peer holding the longest prefix of ``keys``, when it is
    longer than what the local tiers hold."""
    best = None
    if len(keys) > local:
      for i, client in enumerate(self.cache.remotes):
        n = client.lookup(keys)
        if n > local and (best is None or n > best[1]):
          best = (i, n)
    return best

  def _place(self, req: _Request, shard: int, found: list) -> bool:
    """Takes references for ``req`` on ``shard``: its hits (pinned) and fresh pages."""
    index = self.cache.index
    local = lambda t: t in LOCAL_TIERS
    # A device block after a lower-tier one is left out (with what follows): a split may
    # recompute that stretch, and recomputing must never write into a shared page.
    lower = [j for j, (t, _) in enumerate(found) if t != Tier.DEVICE]
    if lower:
      later = [j for j, (t, _) in enumerate(found) if t == Tier.DEVICE and j > lower[0]]
      if later:
        found = found[:later[0]]

    def pins(take: bool):
      for tier, slot in found:
        if local(tier):
          (index.acquire if take else index.release)(shard, [slot], tier)
        elif tier == Tier.SHARD:  # the source page on the other shard stays put meanwhile
          (index.acquire if take else index.release)(slot[0], [slot[1]], Tier.DEVICE)

    pins(True)
    n_device = sum(t == Tier.DEVICE for t, _ in found)
    evicted: list = []
    fresh = index.allocate(shard, req.num_pages_needed - n_device, Tier.DEVICE, evicted=evicted)
    if fresh is None:
      pins(False)
      return False
    if evicted:  # copy the evicted blocks down before their pages are overwritten
      self._mover.demote(self._flat_pools(), [(shard, p, k) for k, p in evicted])
    req.shard, req.pages, req.fetches = shard, [], []
    fresh = collections.deque(fresh)
    for j, (tier, slot) in enumerate(found):
      if tier == Tier.DEVICE:
        req.pages.append(slot)
      else:
        page = fresh.popleft()
        req.pages.append(page)
        req.fetches.append(Fetch(req, j, shard, tier, slot, req.keys[j], page))
    req.pages.extend(fresh)
    req.hit_blocks = len(found)
    req.hit_tiers = [t for t, _ in found]
    return True

  # ---- execution ------------------------------------------------------------------------------
  def _put_rows(self, x: np.ndarray) -> jax.Array:
    return jax.device_put(x, self._row_sharding(x.ndim))

  def _run_wave(self, wave: list[_Request], t_start: float, outputs, logits_out) -> None:
    num_shards = self.cache.num_shards
    per_shard = collections.Counter(r.shard for r in wave)
    rows_per_shard = _pow2_at_least(max(per_shard.values()))
    num_rows = num_shards * rows_per_shard
    slot = collections.Counter()
    for r in wave:
      r.row = r.shard * rows_per_shard + slot[r.shard]
      slot[r.shard] += 1
    width = self._table_width(max(r.num_pages_needed for r in wave))
    table = np.zeros((num_rows, width), np.int32)
    for r in wave:
      table[r.row, :len(r.pages)] = r.pages
    page_table = self._put_rows(table)

    try:
      self._plan_wave(wave)
      self._prefill_wave(wave, num_rows, page_table, t_start, logits_out)
      generated = self._decode_wave(wave, num_rows, page_table, logits_out)
    finally:
      for r in wave:
        self.cache.index.release(r.shard, r.pages)
      if not self._pages_alive():
        # A failed step consumed the donated pools: the cached bytes are gone, so the
        # index forgets every block and the pools start again from zeros.
        self._reset_pages_after_failure()

    self._mover.pump()
    for r in wave:
      outputs[r.index] = generated[r.index]
    self._stats["waves"] += 1
    self._stats["requests"] += len(wave)
    self._stats["generated_tokens"] += sum(r.max_new_tokens for r in wave)

  def _prefill_wave(self, wave, num_rows, page_table, t_start, logits_out) -> None:
    """Recomputes each request's planned stretch while its fetches are in flight, then
    verifies the fetches and prefills everything after the last good block."""
    c = self.cache.config
    page = c.page_size
    fetches = [f for r in wave for f in r.fetches]
    pending = None
    if fetches:
      pools, pending = self._mover.start_promote(self._flat_pools(), fetches)
      self._set_flat_pools(pools)
    carry = self._put_rows(np.zeros((num_rows,), np.int32))
    recompute = {r.index: (r.hot_blocks * page, r.split * page) for r in wave
                 if r.split > r.hot_blocks}
    t_compute = time.perf_counter()
    if recompute:
      carry = self._prefill_range(wave, recompute, carry, num_rows, page_table)
    if pending is not None:
      t_end = time.monotonic() + self.cache.tiers.read_deadline_s
      self._set_flat_pools(self._mover.finish_promote(self._flat_pools(), pending, t_end))
      self._settle_fetches(wave)
    if recompute:
      self._observe_recompute(wave, recompute, time.perf_counter() - t_compute)
    for r in wave:
      reused = r.hot_blocks + (r.hit_blocks - r.split if r.hit_blocks > r.split else 0)
      for j in list(range(r.hot_blocks)) + list(range(r.split, r.hit_blocks)):
        self._hits[TIER_NAMES[r.hit_tiers[j]]] += 1
      self.cache.index.record_hits(r.keys[:r.hit_blocks])
      self._stats["hit_tokens"] += reused * page
      self._stats["prompt_tokens"] += len(r.tokens)
      self._stats["computed_tokens"] += len(r.tokens) - reused * page
      self._stats["blocks_recomputed"] += len(r.tokens) // page - reused
      self._stats["blocks_split"] += (r.split - r.hot_blocks) if r.hot_blocks < r.split < r.cold_end else 0
    rest = {r.index: (max(r.hit_blocks, r.split) * page, len(r.tokens)) for r in wave}
    self._first_tokens = self._prefill_range(wave, rest, carry, num_rows, page_table,
                                             t_start=t_start, logits_out=logits_out)
    if self.config.prefix_reuse:
      published = []
      for r in wave:  # every block this wave computed is written: publish them
        computed = list(range(r.hot_blocks, r.split)) + list(
            range(max(r.hit_blocks, r.split), len(r.tokens) // page))
        for j in computed:
          self._publish(r.shard, r.pages[j], r.keys, j, published)
      self._write_through(published)

  def _prefill_range(self, wave, ranges: dict, carry, num_rows, page_table, *,
                     t_start: float | None = None, logits_out=None):
    """Prefills tokens ``[a, b)`` of each request in ``ranges`` (by request index), in
    block-aligned chunks, all rows in lockstep. With ``t_start``, ``b`` is the prompt's
    end: the last token's logits give the first generated token (TTFT is taken there)."""
    chunk = self.config.prefill_chunk_pages * self.cache.config.page_size
    num_steps = max(-(-(b - a) // chunk) for a, b in ranges.values())
    for step in range(num_steps):
      tokens = np.zeros((num_rows, chunk), np.int32)
      positions = np.full((num_rows, chunk), -1, np.int32)
      kv_lens = np.zeros((num_rows,), np.int32)
      select_idx = np.zeros((num_rows,), np.int32)
      select_mask = np.zeros((num_rows,), bool)
      finishing = []
      for r in wave:
        if r.index not in ranges:
          continue
        start, end = ranges[r.index]
        a = start + step * chunk
        b = min(a + chunk, end)
        if a >= b:
          continue
        tokens[r.row, :b - a] = r.tokens[a:b]
        positions[r.row, :b - a] = np.arange(a, b)
        kv_lens[r.row] = b
        if t_start is not None and b == len(r.tokens):
          select_idx[r.row], select_mask[r.row] = b - a - 1, True
          finishing.append(r)
      self._pages, carry, selected = self._prefill(
          self._pages, self._rest, self._put_rows(tokens), carry, page_table,
          self._put_rows(positions), self._put_rows(kv_lens), self._put_rows(select_idx),
          self._put_rows(select_mask))
      self._stats["prefill_steps"] += 1
      if finishing:
        carry.block_until_ready()  # the first token exists now: that is TTFT
        now = time.perf_counter() - t_start
        for r in finishing:
          self._ttft.append(now)
        if logits_out is not None:
          sel = to_host(selected)
          for r in finishing:
            logits_out[r.index] = [sel[r.row]]
    return carry

  def _decode_wave(self, wave, num_rows, page_table, logits_out) -> dict[int, list[int]]:
    c = self.cache.config
    carry = self._first_tokens
    produced = [carry]
    for step in range(1, max(r.max_new_tokens for r in wave)):
      positions = np.full((num_rows, 1), -1, np.int32)
      kv_lens = np.zeros((num_rows,), np.int32)
      for r in wave:
        if step < r.max_new_tokens:
          pos = len(r.tokens) + step - 1  # where the previous token's KV goes
          positions[r.row, 0] = pos
          kv_lens[r.row] = pos + 1
      self._pages, carry, selected = self._decode(
          self._pages, self._rest, carry, page_table, self._put_rows(positions),
          self._put_rows(kv_lens))
      self._stats["decode_steps"] += 1
      produced.append(carry)
      if logits_out is not None:
        sel = to_host(selected)
        for r in wave:
          if step < r.max_new_tokens:
            logits_out[r.index].append(sel[r.row])
    all_tokens = np.stack([to_host(t) for t in produced], axis=1)  # [rows, steps]
    generated = {r.index: all_tokens[r.row, :r.max_new_tokens].tolist() for r in wave}
    if logits_out is not None:
      for r in wave:
        logits_out[r.index] = np.stack(logits_out[r.index])
    if self.config.prefix_reuse and self.config.cache_decode_blocks:
      published = []
      for r in wave:
        written = np.concatenate([r.tokens, np.asarray(generated[r.index][:-1], np.int32)])
        keys = self.cache.index.block_keys(written, r.tenant)
        for j in range(len(r.tokens) // c.page_size, len(keys)):
          self._publish(r.shard, r.pages[j], keys, j, published)
      self._write_through(published)
    return generated

  def _publish(self, shard, page, keys, j, published: list) -> None:
    if self.cache.index.publish(shard, page, keys[j], parent=keys[j - 1] if j else None):
      published.append((shard, page, keys[j]))

  def _write_through(self, published: list) -> None:
    if published and self.cache.tiers.write_policy == "write_through":
      self._mover.copy_down(self._flat_pools(), published)

  def _plan_wave(self, wave: list[_Request]) -> None:
    """Chooses each request's split point s: blocks [hot, s) are recomputed, [s, end)
    fetched. The pins of cached blocks that will be recomputed are released here."""
    page = self.cache.config.page_size
    for r in wave:
      r.hot_blocks = next((j for j, t in enumerate(r.hit_tiers) if t != Tier.DEVICE),
                          len(r.hit_tiers))
      r.cold_end = r.hit_blocks
      r.split = r.hot_blocks
    cold = [r for r in wave if r.cold_end > r.hot_blocks]
    if not cold:
      return
    pol = self.scheduler
    if pol.policy == "cost":
      splits = self._cost_splits(cold)
    for i, r in enumerate(cold):
      if pol.policy == "cost":
        r.split = int(splits[i])
      elif pol.policy == "fetch":
        r.split = r.hot_blocks
      elif pol.policy == "recompute":
        r.split = r.cold_end
      elif pol.policy == "threshold":
        cached_tokens = (r.cold_end - r.hot_blocks) * page
        r.split = r.hot_blocks if cached_tokens >= pol.threshold_tokens else r.cold_end
      else:  # "split": forced
        r.split = min(r.hot_blocks + pol.force_split, r.cold_end)
      decision = ("recompute" if r.split == r.cold_end else
                  "fetch" if r.split == r.hot_blocks else "split")
      self._stats[f"plans_{decision}"] += 1
      skipped = [f for f in r.fetches if f.block < r.split]
      for f in skipped:  # cached below, but recomputing them is the plan
        self._mover.release_pin(f)
      r.fetches = [f for f in r.fetches if f.block >= r.split]

  def _cost_splits(self, cold: list[_Request]) -> np.ndarray:
    if self.costs is None:
      from jaxkv import calibration
      t0 = time.perf_counter()
      self.costs = calibration.calibrate(self)
      self._stats["calibration_s"] += time.perf_counter() - t0
    c = self.cache.config
    r_pad = max(8, _pow2_at_least(len(cold)))
    m_pad = max(8, _pow2_at_least(max(r.cold_end for r in cold)))
    code = {Tier.HOST: sched.HOST, Tier.DISK: sched.DISK, Tier.REMOTE: sched.REMOTE,
            Tier.DEVICE: sched.HOT, Tier.SHARD: sched.SHARD}
    tiers = np.full((r_pad, 1, m_pad), sched.ABSENT, np.int32)
    hot = np.zeros((r_pad, 1), np.int32)
    end = np.zeros((r_pad, 1), np.int32)
    tail = np.zeros((r_pad,), np.int32)
    for i, r in enumerate(cold):
      tiers[i, 0, :r.cold_end] = [code[t] for t in r.hit_tiers[:r.cold_end]]
      hot[i, 0], end[i, 0] = r.hot_blocks, r.cold_end
      tail[i] = len(r.tokens) - r.cold_end * c.page_size
    budget = self.scheduler.inflight_blocks or m_pad
    inputs = sched.PlanInputs(
        tiers=tiers, block_bytes=np.full(tiers.shape, c.page_bytes, np.float32), hot=hot,
        cached_end=end, tail_tokens=tail, free_pages=np.full((1,), m_pad, np.int32),
        inflight_blocks=np.full((1,), budget, np.int32), link_group=np.zeros((1,), np.int32),
        valid=np.arange(r_pad) < len(cold), page_size=c.page_size,
        chunk_tokens=self.config.prefill_chunk_pages * c.page_size)
    t0 = time.perf_counter()
    out = sched.plan(inputs, self.costs.arrays())
    splits = to_host(out.split)[:len(cold), 0]
    self._stats["plan_s"] += time.perf_counter() - t0
    self.last_plan = out
    return splits

  def _plan_shape(self, r_pad: int, m_pad: int, d: int = 1) -> None:
    """Compiles the plan for one bucket (all padding requests)."""
    c = self.cache.config
    z = lambda *shape: np.zeros(shape, np.int32)
    inputs = sched.PlanInputs(
        tiers=np.full((r_pad, d, m_pad), sched.ABSENT, np.int32),
        block_bytes=np.zeros((r_pad, d, m_pad), np.float32), hot=z(r_pad, d),
        cached_end=z(r_pad, d), tail_tokens=z(r_pad), free_pages=z(d), inflight_blocks=z(d),
        link_group=z(d),
        valid=np.zeros((r_pad,), bool), page_size=c.page_size,
        chunk_tokens=self.config.prefill_chunk_pages * c.page_size)
    jax.block_until_ready(sched.plan(inputs, self.costs.arrays()))

  def _settle_fetches(self, wave: list[_Request]) -> None:
    """After verification: a failed fetch ends that request's reuse at its block."""
    for r in wave:
      for f in sorted(r.fetches, key=lambda f: f.block):
        if not f.ok and f.block < r.hit_blocks:
          r.hit_blocks = f.block  # recompute from the first bad block on
        if not f.ok:
          self._mover.drop_failed(f)
      for f in r.fetches:  # verified and still part of the hit: the device copy is good
        if f.ok and f.block < r.hit_blocks:
          self._publish(r.shard, f.page, r.keys, f.block, [])
      r.fetches = []
    if self.costs is not None and self._mover.last_fetch.get("bytes"):
      lf = self._mover.last_fetch
      link = ("remote_to_host" if int(Tier.REMOTE) in lf["tiers"] else
              "disk_to_host" if int(Tier.DISK) in lf["tiers"] else
              "host_to_device" if int(Tier.HOST) in lf["tiers"] else "cross_shard")
      self.costs.observe_transfer(link, lf["bytes"], lf["seconds"])

  def _observe_recompute(self, wave, ranges: dict, seconds: float) -> None:
    if self.costs is None:
      return
    longest = max(ranges.values(), key=lambda ab: ab[1] - ab[0])
    self.costs.observe_prefill(longest[1] - longest[0], longest[0], seconds)

  # ---- long sequences: hot pages on device, cold pages streamed from host ----------------
  def _run_stream(self, r: _Request, t_start: float, outputs, logits_out) -> None:
    """Prefills and decodes one sequence longer than the device pool holds.

    Its first ``sink_pages`` and latest ``window_pages`` pages stay on device; when the
    window moves on, its oldest page is copied to a host slot and its device page reused.
    Every step attends over the hot pages and streams the cold ones from host memory.
    The sequence's blocks are not published for reuse.
    """
    c, st, index = self.cache.config, self.stream, self.cache.index
    shards, page = self.cache.num_shards, c.page_size
    shard = max(range(shards), key=lambda s: (index.num_available(s, Tier.HOST), -s))
    n_dev = st.sink_pages + st.window_pages + self.config.prefill_chunk_pages
    dev = index.allocate(shard, n_dev)
    if dev is None:
      raise CapacityError(f"shard {shard} cannot give {n_dev} device pages to a streamed "
                          "sequence now; pages are held elsewhere.")
    import secrets
    state = _StreamState(free=list(dev), block_page={}, cold=[], dev=list(dev),
                         nonce=secrets.token_bytes(16))
    width = _pow2_at_least(r.num_pages_needed)
    r.shard, r.row = shard, shard  # one row per shard; this one is ours
    try:
      carry = self._put_rows(np.zeros((shards,), np.int32))
      chunk = self.config.prefill_chunk_pages * page
      for a in range(0, len(r.tokens), chunk):
        b = min(a + chunk, len(r.tokens))
        self._stream_make_room(r, state, a // page, -(-b // page))
        tokens = np.zeros((shards, chunk), np.int32)
        positions = np.full((shards, chunk), -1, np.int32)
        kv_lens = np.zeros((shards,), np.int32)
        tokens[shard, :b - a] = r.tokens[a:b]
        positions[shard, :b - a] = np.arange(a, b)
        kv_lens[shard] = b
        last = b == len(r.tokens)
        sel = np.zeros((shards,), np.int32)
        mask = np.zeros((shards,), bool)
        sel[shard], mask[shard] = b - a - 1, last
        if st.source == "disk":
          self._stream_stage(r, state)
        table, stream = self._stream_batch(r, state, width)
        self._pages, carry, selected = self._prefill(
            self._pages, self._rest, self._put_rows(tokens), carry, table,
            self._put_rows(positions), self._put_rows(kv_lens), self._put_rows(sel),
            self._put_rows(mask), stream)
        self._stats["prefill_steps"] += 1
        self._stream_unstage(r, state)
      carry.block_until_ready()
      self._ttft.append(time.perf_counter() - t_start)
      produced, logits = [carry], [to_host(selected)[shard]] if logits_out is not None else []
      for step in range(1, r.max_new_tokens):
        pos = len(r.tokens) + step - 1
        self._stream_make_room(r, state, pos // page, pos // page + 1)
        positions = np.full((shards, 1), -1, np.int32)
        kv_lens = np.zeros((shards,), np.int32)
        positions[shard, 0], kv_lens[shard] = pos, pos + 1
        if st.source == "disk":
          self._stream_stage(r, state)
        table, stream = self._stream_batch(r, state, width)
        self._pages, carry, selected = self._decode(
            self._pages, self._rest, carry, table, self._put_rows(positions),
            self._put_rows(kv_lens), stream)
        self._stats["decode_steps"] += 1
        self._stream_unstage(r, state)
        produced.append(carry)
        if logits_out is not None:
          logits.append(to_host(selected)[shard])
      tokens_out = np.stack([to_host(t) for t in produced], axis=1)[shard].tolist()
    finally:
      index.release(shard, state.dev)
      index.release(shard, state.cold, Tier.HOST)
      if state.disk:  # the records name no block anyone can ask for: remove them
        index.release(0, state.disk, Tier.DISK)
        for slot in state.disk:
          self.cache.disk.delete(slot)
    outputs[r.index] = tokens_out
    if logits_out is not None:
      logits_out[r.index] = np.stack(logits)
    self._stats["requests"] += 1
    self._stats["streamed_requests"] += 1
    self._stats["prompt_tokens"] += len(r.tokens)
    self._stats["computed_tokens"] += len(r.tokens)
    self._stats["generated_tokens"] += r.max_new_tokens
    self._stats["streamed_pages"] += max(len(state.cold), len(state.disk))

  def _stream_make_room(self, r: _Request, state, lo: int, hi: int) -> None:
    """Gives blocks ``[lo, hi)`` device pages, moving the oldest window pages to host."""
    st, index, c = self.stream, self.cache.index, self.cache.config
    need = [j for j in range(lo, hi) if j not in state.block_page]
    short = len(need) - len(state.free)
    if short > 0:
      movable = sorted(j for j in state.block_page if j >= st.sink_pages and j < lo)
      victims = movable[:short]
      if len(victims) < short:
        raise CapacityError("a streamed sequence ran out of device pages for its window.")
      slots = []
      for _ in victims:
        evicted: list = []
        slot = index.allocate(r.shard, 1, Tier.HOST, evicted=evicted)
        if slot is None:
          raise CapacityError("the host tier has no room left for a streamed sequence.")
        if evicted and self.cache.disk is not None:  # cached host blocks go on to disk
          self._mover._host_to_disk([(r.shard, p, k) for k, p in evicted])
        slots.append(slot[0])
      ids = np.zeros((self.cache.num_shards, len(victims)), np.int32)
      host_ids = np.full(ids.shape, self.cache.host.pages_per_shard, np.int32)
      ids[r.shard] = [state.block_page[j] for j in victims]
      host_ids[r.shard] = slots
      stack = pages_lib.gather_stacked(self._flat_pools(), self._put_rows(ids), mesh=self.mesh,
                                       config=c)
      if st.source == "disk":
        self._stream_to_disk(r, state, victims, to_host(stack), slots)
      else:
        self.cache.host.store(stack, host_ids)
      for j, slot in zip(victims, slots):
        if st.source == "host":
          assert j == st.sink_pages + len(state.cold), "cold pages must stay contiguous"
          state.cold.append(slot)
        state.free.append(state.block_page.pop(j))
      self._stats["stream_demotions"] += len(victims)
    for j in need:
      state.block_page[j] = state.free.pop()

  def _stream_key(self, state, block: int) -> bytes:
    import hashlib
    return hashlib.sha256(state.nonce + block.to_bytes(8, "little")).digest()

  def _stream_to_disk(self, r, state, victims, stack, host_slots) -> None:
    """source='disk': the victims' pages go to disk records (durable before use)."""
    index, disk, st = self.cache.index, self.cache.disk, self.stream
    index.release(r.shard, host_slots, Tier.HOST)  # not needed: the pages go straight down
    n = stack.shape[2] // self.cache.num_shards
    writes = []
    for i, j in enumerate(victims):
      assert j == st.sink_pages + len(state.disk), "cold pages must stay contiguous"
      slot = index.allocate(0, 1, Tier.DISK)
      if slot is None:
        raise CapacityError("the disk tier has no room left for a streamed sequence.")
      state.disk.append(slot[0])
      payload = np.ascontiguousarray(stack[:, :, r.shard * n + i]).view(self.cache.config.jnp_dtype)
      writes.append(disk.write(slot[0], payload, self._stream_key(state, j), None))
    deadline = time.monotonic() + self.cache.tiers.read_deadline_s
    for w in writes:
      w.future.result(timeout=max(0.0, deadline - time.monotonic()))

  def _stream_stage(self, r, state) -> None:
    """source='disk': reads every cold record into host slots for the coming step."""
    index, disk, st = self.cache.index, self.cache.disk, self.stream
    if len(state.cold) == len(state.disk):
      return
    self._stream_unstage(r, state)
    slots = index.allocate(r.shard, len(state.disk), Tier.HOST)
    if slots is None:
      raise CapacityError("the host tier has no room to stage a streamed sequence's pages.")
    reads = [disk.read(s) for s in state.disk]  # all in flight
    deadline = time.monotonic() + self.cache.tiers.read_deadline_s
    bits = pages_lib.bits_dtype(self.cache.config.jnp_dtype)
    n = len(slots)
    stack = np.zeros((*self.cache.payload_shape[:2], self.cache.num_shards * n,
                      *self.cache.payload_shape[2:]), bits)
    for i, rd in enumerate(reads):
      record = rd.future.result(timeout=max(0.0, deadline - time.monotonic()))
      stack[:, :, r.shard * n + i] = disk.verify(
          record, self._stream_key(state, st.sink_pages + i)).view(bits)
    host_ids = np.full((self.cache.num_shards, n), self.cache.host.pages_per_shard, np.int32)
    host_ids[r.shard] = slots
    self.cache.host.store(jax.device_put(stack, self._mover._stack_sharding), host_ids)
    state.cold = list(slots)
    self._stats["stream_disk_reads"] += n

  def _stream_unstage(self, r, state) -> None:
    if self.stream.source == "disk" and state.cold:
      self.cache.index.release(r.shard, state.cold, Tier.HOST)
      state.cold = []

  def _stream_batch(self, r: _Request, state, width: int):
    st, shards = self.stream, self.cache.num_shards
    table = np.zeros((shards, width), np.int32)
    valid = np.zeros((shards, width), bool)
    for j, p in state.block_page.items():
      table[r.shard, j], valid[r.shard, j] = p, True
    cold_width = max(st.chunk_pages, _pow2_at_least(len(state.cold)))
    cold_width = -(-cold_width // st.chunk_pages) * st.chunk_pages
    slots = np.zeros((shards, cold_width), np.int32)
    slots[r.shard, :len(state.cold)] = state.cold
    first = np.full((shards,), st.sink_pages, np.int32)
    count = np.zeros((shards,), np.int32)
    count[r.shard] = len(state.cold)
    stream = kvnnx.StreamBatch(
        block_valid=self._put_rows(valid), host_pool=self.cache.host.pool,
        cold_slots=self._put_rows(slots), cold_first=self._put_rows(first),
        cold_count=self._put_rows(count), pages_per_chunk=st.chunk_pages)
    return self._put_rows(table), stream

  def _flat_pools(self) -> list:
    return jax.tree.leaves(self._pages)

  def _set_flat_pools(self, pools) -> None:
    self._pages = jax.tree.unflatten(jax.tree.structure(self._pages), list(pools))

  def _pages_alive(self) -> bool:
    return not any(x.is_deleted() for x in jax.tree.leaves(self._pages))

  def _reset_pages_after_failure(self) -> None:
    for s in range(self.cache.num_shards):
      self.cache.index.evict_all_unreferenced(s)
    kvnnx.init_pages(self.model, self.cache.config, self.mesh)
    _, self._pages, _ = nnx.split(self.model, kvnnx.KVPages, ...)

