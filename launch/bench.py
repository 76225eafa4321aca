"""Benchmarks. Each suite measures side by side in one run and writes one JSON object.

  python launch/bench.py --suite=tiers --json_out=/tmp/tiers.json
  python launch/bench.py --suite=tiers --quick          # a small, fast smoke run

Suites: tiers (host and disk paths against memcpy / pread / pwrite of the same bytes);
scheduler (policies side by side on the real host tier and on emulated links);
restart (restoring a checkpoint against recomputing the same prefixes; warm vs cold TTFT);
engine (no cache vs device-only LRU vs jaxkv with tiers, a quarter of the working set on device);
stream (decoding a context 4x the device budget, streamed from host, against all on device);
remote (blocks pulled from another job against loopback TCP and against recomputing);
load (Poisson arrivals under, near and over saturation: continuous batching vs waves vs no cache);
overhead (one device: jaxkv's steps against a plain dense-KV loop written in the bench);
weights (loading a Hugging Face checkpoint: time and peak host memory against
safetensors.load_file + device_put and against reading the files);
storage (the disk tier on an S3 server on loopback against a plain client's gets, and two
writer processes racing on one store, directory and bucket: blocks lost);
kernels (each attention implementation on the same decode and prefill steps; Pallas kernels
off their hardware run in the interpreter and are labelled so);
http (launch/server.py over HTTP and SSE against the same engine in process, same arrivals);
smollm2 (a real model from its GGUF file: load, compile per step bucket with the layers
scanned and looped, server start cold and warm, decode and prefill against transformers);
pool (a Mooncake Store pool on loopback: another process's blocks against loopback TCP, the
BlockServer and recompute; how much of the lent memory holds blocks when it overflows);
replicas (four replicas behind launch/router.py: routing by the KV indexer's prefix scores
against round-robin and against one replica serving everything; event lag, router overhead);
gemma3 (Gemma 3 270M from its GGUF file: prefill and decode tokens/s against llama.cpp and
transformers on CPU, same prompt, same threads; greedy tokens against llama.cpp's);
hybrid (KV groups on Gemma 3 270M's cache shapes: device bytes of an 8k-token sequence and the
bytes a later turn fetches from host, against keeping every layer's pages);
fabric (root: a lender and an engine in network namespaces, the lender's link shaped with tc
from below to above the crossover: always fetch, always recompute and the plan at each rate,
the plan across rate changes, a lost lender, a shared link and a link set down; one row per
tier the prefix is found in, --fabric_tiers=remote,pool,s3).
"""

import importlib.util
import time

from absl import app, flags

import _common

SUITES = ("tiers", "scheduler", "restart", "engine", "stream", "remote", "load", "overhead",
          "weights", "storage", "kernels", "http", "smollm2", "pool", "replicas", "gemma3",
          "hybrid", "fabric")
_SUITE = flags.DEFINE_enum("suite", "tiers", SUITES, "Which suite to run.")
_QUICK = flags.DEFINE_bool("quick", False, "Small sizes and few repetitions (CI smoke runs).")
_REPS = flags.DEFINE_integer("reps", 5, "Timed repetitions per candidate.", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the figures here as one JSON object.")
_PLOT_OUT = flags.DEFINE_string(
    "plot_out", "", "--suite=fabric: draw TTFT against the link's rate, one line per policy, "
    "here (PNG; needs matplotlib; with several --fabric_tiers, one file per row, -<tier> "
    "before the extension).")
_FABRIC_TIERS = flags.DEFINE_list(
    "fabric_tiers", ["remote", "pool", "s3"], "--suite=fabric: the rows to run, where the "
    "cached prefixes are: remote (a peer's block server), pool (Mooncake), s3 (a disk tier "
    "in a bucket).")
_FABRIC_SHARED = flags.DEFINE_list(
    "fabric_shared", ["400"], "--suite=fabric: link rates (Mbit/s) at which two engine nodes "
    "fetch over the lender's one link at once (empty: no shared-link run).")
_FABRIC_DOWN = flags.DEFINE_float(
    "fabric_down", 400.0, "--suite=fabric: the link rate (Mbit/s) at which the lender's link "
    "is set down in the middle of a fetch (0: no link-down run).", lower_bound=0.0)
_LOAD_RPS = flags.DEFINE_float(
    "load_reference_rps", None, "--suite=load: the rate (req/s) its under/near/over arrival "
    "rates are 0.5/0.9/1.5 of, instead of the saturation it measures (to compare two builds "
    "at the same rates).", lower_bound=0.01)


def _print(result: dict) -> None:
  for key, value in result.items():
    if isinstance(value, float):
      print(f"{key:32s} {value:8.3f}")
  for name, value in result.get("chunk_layout", {}).items():
    if isinstance(value, float):
      print(f"  layout {name:28s} {value:7.2f}")
  for name, link in result.get("links", {}).items():
    label = "emulated" if link["emulated"] else "measured"
    ttft = "  ".join(f"{p}={1e3 * t:.0f}ms" for p, t in link["ttft_s"].items())
    print(f"  {name:16s} ({label}, {link['link_vs_break_even']:.2g}x break-even) {ttft}")
  for label, row in result.get("rates", {}).items():
    print(f"  {label:5s} {row['requests_per_s']:6.2f} req/s  " + "  ".join(
        f"{name}: {fig['tokens_per_s']:6.1f} tok/s p90 {1e3 * fig['ttft_p90_s']:6.0f} ms"
        for name, fig in row.items() if isinstance(fig, dict)))
  for name, fig in result.get("loads", {}).items():
    print(f"  load {name:10s} {fig['seconds']:7.2f} s {fig['gb_per_s']:6.2f} GB/s  peak anon "
          f"{fig['peak_anon_bytes'] / 2**20:8.0f} MiB  file {fig['peak_file_bytes'] / 2**20:8.0f} MiB")
  for key, fig in result.items():
    if isinstance(fig, dict) and "tokens_per_s" in fig:
      label = " (interpreted: not kernel speed)" if fig["interpreted"] else ""
      print(f"  {key:22s} {1e3 * fig['median_s']:9.2f} ms {fig['tokens_per_s']:10.0f} tok/s "
            f"{fig['gb_per_s']:7.2f} GB/s{label}")
  for group in ("host", "disk", "object_store"):
    for name, fig in result.get(group, {}).items():
      print(f"  {group:5s} {name:24s} {fig['gb_per_s']:7.2f} GB/s "
            f"({fig['gb_per_s_min']:.2f}-{fig['gb_per_s_max']:.2f})")


def main(argv):
  del argv
  _common.check_output(_JSON_OUT.value, "json_out")
  if _PLOT_OUT.value:
    if _SUITE.value != "fabric":
      raise app.UsageError(f"--plot_out draws the fabric suite's sweep; --suite={_SUITE.value} "
                           "has none: leave --plot_out out.")
    if importlib.util.find_spec("matplotlib") is None:
      raise app.UsageError("--plot_out needs matplotlib: pip install matplotlib (or the "
                           "[plot] extra).")
    _common.check_output(_PLOT_OUT.value, "plot_out")
  if _SUITE.value == "fabric":  # flags, root, iproute2 and moto, said in one line before JAX
    from jaxkv.tools import fabric as fabric_lib
    from jaxkv.tools.bench import fabric
    try:
      shared = [float(r) for r in _FABRIC_SHARED.value]
    except ValueError:
      raise app.UsageError(f"--fabric_shared={','.join(_FABRIC_SHARED.value)} must be rates "
                           "in Mbit/s, comma-separated (or empty).") from None
    if not _FABRIC_TIERS.value:
      raise app.UsageError(f"--fabric_tiers= must name rows, some of {tuple(fabric.TIERS)}.")
    for tier in _FABRIC_TIERS.value:
      if tier not in fabric.TIERS:
        raise app.UsageError(f"--fabric_tiers={','.join(_FABRIC_TIERS.value)} names {tier!r}: "
                             f"the rows are {', '.join(fabric.TIERS)}.")
      fabric.check_tier(tier)
    fabric_lib.check_available()
  _common.start_jax({"platform": None, "host_device_count": 8})
  t0 = time.perf_counter()
  if _SUITE.value == "tiers":
    from jaxkv.tools.bench import tiers
    result = tiers.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  elif _SUITE.value == "scheduler":
    from jaxkv.tools.bench import scheduler
    result = scheduler.run(quick=_QUICK.value)
  elif _SUITE.value == "restart":
    from jaxkv.tools.bench import restart
    result = restart.run(quick=_QUICK.value, reps=_REPS.value)
  elif _SUITE.value == "engine":
    from jaxkv.tools.bench import engine
    result = engine.run(quick=_QUICK.value)
  elif _SUITE.value == "stream":
    from jaxkv.tools.bench import stream
    result = stream.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  elif _SUITE.value == "load":
    from jaxkv.tools.bench import load
    result = load.run(quick=_QUICK.value, reference_rps=_LOAD_RPS.value)
  elif _SUITE.value == "overhead":
    from jaxkv.tools.bench import overhead
    result = overhead.run(quick=_QUICK.value)
  elif _SUITE.value == "weights":
    from jaxkv.tools.bench import weights
    result = weights.run(quick=_QUICK.value, reps=2 if _QUICK.value else min(_REPS.value, 3))
  elif _SUITE.value == "kernels":
    from jaxkv.tools.bench import kernels
    result = kernels.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  elif _SUITE.value == "http":
    from jaxkv.tools.bench import http
    result = http.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  elif _SUITE.value == "smollm2":
    from jaxkv.tools.bench import smollm2
    result = smollm2.run(quick=_QUICK.value, reps=_REPS.value)
  elif _SUITE.value == "gemma3":
    from jaxkv.tools.bench import gemma3
    result = gemma3.run(quick=_QUICK.value, reps=min(_REPS.value, 3))
  elif _SUITE.value == "hybrid":
    from jaxkv.tools.bench import hybrid
    result = hybrid.run(quick=_QUICK.value)
  elif _SUITE.value == "pool":
    from jaxkv.tools.bench import pool
    result = pool.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  elif _SUITE.value == "replicas":
    from jaxkv.tools.bench import replicas
    result = replicas.run(quick=_QUICK.value, reps=2 if _QUICK.value else min(_REPS.value, 3))
  elif _SUITE.value == "fabric":
    result = fabric.run_tiers(_FABRIC_TIERS.value, quick=_QUICK.value, reps=_REPS.value,
                              shared=shared, down=_FABRIC_DOWN.value,
                              compile_cache_dir=_common.use_compilation_cache())
    if _PLOT_OUT.value:
      fabric.plot_tiers(result, _PLOT_OUT.value)
  elif _SUITE.value == "storage":
    from jaxkv.tools.bench import storage
    result = storage.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  else:
    from jaxkv.tools.bench import remote
    result = remote.run(quick=_QUICK.value, reps=2 if _QUICK.value else _REPS.value)
  result = {"suite": _SUITE.value, **result, "wall_s": time.perf_counter() - t0,
            "machine": _common.machine_info()}
  _print(result)
  _common.write_json(_JSON_OUT.value, result)


if __name__ == "__main__":
  _common.run(main)
