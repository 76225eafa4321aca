"""Measurement helpers: interleaved repetitions, medians with ranges, fresh buffers.

Every comparison runs its candidates interleaved (A B A B ...) after a warm-up, so both
see the same machine noise, and reports the median of the repetitions with min-max.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from collections.abc import Callable

from jaxkv.progress import Progress


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
  progress = Progress(f"timing {', '.join(candidates)}", reps)
  for rep in range(reps):
    for name, fn in candidates.items():
      if setup:
        setup(name)
      times[name].append(timed(fn))
    progress.advance(detail=f"repetition {rep + 1}")
  return {name: summary(ts) for name, ts in times.items()}


def summary(seconds: list[float]) -> dict:
  return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds),
          "reps": len(seconds)}


def medians_by_key(runs: list[dict], keys) -> dict:
  """Each of ``keys`` over ``runs`` (one figures dict per repetition): its median, min and
  max."""
  return {k: {"median": statistics.median(r[k] for r in runs),
              "min": min(r[k] for r in runs), "max": max(r[k] for r in runs)} for k in keys}


def loopback_tcp_seconds(nbytes: int, timeout_s: float = 60.0) -> float:
  """Seconds to push ``nbytes`` through a loopback TCP connection, received in full: the
  wire's floor that a fetch over the network is compared with. Raises TimeoutError when
  the bytes are not all through within ``timeout_s``."""
  data = bytes(nbytes)
  got = []
  with socket.socket() as srv:
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(timeout_s)

    def receive():
      try:
        conn, _ = srv.accept()
      except OSError:
        return
      with conn:
        conn.settimeout(timeout_s)
        n = 0
        try:
          while n < nbytes and (chunk := conn.recv(1 << 20)):
            n += len(chunk)
        except OSError:
          pass
        got.append(n)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    t0 = time.perf_counter()
    with socket.create_connection(srv.getsockname(), timeout=timeout_s) as c:
      c.sendall(data)
    t.join(timeout_s)
    elapsed = time.perf_counter() - t0
  if got != [nbytes]:
    raise TimeoutError(f"loopback TCP: {got[0] if got else 0} of {nbytes} bytes received "
                       f"within {timeout_s} s")
  return elapsed


def throughput(nbytes: int, s: dict) -> dict:
  """GB/s (1 GB = 1e9 bytes) of a ``summary`` over ``nbytes``."""
  return {"gb_per_s": nbytes / s["median_s"] / 1e9, "gb_per_s_min": nbytes / s["max_s"] / 1e9,
          "gb_per_s_max": nbytes / s["min_s"] / 1e9, **s}


def ratio(a: dict, b: dict) -> float:
  """Throughput ratio a / b from two ``summary`` dicts over the same bytes."""
  return b["median_s"] / a["median_s"]


# The model most suites share: small enough for 2 CPU cores, big enough that prefill costs.
BENCH_MODEL = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
                   head_dim=32, mlp_dim=512)


def bench_mesh():
  """4 data x 2 model over 8 devices when there are 8, else all devices on the data axis."""
  import jax
  from jaxkv.worker.pages import make_mesh
  devices = jax.devices()
  data, model = (4, 2) if len(devices) >= 8 else (len(devices), 1)
  return make_mesh(data=data, model=model, devices=devices[:data * model])


def bench_model_config():
  from jaxkv import models
  return models.LlamaConfig(**BENCH_MODEL)


def bench_cache_config(**overrides):
  """The cache of ``BENCH_MODEL``: 16-token pages; pass the page budgets."""
  from jaxkv.config import CacheConfig
  return CacheConfig.for_model(BENCH_MODEL, **{"model_name": "bench-llama", "page_size": 16,
                                               **overrides})
