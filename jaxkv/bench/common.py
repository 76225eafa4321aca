"""Measurement helpers: interleaved repetitions, medians with ranges, fresh buffers.

Every comparison runs its candidates interleaved (A B A B ...) after a warm-up, so both
see the same machine noise, and reports the median of the repetitions with min-max.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def timed(fn: Callable[[], object]) -> float:
  """Seconds one call of ``fn`` takes; ``fn`` must itself wait for completion."""
  t0 = time.perf_counter()
  fn()
  return time.perf_counter() - t0


def interleaved(candidates: dict[str, Callable[[], object]], *, reps: int = 5,
                warmup: int = 1, setup: Callable[[str], None] | None = None
                ) -> dict[str, dict]:
  """Runs every candidate ``reps`` times, interleaved; returns seconds per candidate.

  ``setup(name)`` runs untimed before each timed call (fresh buffers, cold caches).
  """
  for _ in range(warmup):
    for name, fn in candidates.items():
      if setup:
        setup(name)
      fn()
  times = {name: [] for name in candidates}
  for _ in range(reps):
    for name, fn in candidates.items():
      if setup:
        setup(name)
      times[name].append(timed(fn))
  return {name: summary(ts) for name, ts in times.items()}


def summary(seconds: list[float]) -> dict:
  return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
          "reps": len(seconds)}


def throughput(nbytes: int, s: dict) -> dict:
  """GB/s (1 GB = 1e9 bytes) of a ``summary`` over ``nbytes``."""
  return {"gb_per_s": nbytes / s["median_s"] / 1e9, "gb_per_s_min": nbytes / s["max_s"] / 1e9,
          "gb_per_s_max": nbytes / s["min_s"] / 1e9, **s}


def ratio(a: dict, b: dict) -> float:
  """Throughput ratio a / b from two ``summary`` dicts over the same bytes."""
  return b["median_s"] / a["median_s"]
