"""Replicas behind a router: prefix routing (launch/router.py asking Dynamo's KV indexer)
against round-robin, and against one replica serving everything, side by side in one run.

Four launch/server.py replicas (CPU, one device each, the tiny model) publish KV events;
``python -m dynamo.indexer`` reads them; two routers run over the same replicas, one routing
by prefix and one in turn. The multi-turn chat workload (Poisson arrivals, every next turn
right after the answer) runs through each router in alternating order, each run with new
prompts (its own seed), and once straight to replica 0 alone ("single": every user's
history in one place, which is what prefix routing tries to give each user). Each replica
holds its share of the users' histories on device; one replica holds all of them only with
its host tier, so "single" reuses every turn's history as well.

Figures: ``routed_cached_share_vs_single`` (cached-token share through the prefix router ÷
single), ``routed_ttft_p50_vs_round_robin`` and ``routed_tokens_per_s_vs_round_robin`` (per
repetition, then the median), ``events_lag_ms_p99`` (a block's event seen on the wire ->
the indexer's score counting it, polled every millisecond), ``router_overhead_ms_p50`` (TTFT
through the router minus straight to the replica it chose, paired requests of the same
length, at light load) and ``router_ttft_vs_direct`` (the same as a ratio).
"""

from __future__ import annotations

import os
import statistics
import time

import httpx
import msgspec
import numpy as np
import zmq

from jaxkv.metrics import percentile
from jaxkv.progress import Progress
from jaxkv.entrypoints.openai.router import tenant_tokens
from jaxkv.tools.bench.common import medians_by_key
from jaxkv.tools.bench.http import ServerProcess, Target, TokenChat, run_load, summary
from jaxkv.tools.bench.indexer import DynamoIndexer
from jaxkv.worker.tiers.pool.master import free_port

REPLICAS = 4
PAGE = 16


def replica_flags(quick: bool) -> list[str]:
  """One device each and a batch of 4 rows; device pages for four users' histories, host
  pages for all sixteen users' (so one replica alone reuses every history too)."""
  seq, device, host = (16, 64, 256) if quick else (32, 128, 512)
  return ["--config.mesh.data=1", "--config.mesh.model=1",
          "--config.engine.max_seqs_per_shard=4", f"--config.cache.max_pages_per_seq={seq}",
          f"--device_pages={device}", f"--host_pages={host}", "--config.scheduler.decision=fetch"]


MODEL = "llama-tiny-random"


def _chat(users: int, turns: int, seed: int, quick: bool):
  from jaxkv.tools import workloads
  return TokenChat(workloads.Chat(workloads.ChatSpec(
      users=users, turns=turns, system_prompt_tokens=32,
      user_tokens=(16, 40) if quick else (48, 96), max_new_tokens=8, vocab_size=512,
      seed=seed)))


def _ttft(url: str, prompt: list[int]) -> tuple[float, str | None]:
  """Seconds to the first streamed token of a greedy completion, and the replica's header."""
  t0 = time.perf_counter()
  with httpx.stream("POST", f"{url}/completions", json={
      "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, "stream": True,
      "return_token_ids": True}, timeout=120) as r:
    r.raise_for_status()
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        return time.perf_counter() - t0, r.headers.get("x-jaxkv-replica")
  raise RuntimeError("a stream ended without a token")


def _events_lag_ms(replica: ServerProcess, events: str, idx: DynamoIndexer, n: int,
                   rng) -> list[float]:
  """Per fresh prompt: its last block's BlockStored read off the replica's stream, then the
  indexer polled until its score counts that block."""
  sub = zmq.Context.instance().socket(zmq.SUB)
  sub.setsockopt(zmq.SUBSCRIBE, b"")
  sub.setsockopt(zmq.LINGER, 0)
  sub.connect(events)
  time.sleep(0.5)
  while sub.poll(200):  # the snapshot a new subscriber gets
    sub.recv_multipart()
  lags = []
  try:
    for _ in range(n):
      prompt = rng.integers(1, 500, 4 * PAGE + 3).tolist()
      # As the replica's events tell the blocks (its one tenant's mapped ids) and its
      # router asks for them.
      told = tenant_tokens(prompt[:4 * PAGE])
      last = told[3 * PAGE:4 * PAGE]
      with httpx.Client() as client:
        client.post(f"{replica.url}/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=120)
      seen = None
      deadline = time.monotonic() + 30
      while seen is None and time.monotonic() < deadline:
        if not sub.poll(100):
          continue
        _, _, payload = sub.recv_multipart()
        t = time.perf_counter()
        if any(ev.get("type") == "BlockStored" and ev.get("token_ids") == last
               for ev in msgspec.msgpack.decode(payload)[1]):
          seen = t
      if seen is None:
        raise RuntimeError("the replica's stream never told the prompt's last block")
      while True:
        held = idx.query(told).get(1, {})
        if held.get("device", 0) >= 4 * PAGE:
          lags.append(1e3 * (time.perf_counter() - seen))
          break
        if time.perf_counter() - seen > 30:
          raise RuntimeError("the indexer never counted the block")
        time.sleep(0.001)
  finally:
    sub.close(0)
  return lags


def run(*, quick: bool = False, reps: int = 3) -> dict:
  users, turns, rate = (8, 3, 4.0) if quick else (16, 4, 2.0)
  ports = [(free_port(), free_port()) for _ in range(REPLICAS)]
  endpoints = [(f"tcp://127.0.0.1:{a}", f"tcp://127.0.0.1:{b}") for a, b in ports]
  flags = replica_flags(quick)
  servers = [ServerProcess([*flags, f"--kv_events={e}", f"--kv_events_replay={r}"])
             for e, r in endpoints]
  rng = np.random.default_rng(0)
  try:
    with DynamoIndexer() as idx:
      for s in servers:
        s.wait_ready(900)
      bases = ",".join(s.base for s in servers)
      spec = ",".join(f"{e}@{r}" for e, r in endpoints)
      with ServerProcess([f"--replicas={bases}", f"--indexer={idx.url}",
                          f"--replica_events={spec}", f"--block_size={PAGE}"],
                         script=os.path.join("launch", "router.py")) as prefix, \
           ServerProcess([f"--replicas={bases}", "--routing=round_robin"],
                         script=os.path.join("launch", "router.py")) as rr:
        prefix.wait_ready(120)
        rr.wait_ready(120)
        targets = {"prefix": prefix.url, "round_robin": rr.url, "single": servers[0].url}

        def one(name: str, seed: int) -> dict:
          work = _chat(users, turns, seed, quick)
          results, makespan = run_load(Target(url=targets[name], model=MODEL,
                                              request_timeout_s=300.0, ignore_eos=True),
                                       work, rate=rate, seed=seed)
          fig = summary(results, makespan, planned=users * turns)
          if fig["requests_ok"] != users * turns:
            raise RuntimeError(f"{name}: {fig['requests_failed']} requests failed "
                               f"({fig['error_examples']})")
          return fig

        one("prefix", 999)  # warm-up: every replica's step shapes, connections
        one("round_robin", 998)
        runs = {name: [] for name in targets}
        progress = Progress("replicas suite", reps * len(targets))
        for rep in range(reps):
          order = list(targets) if rep % 2 == 0 else list(targets)[::-1]
          for i, name in enumerate(order):
            runs[name].append(one(name, 1 + 10 * rep + i))
            progress.advance(detail=f"{name}, repetition {rep + 1}")
        # Light load: the same-length prompts through the prefix router and straight to
        # the replica it chose, in turn (each prompt new: both are misses).
        paired, ratios = [], []
        for _ in range(8 if quick else 20):
          a, b = (rng.integers(1, 500, 3 * PAGE).tolist() for _ in range(2))
          routed, replica = _ttft(prefix.url, a)
          direct, _ = _ttft(replica + "/v1", b)
          paired.append(1e3 * (routed - direct))
          ratios.append(routed / direct)
        lags = _events_lag_ms(servers[0], endpoints[0][0], idx, 10 if quick else 30, rng)
        stats = httpx.get(f"{prefix.base}/router/stats").json()
  finally:
    for s in servers:
      s.close()
  keys = ("ttft_p50_s", "ttft_p90_s", "tokens_per_s", "cached_token_share", "makespan_s")
  table = {name: medians_by_key(r, keys) for name, r in runs.items()}
  per_rep = lambda k: [p[k] / q[k] for p, q in zip(runs["prefix"], runs["round_robin"])]
  share = [p["cached_token_share"] / s["cached_token_share"]
           for p, s in zip(runs["prefix"], runs["single"])]
  return {
      "routed_cached_share_vs_single": statistics.median(share),
      "routed_ttft_p50_vs_round_robin": statistics.median(per_rep("ttft_p50_s")),
      "routed_ttft_p50_vs_round_robin_range": [min(per_rep("ttft_p50_s")),
                                               max(per_rep("ttft_p50_s"))],
      "routed_tokens_per_s_vs_round_robin": statistics.median(per_rep("tokens_per_s")),
      "events_lag_ms_p99": percentile(lags, 0.99),
      "events_lag_ms_p50": percentile(lags, 0.5),
      "router_overhead_ms_p50": statistics.median(paired),
      "router_ttft_vs_direct": statistics.median(ratios),
      "cached_token_share": {name: t["cached_token_share"]["median"] for name, t in table.items()},
      "runs": table,
      "router_stats": stats,
      "workload": {"replicas": REPLICAS, "users": users, "turns": turns, "users_per_s": rate,
                   "reps": reps, "replica_flags": flags},
  }
