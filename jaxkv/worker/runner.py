"""ModelRunner: the jitted prefill and decode steps, and the one builder of a step's batch.

A step runs the model over a batch of rows (``data_shards x rows_per_shard``, each data
shard's rows on its own devices) with the cache's page pools donated, so pages are written
in place. What a step needs besides the pools and the weights is a ``StepBatch``: tokens,
their absolute positions (``-1`` = padding), each row's KV length after the step, and for
prefill which token's logits give the row's next token. ``prefill_batch`` and
``decode_batch`` are the only places these arrays are built.

Shapes come from ``jaxkv.buckets``: rows per shard and page-table widths are powers of two,
a prefill step is ``prefill_chunk_pages * page_size`` tokens wide. Engines over models of
the same structure (graphdef), mesh and cache config share one compiled ``Steps``, so a
side-by-side comparison of two engines compares policies, not compilations, and each
bucket compiles once (``trace_counts`` records every trace; tests check it).

The runner asks only this of a model: ``model(tokens [B, T] int32, batch: PageBatch) ->
logits [B, T, vocab]``, with its attention layers holding ``jaxkv.nnx.PagedKV``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import buckets
from jaxkv.progress import Progress
from jaxkv import nnx as kvnnx
from jaxkv.worker import sampling as sampling_lib
from jaxkv.config import SamplingParams
from jaxkv.distributed import to_host, warm_gathers
from jaxkv.worker.sampling import RowSampling
from jaxkv.scheduling.step import FetchReport, StepPlan, StepResult, TierOrders


def _stream_key(stream):
  return None if stream is None else tuple(stream.cold_slots.shape)


def _table_shape(page_table) -> tuple:
  """A step's page table shape: one table, or a (table, window table) pair's first."""
  return tuple((page_table[0] if isinstance(page_table, tuple) else page_table).shape)


class Steps:
  """The jitted prefill and decode steps of one model structure on one mesh."""

  def __init__(self, graphdef, pool_def, weight_def, mesh, config):
    self.graphdef, self.mesh, self.config = graphdef, mesh, config
    self.pool_def, self.weight_def = pool_def, weight_def
    self.trace_counts: collections.Counter = collections.Counter()
    self.prefill = jax.jit(self._prefill_impl, donate_argnums=(0,))
    self.decode = jax.jit(self._decode_impl, donate_argnums=(0,))
    self.prefill_scored = jax.jit(self._prefill_scored_impl, donate_argnums=(0,))

  def _forward(self, pools, weights, tokens, page_table, positions, kv_lens, stream=None,
               logits_at=None):
    # The pools and weights travel flat (a list of arrays flattens at no cost on every
    # call; an nnx.State does not) and are put back in their trees here, at trace time.
    model = nnx.merge(self.graphdef, jax.tree.unflatten(self.pool_def, pools),
                      jax.tree.unflatten(self.weight_def, weights))
    window_table = None
    if isinstance(page_table, tuple):  # a model with a window group: its pages' table too
      page_table, window_table = page_table
    batch = kvnnx.PageBatch(page_table=page_table, positions=positions, kv_lens=kv_lens,
                            mesh=self.mesh, config=self.config, stream=stream,
                            logits_at=logits_at, window_table=window_table)
    logits = model(tokens, batch)
    return logits, jax.tree.leaves(nnx.state(model, kvnnx.KVPages))

  def _prefill_impl(self, pages, rest, tokens, carry, page_table, positions, kv_lens,
                    select_idx, select_mask, sampling, stream=None):
    self.trace_counts[("prefill", tokens.shape, _table_shape(page_table),
                       _stream_key(stream))] += 1
    logits, pages = self._forward(pages, rest, tokens, page_table, positions, kv_lens, stream,
                                  logits_at=select_idx)
    if logits.shape[1] != 1:  # a model that computed every token's logits
      logits = jnp.take_along_axis(logits, select_idx[:, None, None], axis=1)
    selected = logits[:, 0]  # [B, V]
    where = jnp.take_along_axis(positions, select_idx[:, None], axis=1)[:, 0] + 1
    next_tokens = sampling_lib.next_tokens(selected, sampling, where)
    return pages, jnp.where(select_mask, next_tokens, carry), selected

  def _prefill_scored_impl(self, pages, rest, tokens, carry, page_table, positions, kv_lens,
                           select_idx, select_mask, sampling, targets):
    """A prefill step that also scores every position's logits against ``targets [B, T]``
    (the prompt's next tokens): for prompt log-probabilities, which need every token's
    logits, not only the one that picks the next token."""
    self.trace_counts[("prefill_scored", tokens.shape, _table_shape(page_table), None)] += 1
    logits, pages = self._forward(pages, rest, tokens, page_table, positions, kv_lens)
    selected = jnp.take_along_axis(logits, select_idx[:, None, None], axis=1)[:, 0]
    where = jnp.take_along_axis(positions, select_idx[:, None], axis=1)[:, 0] + 1
    next_tokens = sampling_lib.next_tokens(selected, sampling, where)
    return (pages, jnp.where(select_mask, next_tokens, carry), selected,
            sampling_lib.logprobs_of(logits, targets))

  def _decode_impl(self, pages, rest, carry, page_table, positions, kv_lens, sampling,
                   stream=None):
    self.trace_counts[("decode", carry.shape, _table_shape(page_table),
                       _stream_key(stream))] += 1
    logits, pages = self._forward(pages, rest, carry[:, None], page_table, positions, kv_lens,
                                  stream)
    selected = logits[:, 0]
    live = positions >= 0  # the next step's inputs, so a steady batch needs no host arrays
    advanced = (jnp.where(live, positions + 1, positions),
                kv_lens + live[:, 0].astype(jnp.int32))
    return (pages, sampling_lib.next_tokens(selected, sampling, positions[:, 0] + 1), selected,
            advanced)

  def vocab_size(self, pages, rest, num_rows: int) -> int:
    """The model's vocabulary, read off the shape of its logits (no compile, no trace count)."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
    before = collections.Counter(self.trace_counts)
    table = i32(num_rows, 1)
    if self.config.has_windows:
      table = (table, i32(num_rows, 1))
    out = jax.eval_shape(self._decode_impl, pages, rest, i32(num_rows), table,
                         i32(num_rows, 1), i32(num_rows), RowSampling.greedy(num_rows))
    self.trace_counts.clear()
    self.trace_counts.update(before)
    return int(out[2].shape[-1])


@functools.lru_cache(maxsize=16)
def _compiled_steps(graphdef, pool_def, weight_def, mesh, config) -> Steps:
  return Steps(graphdef, pool_def, weight_def, mesh, config)


@dataclasses.dataclass(frozen=True)
class StepBatch:
  """One step's per-row inputs, on device (rows split over the data shards)."""

  positions: jax.Array  # [rows, T] int32 absolute positions, -1 = padding
  kv_lens: jax.Array  # [rows] int32 valid KV tokens after the step's write
  sampling: RowSampling  # how each row picks its next token (put once per batch of rows)
  tokens: jax.Array | None = None  # [rows, T] int32 (prefill; decode feeds the carry)
  select_idx: jax.Array | None = None  # [rows] int32 token whose logits pick the next token
  select_mask: jax.Array | None = None  # [rows] bool: the row's prompt ends in this step


# What a batch builder takes per row (plain tuples; the plan's ``PrefillChunk`` and
# ``DecodeRow`` are what the scheduler decided): a prefill input is (row, token ids,
# position of the first one, whether its logits give the row's next token), a decode input
# (row, position of the token fed in).
PrefillInput = tuple[int, np.ndarray, int, bool]
DecodeInput = tuple[int, int]


class ModelRunner:
  """Runs a model's steps over a ``KVCache``'s pools (taken from the model by ``attach``)."""

  def __init__(self, model: nnx.Module, cache, prefill_chunk_pages: int):
    self.cache = cache
    self.mesh, self.config = cache.mesh, cache.config
    graphdef, rest = cache.attach(model)
    # Weights already on this mesh keep their placement (e.g. split over the model axis
    # by from_pretrained); any other is replicated over it. Flat from here on.
    self.weights, weight_def = jax.tree.flatten(jax.tree.map(self._on_mesh, rest))
    self.steps = _compiled_steps(graphdef, cache.worker.pool_def, weight_def, self.mesh, self.config)
    self.chunk_tokens = prefill_chunk_pages * self.config.page_size
    # A chunk's width, and narrower steps for a prompt's last, partial chunk.
    self.prefill_widths = buckets.prefill_widths(self.chunk_tokens, self.config.page_size)
    self.vocab_size = self.steps.vocab_size(cache.worker.step_pools, self.weights,
                                            cache.num_shards)
    self._greedy: dict = {}  # rows -> RowSampling of all-greedy rows, on device
    self._zeros: dict = {}  # rows -> int32 zeros on device (a prefill's starting carry)
    self.warm_later: collections.deque = collections.deque()  # buckets warmup left to do
    self.warm_total = 0  # buckets the last warmup named
    # Device state between steps: the decoding rows as the last decode step left them
    # (request ids, row of each, table, next batch, tokens out), reused while the set is
    # unchanged; a decode step dispatched a step early; fetch groups issued, not settled.
    self._resident = None
    self._ahead = None
    self._pending: dict = {}

  def _on_mesh(self, leaf):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == self.mesh:
      return leaf
    return jax.device_put(leaf, NamedSharding(self.mesh, P()))

  @property
  def trace_counts(self) -> collections.Counter:
    return self.steps.trace_counts

  # ---- batches -------------------------------------------------------------------------------
  def row_sampling(self, params: dict[int, SamplingParams], num_rows: int) -> RowSampling:
    """The rows' sampling parameters on device (rows not in ``params``: greedy)."""
    if not params:  # all greedy: the same arrays every step
      if num_rows not in self._greedy:
        self._greedy[num_rows] = jax.tree.map(self.cache.put_rows, RowSampling.greedy(num_rows))
      return self._greedy[num_rows]
    host = RowSampling.greedy(num_rows)
    for row, sp in params.items():
      host.temperature[row], host.top_k[row] = sp.temperature, sp.top_k
      host.top_p[row], host.seed[row] = sp.top_p, sp.seed
    leaves, tree = jax.tree.flatten(host)
    return jax.tree.unflatten(tree, self.cache.put_rows_many(*leaves))

  def prefill_batch(self, rows: Sequence[PrefillInput], num_rows: int,
                    sampling: RowSampling | None = None, width: int | None = None
                    ) -> StepBatch:
    """The step's inputs, ``width`` tokens per row: by default the narrowest prefill
    width that holds every row's tokens (a whole chunk when there are none)."""
    chunk = width or (buckets.prefill_width(max(len(t) for _, t, _, _ in rows),
                                            self.prefill_widths) if rows
                      else self.chunk_tokens)
    tokens = np.zeros((num_rows, chunk), np.int32)
    positions = np.full((num_rows, chunk), -1, np.int32)
    kv_lens = np.zeros((num_rows,), np.int32)
    select_idx = np.zeros((num_rows,), np.int32)
    select_mask = np.zeros((num_rows,), bool)
    for row, toks, start, select in rows:
      n = len(toks)
      tokens[row, :n] = toks
      positions[row, :n] = np.arange(start, start + n)
      kv_lens[row] = start + n
      select_idx[row], select_mask[row] = n - 1, select
    positions, kv_lens, tokens, select_idx, select_mask = self.cache.put_rows_many(
        positions, kv_lens, tokens, select_idx, select_mask)
    return StepBatch(positions=positions, kv_lens=kv_lens, tokens=tokens,
                     select_idx=select_idx, select_mask=select_mask,
                     sampling=sampling or self.row_sampling({}, num_rows))

  def decode_batch(self, rows: Sequence[DecodeInput], num_rows: int,
                   sampling: RowSampling | None = None) -> StepBatch:
    positions = np.full((num_rows, 1), -1, np.int32)
    kv_lens = np.zeros((num_rows,), np.int32)
    for row, pos in rows:
      positions[row, 0], kv_lens[row] = pos, pos + 1
    positions, kv_lens = self.cache.put_rows_many(positions, kv_lens)
    return StepBatch(positions=positions, kv_lens=kv_lens,
                     sampling=sampling or self.row_sampling({}, num_rows))

  def zero_carry(self, num_rows: int) -> jax.Array:
    """A carry of zeros for ``num_rows`` rows (steps do not donate it: shared)."""
    if num_rows not in self._zeros:
      self._zeros[num_rows] = self.cache.put_rows(np.zeros((num_rows,), np.int32))
    return self._zeros[num_rows]

  # ---- steps ---------------------------------------------------------------------------------
  def prefill(self, batch: StepBatch, table: jax.Array, carry: jax.Array, stream=None, *,
              count: bool = True):
    """One prefill step. Returns ``(carry, selected logits)``: the carry's rows whose
    prompt ended here hold their first generated token. ``count=False``: not served work
    (warm-up, calibration), not counted in stats."""
    carry, selected = self.cache.worker.run(
        self.steps.prefill, self.weights, batch.tokens, carry, table, batch.positions,
        batch.kv_lens, batch.select_idx, batch.select_mask, batch.sampling, stream)
    self.cache.stats.add("prefill_steps", int(count))
    return carry, selected

  def decode(self, batch: StepBatch, table: jax.Array, carry: jax.Array, stream=None, *,
             count: bool = True):
    """One decode step: feeds ``carry`` (each row's last token). Returns ``(next tokens,
    selected logits, the next step's batch)``: the same rows one position further, on
    device (a batch whose rows do not change needs nothing from the host)."""
    carry, selected, (positions, kv_lens) = self.cache.worker.run(
        self.steps.decode, self.weights, carry, table, batch.positions, batch.kv_lens,
        batch.sampling, stream)
    self.cache.stats.add("decode_steps", int(count))
    return carry, selected, dataclasses.replace(batch, positions=positions, kv_lens=kv_lens)

  # ---- executing a step plan ------------------------------------------------------------------
  def carry_out(self, orders: TierOrders, *, later: bool = False):
    """Has the cache's worker carry out a plan's tier orders, every destination chosen by
    the manager when the plan was made (``CacheManager.resolve``): issued before anything
    of the step writes a page, so the bytes they copy are still in their pages. ``later``:
    returns the function that waits for the writes below the host (``TierMover.carry_out``)."""
    return self.cache.worker.carry_out(orders, later=later)

  def execute(self, plan: StepPlan) -> StepResult:
    """Runs one ``StepPlan``: issues its tier orders' copies, issues its fetches, dispatches
    its decode and prefill rows (compact rows per shard, bucketed), finishes the copies
    below the host while the device computes, verifies the fetch groups it settles, and
    reads back the tokens. Returns a ``StepResult``."""
    cache = self.cache
    window_failures, window_fetched = self.move_windows(plan)
    finish_copies = self.carry_out(plan.orders, later=True)
    try:
      if plan.fetch is not None:
        self._pending[plan.fetch.group] = cache.worker.start_promote(list(plan.fetch.fetches))
      dispatched, prompt_scores = self._dispatch(plan)
    finally:
      finish_copies()  # the evicted bytes leave the device while the step computes
    fetched = []
    for group in plan.settle:
      pending = self._pending.pop(group)
      report = cache.worker.finish_promote(pending,
                                           time.monotonic() + cache.tiers.read_deadline_s)
      fetched.append((group, report))
    tokens, logits, t_tokens = {}, ({} if plan.want_logits else None), None
    logprobs = {} if plan.want_logprobs else None
    for requests, row, out, sel in dispatched:
      if not requests:
        continue
      got = to_host(out)
      if t_tokens is None:
        t_tokens = time.perf_counter()
      lg = to_host(sel) if logits is not None else None
      lp = ([to_host(a) for a in sampling_lib.logprobs_step(sel, out)]
            if logprobs is not None else None)
      for r in requests:
        tokens[r] = int(got[row[r]])
        if lg is not None:
          logits[r] = lg[row[r]]
        if lp is not None:
          logprobs[r] = tuple(a[row[r]] for a in lp)
    return StepResult(tokens=tokens, logits=logits, fetched=tuple(fetched),
                      t_tokens=time.perf_counter() if t_tokens is None else t_tokens,
                      logprobs=logprobs, prompt_logprobs=self._prompt_scores(prompt_scores),
                      window_failures=tuple(window_failures), window_fetched=window_fetched)

  def move_windows(self, plan: StepPlan) -> tuple[list, tuple[FetchReport, ...]]:
    """A plan's window-group moves, before anything of its step writes a page: evicted kept
    blocks out to host memory and finished sequences' last windows out to the pool and the
    disk (all reading what the pages held before this plan; the disk's evicted records
    deleted first), published blocks' windows kept out of their rings, then host copies,
    disk records, pool values and peers' answers loaded and checked. Returns ``(failed,
    reports)``: ``(shard, key, tier)`` of the loaded blocks that failed their check or did
    not come, and the disk's, the pool's and the peers' loads, each as a timed fetch."""
    windows = self.cache.worker.windows
    windows.demote(plan.window_demotes)
    windows.delete_disk(plan.window_disk_deletes)
    windows.put(plan.window_puts, plan.window_disk_puts)
    self.cache.worker.copy_windows(plan.window_copies)  # kept out of rings the step may write
    failed = windows.load_host(plan.window_loads)
    disk_failed, disk_report = windows.load_disk(plan.window_disk_loads)
    pool_failed, pool_report = windows.load_pool(plan.window_pool_loads)
    remote_failed, remote_report = windows.load_remote(plan.window_remote_loads)
    return (failed + disk_failed + pool_failed + remote_failed,
            tuple(r for r in (disk_report, pool_report, remote_report) if r is not None))

  def _dispatch(self, plan: StepPlan) -> tuple[list, tuple | None]:
    """Dispatches a plan's decode and prefill rows (and the next decode, when it is known
    to repeat). Returns ``(dispatched, prompt_scores)``: per group of rows, its request
    ids, row of each, tokens out and selected logits; the scored prompt chunks or None."""
    ahead, self._ahead = self._ahead, None
    dispatched = []  # (request ids, row of each, tokens out, selected logits)
    prompt_scores = None  # (scored chunks, row of each, their scores on device)
    if plan.decode:
      dispatched.append(self._decode_rows(plan.decode, ahead))
    if plan.prefill:
      num_rows, row, table, sampling = self._layout([c.seq for c in plan.prefill])
      batch = self.prefill_batch([(row[c.seq.request], c.tokens, c.start, c.last)
                                  for c in plan.prefill], num_rows, sampling)
      scored = [c for c in plan.prefill if c.targets is not None]
      if scored:  # every position's logits are scored (prompt log-probabilities)
        out, sel, scores = self._prefill_scored(batch, table, num_rows, [
            (row[c.seq.request], c.targets) for c in scored])
        prompt_scores = (scored, row, scores)
      else:
        out, sel = self.prefill(batch, table, self.zero_carry(num_rows))
      dispatched.append(([c.seq.request for c in plan.prefill if c.last], row, out, sel))
    key = tuple(r.seq.request for r in plan.decode)
    if plan.decode_again and self._resident is not None and self._resident[0] == key:
      # The next step's decode, dispatched now from this one's outputs on device: the
      # device runs it while the host reads this step's tokens and plans the next.
      self._ahead = (key, *self._decode_rows(plan.decode, None)[1:])
    return dispatched, prompt_scores

  def _prefill_scored(self, batch: StepBatch, table, num_rows: int, targets) -> tuple:
    """A prefill step whose rows in ``targets`` (``(row, next tokens)``) are scored."""
    width = batch.tokens.shape[1]
    host = np.full((num_rows, width), -1, np.int32)
    for r, t in targets:
      host[r, :len(t)] = t
    carry, selected, scores = self.cache.worker.run(
        self.steps.prefill_scored, self.weights, batch.tokens, self.zero_carry(num_rows), table,
        batch.positions, batch.kv_lens, batch.select_idx, batch.select_mask, batch.sampling,
        self.cache.put_rows(host))
    self.cache.stats.add("prefill_steps")
    return carry, selected, scores

  @staticmethod
  def _prompt_scores(prompt_scores) -> dict | None:
    """Each scored chunk's (logprobs [n], top ids [n, K], top logprobs [n, K]) on the host."""
    if prompt_scores is None:
      return None
    chunks, row, scores = prompt_scores
    lp, ids, top = (to_host(a) for a in scores)
    out = {}
    for c in chunks:
      r, n = row[c.seq.request], len(c.targets)
      out[c.seq.request] = (lp[r, :n], ids[r, :n], top[r, :n])
    return out

  def _layout(self, seqs) -> tuple:
    """Compact batch rows for ``seqs`` (``SeqRows``; rows per shard bucketed to what they
    need, so a step with one prefilling sequence does not pay for every row): ``(num_rows,
    row of each request, page table on device, sampling)``."""
    per_shard = collections.Counter(s.shard for s in seqs)
    rows_per_shard = buckets.pow2_at_least(max(per_shard.values()))
    num_rows = self.cache.num_shards * rows_per_shard
    slot, row = collections.Counter(), {}
    width = buckets.table_width(max(s.num_pages for s in seqs), self.config)
    table = np.zeros((num_rows, width), np.int32)
    windows = np.zeros((num_rows, width), np.int32) if self.config.has_windows else None
    for s in seqs:
      row[s.request] = s.shard * rows_per_shard + slot[s.shard]
      slot[s.shard] += 1
      table[row[s.request], :len(s.pages)] = s.pages
      if windows is not None:
        windows[row[s.request], :len(s.window_pages)] = s.window_pages
    sampling = self.row_sampling({row[s.request]: s.sampling for s in seqs
                                  if s.sampling.temperature > 0}, num_rows)
    return num_rows, row, self._tables(table, windows), sampling

  def _tables(self, table: np.ndarray, windows: np.ndarray | None = None):
    """A step's page table on device; with a window group, the pair (table, window table)."""
    if not self.config.has_windows:
      return self.cache.put_rows(table)
    if windows is None:
      windows = np.zeros_like(table)
    return tuple(self.cache.put_rows_many(table, windows))

  def _decode_rows(self, rows, ahead) -> tuple:
    """Dispatches (or takes from ``ahead``) one decode step of ``rows``: from the last
    step's outputs on device while the set of rows is unchanged, else from the host's
    copy (each row's last token). Returns ``(request ids, row of each, tokens, logits)``."""
    key = tuple(r.seq.request for r in rows)
    if ahead is not None and set(key) <= set(ahead[0]):  # dispatched last step
      if key != ahead[0]:  # some left (a stop token): their rows are dropped
        self._resident = None
      return (key, *ahead[1:])
    if self._resident is not None and self._resident[0] == key:
      _, row, table, batch, carry = self._resident
    else:
      num_rows, row, table, sampling = self._layout([r.seq for r in rows])
      carry = np.zeros((num_rows,), np.int32)
      for r in rows:
        carry[row[r.seq.request]] = r.token
      batch = self.decode_batch([(row[r.seq.request], r.pos) for r in rows], num_rows,
                                sampling)
      carry = self.cache.put_rows(carry)
    out, sel, batch = self.decode(batch, table, carry)
    self._resident = (key, row, table, batch, out)
    return key, row, out, sel

  def quiesce(self) -> None:
    """Waits for every step dispatched (a decode started a step early among them) and
    forgets the rows kept on device: before programs of another kind run (a streamed
    sequence's), so that no two steps with collectives run at once: XLA:CPU's in-process
    collectives deadlock when two programs' participants share its threads."""
    jax.block_until_ready((self._ahead, self.cache.worker.pools))
    self._resident = self._ahead = None

  def recover(self, unsettled: dict) -> None:
    """After a failed step: forgets the rows kept on device, gives up the fetch groups
    whose reports the scheduler never took (``group -> fetches``: in flight, settled by the
    failed step, or never issued) and releases their source pins, and restarts the pools if
    the failed step consumed them."""
    self._resident = self._ahead = None
    for group, fetches in unsettled.items():
      self._pending.pop(group, None)  # reads still in flight complete into nothing
      for f in fetches:
        self.cache.manager.release_pin(f)
    for pending in self._pending.values():
      self.cache.worker.abandon(pending)
    self._pending.clear()
    if not self.cache.pools_alive():
      self.cache.reset_pools()

  # ---- compiling ahead -----------------------------------------------------------------------
  def warmup(self, max_seq_len: int, rows_per_shard: Sequence[int],
             shapes: int | None = None) -> list[int]:
    """Compiles the prefill (every step width) and decode steps for every (rows, table
    width) bucket, smallest first, with all-padding steps (they change no page); with
    ``shapes``, only that many now, the others left to ``warm_next``. Returns the table
    widths of every bucket."""
    widths = buckets.table_widths(max_seq_len, self.config)
    row_buckets = sorted({buckets.pow2_at_least(r) for r in rows_per_shard})
    pairs = [(rows, width) for rows in row_buckets for width in widths]
    now = pairs if shapes is None else pairs[:max(1, shapes)]
    self.warm_later = collections.deque(pairs[len(now):])
    self.warm_total = len(pairs)
    progress = Progress("compiling prefill and decode steps", len(now))
    for rows, width in now:
      self._warm_shape(rows, width)
      progress.advance(detail=f"{rows} rows per shard, table width {width}")
    return widths

  def warm_next(self) -> bool:
    """Compiles the next bucket ``warmup`` left (all-padding steps: safe between any two
    steps). Returns whether any is left after it."""
    if self.warm_later:
      self._warm_shape(*self.warm_later.popleft())
      if not self.warm_later:
        logging.info("every step shape is compiled (%d buckets)", self.warm_total)
    return bool(self.warm_later)

  def warm_progress(self) -> tuple[int, int]:
    """``(buckets compiled, buckets)`` of the last ``warmup``."""
    return self.warm_total - len(self.warm_later), self.warm_total

  def _warm_shape(self, rows: int, width: int) -> None:
    num_rows = rows * self.cache.num_shards
    table = self._tables(np.zeros((num_rows, width), np.int32))
    carry = self.cache.put_rows(np.zeros((num_rows,), np.int32))
    for step_width in self.prefill_widths:
      carry, _ = self.prefill(self.prefill_batch([], num_rows, width=step_width), table,
                              carry, count=False)
    tokens, selected, _ = self.decode(self.decode_batch([], num_rows), table, carry,
                                      count=False)
    # A request asking for log-probabilities scores its rows' logits (``logprobs_step``):
    # compiled here too, so the first such request compiles nothing.
    scores = sampling_lib.logprobs_step(selected, tokens)
    warm_gathers(carry, tokens, *scores)  # (a job's steps read them back with to_host)

  def time_prefill_step(self, num_rows: int, width: int, timer: Callable, kv_len: int = 0,
                        pages: Sequence[int] | None = None) -> float:
    """``timer(step)`` of one prefill step at a (rows, width) bucket whose rows attend over
    ``kv_len`` tokens of context each (pages of the table: page 0, read only). Its tokens
    have no position, so nothing is written and no page changes: the step costs what a
    chunk's weights and its attention over that context cost, on a cache in use too.

    ``pages`` (one device page per data shard, the caller's to write): the rows' tokens
    are the chunk that ends at ``kv_len`` (at least a chunk), every table entry is the
    shard's page, and the window group's table is its page 0 (never handed out). A model
    with a window group needs that: its local layers attend only over the window before
    their queries' positions, and a query with no position sees nothing there, so a step
    of padding alone would price them at no attention at all. Its tokens are written, into
    those pages only."""
    if pages is None:
      table = self._tables(np.zeros((num_rows, width), np.int32))
      batch = self.prefill_batch([], num_rows)
      if kv_len:
        batch = dataclasses.replace(batch, kv_lens=self.cache.put_rows(
            np.full((num_rows,), kv_len, np.int32)))
    else:
      per_shard = num_rows // len(pages)
      table = self._tables(np.repeat(np.asarray(pages, np.int32), per_shard)[:, None]
                           .repeat(width, axis=1))
      n = self.chunk_tokens
      start = max(kv_len, n) - n
      batch = self.prefill_batch([(r, [0] * n, start, False) for r in range(num_rows)],
                                 num_rows, width=n)

    def step():
      carry = self.cache.put_rows(np.zeros((num_rows,), np.int32))
      carry, _ = self.prefill(batch, table, carry, count=False)
      carry.block_until_ready()

    return timer(step)
