"""Executor: runs one wave of placed requests, from the plan to the published blocks.

For a wave (``admission.Placement`` records, at most ``max_seqs_per_shard`` per shard):
1. Rows and page table: each request gets a batch row on its shard's devices; the table
   holds its device pages (``buckets`` widths).
2. Plan (``scheduler.Planner``): each request's split point ``s``. Blocks ``[hot, s)`` are
   recomputed, ``[s, end)`` fetched; the pins of cached blocks that will be recomputed are
   released now.
3. Fetch and recompute in parallel: every fetch is issued first (``TierMover``: disk reads
   in flight, host copies and cross-shard collectives dispatched), then the runner
   recomputes ``[hot, s)``; then the executor waits (until the read deadline at the latest)
   and every fetched block is verified. A block that failed ends the request's hit there;
   its bad copy and the copies chained after it are dropped.
4. The rest of each prompt is prefilled; a hit always leaves at least one prompt token to
   compute, whose logits give the first token (TTFT is taken when it exists).
5. Decode, one step per token (greedy or seeded sampling per request, ``jaxkv.sampling``),
   until each request has its ``max_new_tokens`` or produced one of its stop tokens.
6. Publish every block the wave wrote (prompt, and the answer when
   ``cache_decode_blocks``), copy them down under write-through, release every reference.
If a step fails, the donated pools are gone: the cache forgets its device blocks and the
pools restart from zeros (``KVCache.reset_pools``); references are released on every path.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from jaxkv import buckets
from jaxkv.admission import Placement
from jaxkv.distributed import to_host
from jaxkv.index import TIER_NAMES


@dataclasses.dataclass(frozen=True)
class PlannedRow:
  """A placed request in a batch: its row, and the plan's split point."""

  placement: Placement
  row: int
  split: int
  fetches: tuple  # the fetches the plan kept (blocks >= split)


class Executor:
  """Runs waves over one cache with one model runner and planner."""

  def __init__(self, cache, runner, planner, *, prefix_reuse: bool, cache_decode_blocks: bool):
    self.cache, self.runner, self.planner = cache, runner, planner
    self.prefix_reuse, self.cache_decode_blocks = prefix_reuse, cache_decode_blocks
    self.stats = cache.stats

  def run(self, wave: list[Placement], t_start: float, want_logits: bool):
    """Runs ``wave``; returns ``{request index: (tokens, logits or None)}``."""
    num_shards, cache = self.cache.num_shards, self.cache
    rows_per_shard = buckets.pow2_at_least(max(collections.Counter(p.shard for p in wave)
                                               .values()))
    num_rows = num_shards * rows_per_shard
    slot = collections.Counter()
    row_of = []
    for p in wave:
      row_of.append(p.shard * rows_per_shard + slot[p.shard])
      slot[p.shard] += 1
    width = buckets.table_width(max(p.request.num_pages_needed for p in wave), cache.config)
    table = np.zeros((num_rows, width), np.int32)
    for p, row in zip(wave, row_of):
      table[row, :len(p.pages)] = p.pages
    page_table = cache.put_rows(table)
    sampling = self.runner.row_sampling(
        {row: p.request.sampling for p, row in zip(wave, row_of)
         if p.request.sampling.temperature > 0}, num_rows)
    try:
      rows = self._plan(wave, row_of)
      logits: dict = {}
      first = self._prefill(rows, num_rows, page_table, t_start, sampling,
                            logits if want_logits else None)
      out = self._decode(rows, num_rows, page_table, first, sampling,
                         logits if want_logits else None)
    finally:
      for p in wave:
        cache.index.release(p.shard, p.pages)
      if not cache.pools_alive():
        cache.reset_pools()
    cache.mover.pump()
    self.stats.add("waves")
    self.stats.add("requests", len(wave))
    self.stats.add("generated_tokens", sum(len(tokens) for tokens, _ in out.values()))
    return out

  # ---- the plan --------------------------------------------------------------------------------
  def _plan(self, wave: list[Placement], row_of: list[int]) -> list[PlannedRow]:
    splits = self.planner.splits([(list(p.hit_tiers), len(p.request.tokens), p.shard)
                                  for p in wave])
    rows = []
    for p, row, s in zip(wave, row_of, splits):
      for f in p.fetches:
        if f.block < s:  # cached below, but recomputing it is the plan
          self.cache.mover.release_pin(f)
      rows.append(PlannedRow(p, row, s, tuple(f for f in p.fetches if f.block >= s)))
    return rows

  # ---- prefill ---------------------------------------------------------------------------------
  def _prefill(self, rows: list[PlannedRow], num_rows: int, table, t_start: float, sampling,
               logits) -> object:
    """Recomputes each request's planned stretch while its fetches are in flight, then
    verifies the fetches and prefills everything after the last good block."""
    cache, page = self.cache, self.cache.config.page_size
    fetches = [f for r in rows for f in r.fetches]
    pending = None
    if fetches:
      pools, pending = cache.mover.start_promote(cache.pools, fetches)
      cache.set_pools(pools)
    carry = cache.put_rows(np.zeros((num_rows,), np.int32))
    recompute = [(r.row, r.placement.request.tokens, r.placement.hot_blocks * page, r.split * page)
                 for r in rows if r.split > r.placement.hot_blocks]
    t_compute = time.perf_counter()
    if recompute:
      carry = self.runner.prefill_spans(recompute, carry, num_rows, table)
    hits = [r.placement.cached_blocks for r in rows]
    if pending is not None:
      t_end = time.monotonic() + cache.tiers.read_deadline_s
      cache.set_pools(cache.mover.finish_promote(cache.pools, pending, t_end))
      hits = self.settle(rows)
      self.planner.observe_fetch(cache.mover.last_fetch)
    if recompute:
      _, _, a, b = max(recompute, key=lambda x: x[3] - x[2])
      self.planner.observe_recompute(b - a, a, time.perf_counter() - t_compute)
    for r, hit in zip(rows, hits):
      self.count_prompt(r, hit)
    rest = [(r.row, r.placement.request.tokens, max(hit, r.split) * page,
             len(r.placement.request.tokens)) for r, hit in zip(rows, hits)]

    def on_first_token(finishing: list[int], selected) -> None:
      now = time.perf_counter() - t_start
      self.stats.ttft_s.extend(now for _ in finishing)
      if logits is not None:
        sel = to_host(selected)
        for i in finishing:
          logits[rows[i].placement.request.index] = [sel[rows[i].row]]

    first = self.runner.prefill_spans(rest, carry, num_rows, table, on_first_token=on_first_token,
                                      sampling=sampling)
    if self.prefix_reuse:
      published = []
      for r, hit in zip(rows, hits):  # every block this wave computed is written: publish
        p = r.placement
        computed = list(range(p.hot_blocks, r.split)) + list(
            range(max(hit, r.split), len(p.request.tokens) // page))
        for j in computed:
          self.publish(p.shard, p.pages[j], p.request.keys, j, published)
      self.write_through(published)
    return first

  def settle(self, rows: list[PlannedRow]) -> list[int]:
    """After verification: a failed fetch ends that request's reuse at its block. Returns
    each request's hit (leading blocks whose KV is reused or was recomputed as planned)."""
    hits = []
    for r in rows:
      hit = r.placement.cached_blocks
      for f in sorted(r.fetches, key=lambda f: f.block):
        if not f.ok and f.block < hit:
          hit = f.block  # recompute from the first bad block on
        if not f.ok:
          self.cache.mover.drop_failed(f)
      for f in r.fetches:  # verified and still part of the hit: the device copy is good
        if f.ok and f.block < hit:
          self.publish(r.placement.shard, f.page, r.placement.request.keys, f.block, [])
      hits.append(hit)
    return hits

  def count_prompt(self, r: PlannedRow, hit: int) -> None:
    p, page, stats = r.placement, self.cache.config.page_size, self.stats
    hot, cached = p.hot_blocks, p.cached_blocks
    reused = hot + (hit - r.split if hit > r.split else 0)
    for j in list(range(hot)) + list(range(r.split, hit)):
      stats.hits[TIER_NAMES[p.hit_tiers[j]]] += 1
    self.cache.index.record_hits(p.request.keys[:hit])
    n = len(p.request.tokens)
    stats.add("hit_tokens", reused * page)
    stats.add("prompt_tokens", n)
    stats.add("computed_tokens", n - reused * page)
    stats.add("blocks_recomputed", n // page - reused)
    stats.add("blocks_split", (r.split - hot) if hot < r.split < cached else 0)

  # ---- decode ----------------------------------------------------------------------------------
  def _decode(self, rows: list[PlannedRow], num_rows: int, table, first, sampling, logits) -> dict:
    specs = [(r.row, len(r.placement.request.tokens), r.placement.request.max_new_tokens,
              r.placement.request.sampling.stop_token_ids) for r in rows]
    tokens, step_logits = self.runner.decode_rows(specs, num_rows, table, first,
                                                  sampling=sampling,
                                                  want_logits=logits is not None)
    out = {}
    for r in rows:
      req = r.placement.request
      generated = tokens[r.row]
      lg = None
      if logits is not None:
        lg = np.stack(logits[req.index] + [s[r.row] for s in step_logits[:len(generated) - 1]])
      out[req.index] = (generated, lg)
    if self.prefix_reuse and self.cache_decode_blocks:
      page, published = self.cache.config.page_size, []
      for r in rows:
        p = r.placement
        written = np.concatenate([p.request.tokens, np.asarray(out[p.request.index][0][:-1],
                                                               np.int32)])
        keys = self.cache.index.block_keys(written, p.request.tenant)
        for j in range(len(p.request.tokens) // page, len(keys)):
          self.publish(p.shard, p.pages[j], keys, j, published)
      self.write_through(published)
    return out

  # ---- publishing ------------------------------------------------------------------------------
  def publish(self, shard, page, keys, j, published: list) -> None:
    if self.cache.index.publish(shard, page, keys[j], parent=keys[j - 1] if j else None):
      published.append((shard, page, keys[j]))

  def write_through(self, published: list) -> None:
    if published and self.cache.tiers.write_policy == "write_through":
      self.cache.mover.copy_down(self.cache.pools, published)
