"""Online load: a workload's users sending requests over time to an engine, and its figures.

Each user of a workload (``jaxkv.tools.workloads``) sends its requests one after another. The
first request of each user arrives by a Poisson process of ``rate`` users per second (or at
the times a trace gives); each later one follows its previous answer after a think time
drawn from an exponential distribution of mean ``think_s``. Every arrival is submitted
(``Engine.submit``) as soon as it is due and joins the running batch at the next step;
between arrivals the driver runs engine steps, and sleeps only when nothing runs.

Times count from each request's arrival, not its submission: a request that became due
while a step was running waits for it, and that wait is part of its TTFT. Time per
output token (TPOT) is a request's decode time over its tokens after the first.
Arrival times are drawn from ``seed``; answers are the engine's (greedy answers are the
same whatever the timing, so two runs of one workload see the same prompts).
"""

from __future__ import annotations

import dataclasses
import heapq
import time

import numpy as np

from jaxkv.metrics import percentile
from jaxkv.progress import Progress
from jaxkv.errors import InputError


@dataclasses.dataclass
class Record:
  """One request of an online run (times in seconds from the run's start)."""

  user: int
  turn: int
  arrival_s: float
  prompt_tokens: int
  tokens: list = dataclasses.field(default_factory=list)
  first_token_s: float | None = None
  finish_s: float | None = None
  finish_reason: str | None = None

  @property
  def ttft_s(self) -> float:
    return self.first_token_s - self.arrival_s

  @property
  def tpot_s(self) -> float | None:
    if len(self.tokens) < 2:
      return None
    return (self.finish_s - self.first_token_s) / (len(self.tokens) - 1)


def run(engine, workload, *, rate: float, think_s: float = 0.0, seed: int = 0,
        tenant: str = "default", timeout_s: float = 3600.0) -> tuple[list[Record], float]:
  """Runs every user's requests through ``engine`` (continuous batching) as they arrive.

  Returns the records (ordered by turn, then user: the order a run in rounds gives) and
  the makespan in seconds. Raises
  ``TimeoutError`` if the run is not done within ``timeout_s``."""
  if getattr(engine.config, "batching", "continuous") != "continuous":
    raise InputError("online load submits requests while others run: it needs "
                     'EngineConfig(batching="continuous").')
  fixed = workload.arrivals()
  if fixed is None and not rate > 0:
    raise InputError(f"rate={rate!r} must be a positive number of users per second.")
  if not think_s >= 0:
    raise InputError(f"think_s={think_s!r} must be a number >= 0.")
  rng = np.random.default_rng(seed)
  users, turns = workload.users, workload.turns_per_user
  first = fixed if fixed is not None else np.cumsum(rng.exponential(1.0 / rate, users)).tolist()
  due = [(float(t), u, 0) for u, t in enumerate(first)]  # (time, user, turn), a heap
  heapq.heapify(due)
  records: dict = {}
  running: dict = {}  # handle id -> (handle, record)
  t0 = time.perf_counter()
  clock = lambda: time.perf_counter() - t0
  progress = Progress("online requests finished", users * turns)
  while due or running:
    now = clock()
    if now > timeout_s:
      raise TimeoutError(f"the online run took over {timeout_s} s with {len(running)} "
                         f"requests running and {len(due)} not yet sent.")
    while due and due[0][0] <= now:
      at, user, turn = heapq.heappop(due)
      prompt, sampling = workload.user_request(user, turn)
      rec = Record(user=user, turn=turn, arrival_s=at, prompt_tokens=len(prompt))
      handle = engine.submit(prompt, sampling, tenant)
      running[handle.id] = (handle, rec)
      records[user, turn] = rec
    if not running:
      time.sleep(max(0.0, min(due[0][0] - clock(), 0.05)))
      continue
    outputs = engine.step()
    now = clock()
    for out in outputs:
      handle, rec = running[out.handle.id]
      if rec.first_token_s is None and handle.tokens:
        rec.first_token_s = now
      if out.finished:
        del running[out.handle.id]
        progress.advance(detail=f"{len(running)} running, {len(due)} waiting to arrive")
        rec.tokens, rec.finish_s = list(handle.tokens), now
        rec.finish_reason = handle.finish_reason
        workload.user_record(rec.user, rec.turn, rec.tokens)
        if rec.turn + 1 < turns:
          heapq.heappush(due, (now + float(rng.exponential(think_s)) if think_s else now,
                               rec.user, rec.turn + 1))
  return [records[u, t] for t, u in sorted((t, u) for u, t in records)], clock()


def summary(records: list[Record], makespan_s: float) -> dict:
  """TTFT, TPOT and end-to-end percentiles (seconds) and throughput of an online run."""
  ttft = [r.ttft_s for r in records]
  tpot = [r.tpot_s for r in records if r.tpot_s is not None]
  e2e = [r.finish_s - r.arrival_s for r in records]
  out = {"requests": len(records), "makespan_s": makespan_s,
         "tokens_per_s": sum(len(r.tokens) for r in records) / makespan_s,
         "requests_per_s": len(records) / makespan_s}
  for name, values in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
    for q in (50, 90, 99):
      out[f"{name}_p{q}_s"] = percentile(values, q / 100) if values else float("nan")
  out["tpot_mean_s"] = float(np.mean(tpot)) if tpot else float("nan")
  return out
