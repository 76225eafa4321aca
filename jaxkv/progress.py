"""Progress of long work (compiles, benchmark repetitions, long runs) as INFO log lines.

    progress = Progress("compiling steps", total=12)
    for ...:
      ...
      progress.advance(detail="rows 4, width 16")

Logs the first unit, then at most one line every ``every_s`` seconds, and the last one:
done/total, elapsed time and an ETA from the mean time per unit so far.
"""

from __future__ import annotations

import time

from absl import logging


class Progress:

  def __init__(self, what: str, total: int, *, every_s: float = 5.0):
    self.what, self.total, self.every_s = what, max(int(total), 1), every_s
    self.done = 0
    self.t0 = self._last = time.perf_counter()

  def advance(self, n: int = 1, detail: str = "") -> None:
    self.done += n
    now = time.perf_counter()
    if self.done not in (n, self.total) and now - self._last < self.every_s:
      return
    self._last = now
    elapsed = now - self.t0
    eta = elapsed / self.done * (self.total - self.done)
    logging.info("%s: %d/%d%s, %.1f s elapsed%s", self.what, self.done, self.total,
                 f" ({detail})" if detail else "", elapsed,
                 f", about {eta:.0f} s left" if self.done < self.total else "")
