"""Counters of one cache and the engine serving it: the one record ``Engine.stats()`` and
``jaxkv.metrics`` read.

Every part that does counted work (the scheduler, the runner, the tier mover, streaming)
adds to the same ``Stats``, owned by the ``KVCache``; nobody keeps counters of its own.
``as_dict`` is the public shape of ``Engine.stats()``: every counter below (0 when nothing
happened), ``hits`` by tier name, ``verify_failures_by_reason``,
``disk_discarded_at_open_by_reason`` (records the disk tier did not adopt when it was opened:
deleted, or left for another format version), ``ttft_s`` per request
(``tpot_s``, time per output token, and ``e2e_s``, submission to last token, per request
that continuous batching finished) and the index's ``evictions``.
"""

from __future__ import annotations

import collections
import dataclasses

# The counters ``Engine.stats()`` always reports, with what they count.
COUNTERS = {
    "requests": "requests served",
    "aborted_requests": "requests ended by their caller before they finished",
    "failed_requests": "requests ended with an error of their own (their on_token raised)",
    "prompt_tokens": "prompt tokens received",
    "hit_tokens": "prompt tokens whose KV was reused",
    "computed_tokens": "prompt tokens prefilled",
    "generated_tokens": "tokens generated",
    "blocks_fetched": "blocks brought up from a lower tier and verified",
    "blocks_recomputed": "prompt blocks computed rather than reused",
    "blocks_split": "cached blocks recomputed while later ones were fetched",
    "bytes_moved": "bytes moved between tiers",
    "prefill_steps": "prefill steps run",
    "decode_steps": "decode steps run",
    "waves": "batches of requests admitted together (static batching)",
    "steps": "iterations of continuous batching",
    "shared_prefix_waits": "requests that waited for a running request's blocks of their "
                           "prompt instead of computing them again",
    "verify_failures": "lower-tier blocks whose bytes failed verification",
    "peer_lookups": "prefix lookups this process asked remote peers (in a job, process 0 "
                    "asks for every process)",
    "disk_discarded_at_open": "disk records not adopted when the store was opened (failed "
                              "verification, another format version, unreadable)",
    "read_timeouts": "lower-tier reads that missed their deadline",
    "disk_write_failures": "disk writes that failed (never published)",
    "demoted_host": "blocks copied down to host memory",
    "demoted_disk": "blocks committed to disk",
    "disk_writes": "disk records this process wrote (a job's processes take turns)",
    "disk_syncs": "flushes of a batch of committed disk writes to the device",
    "disk_detached": "times the disk tier was detached for a cool-down after repeated failures",
    "disk_detached_drops": "blocks not written to disk while it was detached",
    "disk_writes_dropped": "blocks not written to disk because the writes in flight were at "
                           "their bound (TierConfig.disk_queue_mb): the store is not keeping "
                           "up with the evictions",
    "plans_fetch": "requests whose plan fetched every cold block",
    "plans_recompute": "requests whose plan recomputed every cold block",
    "plans_split": "requests whose plan recomputed the front and fetched the back",
    "plans_probe": "requests that fetched their last few cold blocks, which the plan would "
                   "have recomputed, to time a link the plan had stopped using "
                   "(SchedulerConfig.probe_every)",
    "splits_timed": "splits that ran alone, timed to learn how much of their recompute and "
                    "fetch overlapped (CostModel.overlap)",
    "plan_s": "seconds spent planning",
    "calibration_s": "seconds spent calibrating costs",
    "fetch_s": "seconds from issuing fetches to their verification",
    "fetch_wait_s": "seconds spent waiting for fetches after the recompute",
    "pool_puts": "blocks this process put in the pool",
    "pool_lookups": "prefix lookups asked of the pool",
    "pool_failures": "pool fetches that failed (missing, late, rejected)",
    "pool_gets_stuck": "times the pool was asked nothing because every get thread was still "
                       "inside the client with a get given up on",
    "window_blocks_kept": "blocks whose window-group KV was kept for later hits (a model "
                          "with sliding-window layers)",
    "window_blocks_evicted": "kept window-group blocks evicted for room",
    "window_keep_dropped": "window-group blocks not kept: no page could be had",
    "window_host_stored": "evicted kept window-group blocks copied to host memory "
                          "(TierConfig.host_window_pages_per_shard)",
    "window_host_dropped": "evicted kept window-group blocks not copied: every host slot "
                           "was being read",
    "window_host_loaded": "window-group blocks loaded back from host memory for a hit",
    "window_host_failed": "window-group blocks loaded from host memory whose bytes failed "
                          "their check (dropped; the request resumed at its split)",
    "window_pool_puts": "window-group blocks put in the pool (each finished sequence's last "
                        "window, for another engine's hit)",
    "window_pool_loaded": "window-group blocks loaded from the pool for a hit",
    "window_pool_skipped": "window-group blocks in the pool not loaded: recomputing what "
                           "they would add to the hit was predicted sooner",
    "window_pool_failed": "window-group blocks loaded from the pool that failed their check "
                          "or did not come (dropped)",
    "window_disk_puts": "window-group records written to the disk store (each finished "
                        "sequence's last window, for a hit after a restart or another "
                        "engine's on the same store)",
    "window_disk_dropped": "window-group records not written: the writes in flight were at "
                           "TierConfig.disk_queue_mb",
    "window_disk_write_failed": "window-group records whose write failed",
    "window_disk_loaded": "window-group blocks loaded from the disk store for a hit",
    "window_disk_skipped": "window-group blocks on the disk not loaded: recomputing what "
                           "they would add to the hit was predicted sooner",
    "window_disk_failed": "window-group blocks loaded from the disk that failed their check "
                          "or were gone (their records forgotten)",
    "window_remote_loaded": "window-group blocks loaded from a remote peer for a hit",
    "window_remote_skipped": "window-group blocks at a remote peer not loaded: recomputing "
                             "what they would add to the hit was predicted sooner",
    "window_remote_failed": "window-group blocks loaded from a remote peer that failed their "
                            "check or did not come (dropped)",
    "window_disk_adopted": "window-group records an earlier run left on the disk, adopted "
                           "at open",
}
HIT_TIERS = ("device", "host", "disk", "remote", "shard", "pool")


@dataclasses.dataclass
class Stats:
  """Counters since construction or ``reset``. ``counters`` holds ``COUNTERS`` and any
  occasional ones (``streamed_requests``, ``host_full_drops``, ...)."""

  counters: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  hits: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  failures: collections.Counter = dataclasses.field(default_factory=collections.Counter)
  # reason -> disk records not adopted at open (``DiskTier.discarded``)
  discarded_at_open: collections.Counter = dataclasses.field(
      default_factory=collections.Counter)
  ttft_s: list = dataclasses.field(default_factory=list)
  tpot_s: list = dataclasses.field(default_factory=list)  # per request with 2+ tokens
  e2e_s: list = dataclasses.field(default_factory=list)  # submit to last token

  def add(self, name: str, n: float = 1) -> None:
    self.counters[name] += n

  def add_discarded_at_open(self, by_reason: dict) -> None:
    """Counts the disk records a store's opening did not adopt, by reason."""
    self.discarded_at_open.update(by_reason)
    self.add("disk_discarded_at_open", sum(by_reason.values()))

  def __getitem__(self, name: str) -> float:
    return self.counters[name]

  def reset(self) -> None:
    for c in (self.counters, self.hits, self.failures, self.discarded_at_open):
      c.clear()
    for series in (self.ttft_s, self.tpot_s, self.e2e_s):
      series.clear()

  def as_dict(self, *, evictions: int = 0) -> dict:
    out = {k: 0 for k in COUNTERS}
    out.update(self.counters)
    out["hits"] = {name: self.hits[name] for name in HIT_TIERS}
    out["verify_failures_by_reason"] = dict(self.failures)
    out["disk_discarded_at_open_by_reason"] = dict(self.discarded_at_open)
    out["ttft_s"] = list(self.ttft_s)
    out["tpot_s"] = list(self.tpot_s)
    out["e2e_s"] = list(self.e2e_s)
    out["evictions"] = evictions
    return out
