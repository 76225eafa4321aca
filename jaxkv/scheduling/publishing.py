"""Publishing: what a step's writes make reusable, decided on the scheduler's side.

A block a step wrote in full enters the prefix index (``CacheManager.publish``) as soon as
the step is dispatched, so a request waiting for that prefix can start on it. Under
write-through its copies to every lower tier are ordered for the next plan. With a window
group (a model with sliding-window layers) its window KV is also kept: copied out of the
writing sequence's ring into a page of its own (``jaxkv.manager.windows``), a copy the next
plan carries out before anything of it writes a page.
"""

from __future__ import annotations

import numpy as np

from jaxkv.scheduling.step import TierOrders


class Publishing:
  """Publishes the blocks running sequences wrote; collects the window copies it ordered."""

  def __init__(self, manager, page_size: int, *, prefix_reuse: bool,
               cache_decode_blocks: bool):
    self.manager, self.page = manager, page_size
    self.prefix_reuse, self.cache_decode_blocks = prefix_reuse, cache_decode_blocks
    self.window_copies: list = []  # (shard, ring page, kept page), for the next plan

  def take_copies(self) -> tuple:
    copies, self.window_copies = tuple(self.window_copies), []
    return copies

  def block(self, shard, page, keys, j, published: list, window_page: int = 0) -> None:
    """Publishes block ``j`` of ``keys`` in device ``page`` (noted in ``published`` when it
    is new); ``window_page``: the ring page holding its window KV, to keep."""
    if self.manager.publish(shard, page, keys[j], parent=keys[j - 1] if j else None):
      published.append((shard, page, keys[j]))
    if window_page:
      kept = self.manager.windows.keep(shard, keys[j], source=window_page)
      if kept is not None:
        self.window_copies.append((shard, window_page, kept))

  def write_through(self, published: list) -> TierOrders:
    """The copies of freshly published blocks to every lower tier (write-through): carried
    out by the next plan, before anything of it writes a page."""
    if published and self.manager.write_through:
      return TierOrders(write_through=tuple(published))
    return TierOrders()

  def chunks(self, chunks, seqs: dict) -> TierOrders:
    """Publishes the full blocks each prefill chunk of the step wrote (the step is
    dispatched, so any later read of those pages runs after it): a request waiting for a
    shared prefix can start once its blocks are written, not once the writer's whole prompt
    is done. ``seqs``: the running sequences by request id."""
    if not self.prefix_reuse:
      return TierOrders()
    published = []
    for c in chunks:
      p = seqs[c.seq.request].placement
      window = seqs[c.seq.request].rows.window_pages
      for j in range(c.start // self.page, (c.start + len(c.tokens)) // self.page):
        self.block(p.shard, p.pages[j], p.request.keys, j, published,
                   window[j] if window else 0)
    return self.write_through(published)

  def answer(self, s) -> TierOrders:
    """A finished sequence's answer blocks (``cache_decode_blocks``): a later turn of the
    conversation reuses the answer too. With a window group and a pool, the window before
    the end of what it published goes to the pool (``WindowPages.put``), where another
    engine's hit there (a decode node's, a replica's) finds it."""
    p = s.placement
    if not self.prefix_reuse:
      return TierOrders()
    if not self.cache_decode_blocks:
      self._put_window(p.shard, p.request.keys, len(p.request.tokens) // self.page)
      return TierOrders()
    written = np.concatenate([p.request.tokens, np.asarray(s.handle.tokens, np.int32)])
    keys = self.manager.block_keys(written, p.request.tenant)
    published = []
    window = s.rows.window_pages
    # A ring holds its last blocks only; two short of its length stay clear of the block a
    # decode step dispatched ahead may be writing.
    kept_from = len(keys) - (len(p.window_ring) - 2)
    for j in range(len(p.request.tokens) // self.page, len(keys)):
      self.block(p.shard, p.pages[j], keys, j, published,
                 window[j] if window and j >= kept_from else 0)
    self._put_window(p.shard, keys, len(keys))
    return self.write_through(published)

  def _put_window(self, shard: int, keys, cut: int) -> None:
    """The window before ``cut`` and before the cut a block earlier, to the pool and the
    disk (a prefill node's next engine asks for the prompt less its last token)."""
    windows = self.manager.windows
    if windows is not None:
      windows.put(shard, keys, cut, spare=1)  # (nothing without a pool or a disk)
