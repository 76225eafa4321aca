"""Shape buckets: the few padded shapes every jitted function in jaxkv is compiled for.

Jitted code compiles once per input shape, so every variable count is rounded up to a
bucket before it reaches one: batch rows and page-table widths (the model steps), pages
per transfer (tier moves, checkpoints, the block server), requests and blocks (the plan).
Buckets are powers of two with a floor; ``warmup`` compiles each one ahead of traffic, and
tests count traces to prove nothing else is ever compiled.

Per-shard work is laid out as a grid ``[data_shards, n]``: row ``s`` holds shard ``s``'s
shard-local ids, padded to the bucket with an id the receiving function drops.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

# Transfers move at least this many pages per shard: a handful of shapes cover every batch.
MIN_TRANSFER_PAGES = 4
# The plan is compiled for at least this many requests and blocks.
MIN_PLAN_ROWS = 8


def pow2_at_least(n: int) -> int:
  """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
  return 1 << (max(1, int(n)) - 1).bit_length()


def transfer_pages(n: int) -> int:
  """Pages per shard of a transfer that moves ``n``: a power of two, at least 4."""
  return max(MIN_TRANSFER_PAGES, pow2_at_least(n))


def pieces(n: int, top: int) -> list[tuple[int, int]]:
  """``n`` items as ``(offset, size)`` buckets, sizes powers of two of at most ``top`` (a
  power of two), largest first: 13 -> (0, 8), (8, 4), (12, 1). A move in these buckets
  carries exactly ``n`` items and compiles for ``log2(top) + 1`` shapes."""
  out, offset = [], 0
  while offset < n:
    size = min(top, 1 << ((n - offset).bit_length() - 1))
    out.append((offset, size))
    offset += size
  return out


def plan_rows(n: int) -> int:
  """Requests (or blocks) of a plan over ``n``: a power of two, at least 8."""
  return max(MIN_PLAN_ROWS, pow2_at_least(n))


# A prefill step is at least this many tokens wide when its chunk allows (a prompt's last,
# partial chunk runs in the narrowest step that holds it, down to this). Measured on
# XLA:CPU with the benchmark model: steps of 16 or 32 tokens compute a block's K/V with
# other bits than steps of 64, while 64, 128 and 512 agree; keeping every step at least
# this wide keeps cached blocks bitwise equal to recomputed ones wherever chunks end.
MIN_STEP_TOKENS = 64


def prefill_widths(chunk_tokens: int, page_size: int) -> list[int]:
  """Token widths of prefill steps: the chunk, and halvings of it down to
  ``MIN_STEP_TOKENS`` (whole pages), so a short tail does not pay for a whole chunk."""
  floor = max(page_size, -(-MIN_STEP_TOKENS // page_size) * page_size)
  widths, w = {chunk_tokens}, chunk_tokens
  while w % 2 == 0 and w // 2 >= floor and (w // 2) % page_size == 0:
    w //= 2
    widths.add(w)
  return sorted(widths)


def prefill_width(tokens: int, widths: list[int]) -> int:
  """The narrowest prefill step (of ``prefill_widths``) that holds ``tokens`` tokens."""
  for w in widths:
    if w >= tokens:
      return w
  return widths[-1]


def table_width(pages_needed: int, config) -> int:
  """Page-table width for a sequence of ``pages_needed`` pages: a power of two, at least
  one attention chunk, at most ``max_pages_per_seq`` (``config`` is a ``CacheConfig``)."""
  return min(max(pow2_at_least(pages_needed), config.attention_chunk_pages),
             config.max_pages_per_seq)


def table_widths(max_seq_len: int, config) -> list[int]:
  """Every width bucket a sequence of up to ``max_seq_len`` tokens can use."""
  pages = -(-int(max_seq_len) // config.page_size)
  return sorted({table_width(n, config) for n in range(1, pages + 1)})


def row_buckets(max_rows: int) -> list[int]:
  """Batch-row buckets up to ``max_rows`` rows per shard: 1, 2, 4, ... (powers of two)."""
  top = pow2_at_least(max_rows)
  return [1 << i for i in range(top.bit_length()) if 1 << i <= top]


def shard_grid(items: Iterable, num_shards: int, fill: int, *,
               shard_of: Callable = lambda it: it[0]) -> tuple[np.ndarray, list[list]]:
  """Groups ``items`` by data shard and returns ``(grid, per_shard)``: ``grid`` is an
  int32 ``[num_shards, transfer_pages(most per shard)]`` array filled with ``fill`` (the
  caller writes each shard's ids into its row), ``per_shard[s]`` the items of shard ``s``
  in their original order."""
  per: list[list] = [[] for _ in range(num_shards)]
  for it in items:
    per[shard_of(it)].append(it)
  n = transfer_pages(max(len(p) for p in per))
  return np.full((num_shards, n), fill, np.int32), per


def shard_ids(items: Iterable, num_shards: int, fill: int, id_of: Callable, *,
              shard_of: Callable = lambda it: it[0]) -> tuple[np.ndarray, list[list]]:
  """``shard_grid`` with each shard's row filled by ``id_of(item)`` for its items."""
  grid, per = shard_grid(items, num_shards, fill, shard_of=shard_of)
  for s, its in enumerate(per):
    grid[s, :len(its)] = [id_of(it) for it in its]
  return grid, per
