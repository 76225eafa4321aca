"""Serve a deterministic multi-turn chat workload and report TTFT with and without reuse.

  python launch/serve.py                               # configs/cpu_tiny.py, both caches
  python launch/serve.py --cache=nocache --nocompare   # the no-cache baseline alone
  python launch/serve.py --json_out=/tmp/serve.json
  python launch/serve.py --request_rate=4              # online: users arrive over time

By default the workload runs in rounds: each round's requests are generated together, by
the chosen --cache and, unless --nocompare, by the other one right after it on the same
prompts (interleaved, so both see the same machine noise). With --request_rate, users
arrive by a Poisson process and each sends its next request a think time after its
previous answer (jaxkv.tools.online); each cache runs the same arrivals in turn, and the
summary adds time per output token and end-to-end latency.

The JSON (--json_out) names the main run's cache under "cache" (and "baseline"'s under
its own "cache"); the same value is also under "policy", the key's former name, for the
scripts that read it. --policy is --cache's former name (it still works, with a warning).
"""

import importlib.util
import statistics
import time

from absl import app, flags

import _common
import _flags
from _flags import CHECKPOINT_DIR as _CHECKPOINT_DIR, CONFIG as _CONFIG
from _flags import DEPLOYMENT_KEY_FILE as _DEPLOYMENT_KEY_FILE

_CACHE = flags.DEFINE_enum("cache", "jaxkv", ["jaxkv", "nocache"],
                           "The main run's cache. jaxkv: reuse cached prefixes; nocache: "
                           "recompute every prompt.")
_POLICY = flags.DEFINE_enum("policy", None, ["jaxkv", "nocache"], "Deprecated: --cache's "
                            "former name (still works, with a warning).")
_COMPARE = flags.DEFINE_bool("compare", True, "Also run the other cache side by side.")
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the figures here as one JSON object.")
_TRACE = flags.DEFINE_string("trace", None, "Run requests from this JSONL trace file instead "
                             "of the config's workload.")
_PLOT = flags.DEFINE_string("plot", None, "Write a PNG of TTFT by turn per cache and tier "
                            "occupancy over time.")
_METRICS_OUT = flags.DEFINE_string("metrics_out", None, "Write the metrics (jaxkv.metrics) "
                                   "here at the end as a Prometheus text file (atomically).")
_METRICS_PORT = flags.DEFINE_integer("metrics_port", None, "Serve the metrics live on "
                                     "http://METRICS_HOST:PORT/metrics during the run.",
                                     lower_bound=1, upper_bound=65535)
_METRICS_HOST = flags.DEFINE_string("metrics_host", "127.0.0.1", "Address the live metrics "
                                    "listen on (0.0.0.0: every interface).")
_RATE = flags.DEFINE_float("request_rate", 0.0, "Online load: users arriving per second "
                           "(Poisson); 0 = run the workload in rounds. A trace whose lines "
                           "carry arrival_s arrives at those times.", lower_bound=0.0)
_THINK = flags.DEFINE_float("think_time_s", 0.5, "Online load: mean think time (exponential) "
                            "between a user's answer and its next request.", lower_bound=0.0)


def _main_cache() -> str:
  """--cache, or the value of its former name --policy (with a warning)."""
  return _common.renamed_flag(_CACHE, _POLICY)


def main(argv):
  del argv
  # Everything the flags name is checked before JAX starts: a refusal costs no compile.
  main_name = _main_cache()
  _flags.check_restore_flags()
  for path, flag in ((_JSON_OUT.value, "json_out"), (_METRICS_OUT.value, "metrics_out"),
                     (_PLOT.value, "plot")):
    _common.check_output(path, flag)
  if _PLOT.value and importlib.util.find_spec("matplotlib") is None:
    raise app.UsageError("--plot needs matplotlib: pip install matplotlib (or the [plot] "
                         "extra).")
  cfg = _common.load_config(_CONFIG)
  _flags.apply_tier_flags(cfg)
  if _flags.ROLE.value != "both":
    raise app.UsageError(f"--role={_flags.ROLE.value}: serve.py runs whole requests; a prefill "
                         "or decode node is launch/server.py --role (launch/pd_proxy.py "
                         "drives a pair).")
  _common.start_jax(cfg)
  _flags.check_pool(cfg)
  import jax
  from jaxkv import distributed, metrics, security
  from jaxkv.tools import builder, workloads
  deployment_key = security.load_deployment_key(_DEPLOYMENT_KEY_FILE.value)
  from jaxkv.planning.costs import agree_costs
  multi = distributed.initialize()  # a no-op unless launch/multihost.py (or a cluster) set it
  _common.check_platform(cfg)  # (done already in one process; a job's processes do it here)
  restore = _flags.should_restore()
  tokenizer = _flags.use_model_dir(cfg)
  model_dir = cfg.model.get("model_dir", "")

  caches = [main_name] + ([c for c in builder.CACHES if c != main_name]
                          if _COMPARE.value else [])
  mesh = builder.make_mesh_for(cfg)
  t_load = time.perf_counter()
  model = builder.load_model(cfg, mesh)  # once: the engines share its weights
  if model_dir:
    print(f"loaded {model_dir} in {time.perf_counter() - t_load:.1f} s ({cfg.model.dtype}, "
          f"mesh {cfg.mesh.data} x {cfg.mesh.model}, prefill chunk "
          f"{cfg.engine.prefill_chunk_pages} pages)")
  models = [model] + [builder.share_weights(model) for _ in caches[1:]]
  engines = {c: builder.build_engine(cfg, cache=c, mesh=mesh, model=m,
                                    deployment_key=deployment_key)
             for c, m in zip(caches, models)}
  registry = metrics.registry(engines, labels={"config": cfg.name})
  if _METRICS_PORT.value:
    if not security.is_loopback(_METRICS_HOST.value):
      security.warn_insecure(f"the metrics listen on {_METRICS_HOST.value}: whoever reaches "
                             "them sees tenants' traffic", "use --metrics_host=127.0.0.1")
    metrics.serve(registry, _METRICS_PORT.value, _METRICS_HOST.value)
    print(f"metrics at http://{_METRICS_HOST.value}:{_METRICS_PORT.value}/metrics")
  if _TRACE.value:
    with cfg.unlocked():
      cfg.workload.kind = "trace"
      cfg.workload.trace.path = _TRACE.value
  make_work = lambda: workloads.from_config(cfg.workload, cfg.model.vocab_size, cfg.seed,
                                            tokenizer)
  work = make_work()
  online = bool(_RATE.value) or work.arrivals() is not None  # a trace with arrival times
  if online and multi:
    raise app.UsageError("--request_rate runs on one process (arrivals follow one clock); "
                         "drop it or run without launch/multihost.py.")
  t0 = time.perf_counter()
  # Every side of the comparison is warmed (engines over one model structure share the
  # compiled steps; each has its own tier transfers, calibration and plan).
  for e in engines.values():
    e.warmup(max_seq_len=work.max_seq_len())
  if multi:  # one job plans from one set of costs: process 0's
    for e in engines.values():
      if e.costs is not None:
        e.costs = agree_costs(e.costs)
  checkpointer = None
  if _CHECKPOINT_DIR.value:
    from jaxkv.worker.checkpoint import Checkpointer
    checkpointer = Checkpointer((engines["jaxkv"] if "jaxkv" in engines
                                 else engines[main_name]).cache, _CHECKPOINT_DIR.value)
    if restore:
      counts = checkpointer.restore()
      windows = counts["windows_kept"] + counts["windows_kept_host"]
      kept = (f", {windows} kept windows ({counts['windows_kept_host']} in host memory)"
              if windows else "")
      print(f"restored step {counts['step']}: {counts['placed']} blocks{kept} "
            f"({counts['failed_checksum']} failed their checksum)")
  print(f"compiled in {time.perf_counter() - t0:.1f} s; workload {cfg.workload.kind}, "
        f"{work.rounds} rounds")
  from jaxkv.compiles import COMPILES
  for e in engines.values():  # warm from here: every engine warmed, the checkpoint restored
    e.mark_warm()
  warm_mark = COMPILES.mark()  # nothing may compile from here on

  if online:
    outputs, ttft, wall_s, occupancy, online_summary = _run_online(engines, make_work)
  else:
    outputs, ttft, wall_s, occupancy = _run_rounds(engines, work)
    online_summary = None

  compiled_late = COMPILES.names_since(warm_mark)
  if compiled_late:
    print(f"compiled after warm-up ({len(compiled_late)}): {', '.join(compiled_late)}")
  engines[main_name].flush()
  index_digest = engines[main_name].cache.index.digest()
  if multi:
    distributed.agree_digest(index_digest, "the PrefixIndex")
  if checkpointer is not None:
    step = checkpointer.save()
    checkpointer.close()
    print(f"saved the cache as step {step} in {_CHECKPOINT_DIR.value}")
  for e in engines.values():
    e.cache.close()  # the pool's queued puts finished, its segment unmounted
  stats = engines[main_name].stats()
  main_cache = engines[main_name].cache
  kv_events = None  # published by process 0 alone
  if main_cache.events_publisher is not None:
    kv_events = {"messages": main_cache.events_publisher.sent,
                 "held": main_cache.events.held(), "untold": main_cache.events.untold}
  result = {
      "config": cfg.name,
      "cache": main_name,
      "policy": main_name,  # "cache"'s former key, kept for the scripts that read it
      "ttft_s": [t for turn in ttft[main_name] for t in turn],
      "ttft_s_by_turn": ttft[main_name],
      "hits": stats["hits"],
      "verify_failures": stats["verify_failures"],
      "output_digest": _common.token_digest(outputs[main_name]),
      "index_digest": index_digest,
      "kv_events": kv_events,
      "process": {"index": jax.process_index(), "count": jax.process_count()},
      # what ran, after the platform's defaults for a checkpoint (builder.platform_defaults)
      "dtype": cfg.model.dtype,
      "mesh": {"data": cfg.mesh.data, "model": cfg.mesh.model},
      "prefill_chunk_pages": cfg.engine.prefill_chunk_pages,
      "stats": stats,
      "compiles_after_warmup": len(compiled_late),
      "compiled_after_warmup": compiled_late,
      "machine": _common.machine_info(),
  }
  if len(caches) == 2:
    other = caches[1]
    later = lambda p: statistics.mean(t for turn in ttft[p][1:] for t in turn)
    reuse, nocache = ("jaxkv", "nocache")
    rounds = len(ttft[main_name])
    speedup = later(nocache) / later(reuse) if rounds > 1 else float("nan")
    result["baseline"] = {"cache": other, "policy": other,
                          "ttft_s": [t for turn in ttft[other] for t in turn],
                          "output_digest": _common.token_digest(outputs[other])}
    result["outputs_match"] = outputs[reuse] == outputs[nocache]
    result.update(_agreement(outputs[reuse], outputs[nocache]))
    result["ttft_speedup_later_turns"] = speedup
    print(f"later turns (1..{rounds - 1}): mean TTFT nocache / jaxkv = {speedup:.2f}x; "
          f"outputs identical: {result['outputs_match']} (greedy match rate "
          f"{result['greedy_match_rate']:.4f})")
  result["summary"] = _summary({p: e.stats() for p, e in engines.items()}, wall_s)
  if online_summary is not None:
    for p, fig in online_summary.items():  # TTFT from arrival, TPOT, end-to-end
      result["summary"][p].update(fig)
    result["online"] = {"request_rate": _RATE.value, "think_time_s": _THINK.value,
                        "arrivals": "trace" if not _RATE.value else "poisson"}
  result["tier_occupancy_blocks"] = occupancy
  if tokenizer is not None:  # text out: every answer of the main run, in request order
    result["texts"] = [tokenizer.decode(o) for o in outputs[main_name]]
    if cfg.workload.kind == "trace":
      for i, text in enumerate(result["texts"]):
        print(f"answer {i}: {' '.join(text.split())[:120]}")
  print()
  print(_summary_table(result["summary"]))
  print(f"output_digest {result['output_digest']}")
  _common.write_json(_JSON_OUT.value, result)
  if _METRICS_OUT.value:
    metrics.write_textfile(_METRICS_OUT.value, registry)
  if _PLOT.value:
    _plot(_PLOT.value, ttft, occupancy, cfg.name)
    print(f"plot written to {_PLOT.value}")


def _run_rounds(engines: dict, work):
  """Every round's requests together, each cache's engine in turn on the same prompts;
  which runs first alternates by round (round 0 the main one), so neither always runs on a
  machine the other just warmed (CPU caches, clocks). Each engine's outputs stay in request
  order."""
  names = list(engines)
  outputs = {p: [] for p in names}
  ttft = {p: [] for p in names}
  wall_s = {p: 0.0 for p in names}
  occupancy = []  # blocks cached per tier after every round (main run)
  print(f"{'turn':>4} {'prompt tok':>10} " + " ".join(f"{p + ' TTFT ms':>16}" for p in names))
  for turn in range(work.rounds):
    prompts = work.prompts(turn)
    for p in names if turn % 2 == 0 else names[::-1]:
      engine = engines[p]
      before = len(engine.stats()["ttft_s"])
      t0 = time.perf_counter()
      answers = engine.generate(prompts, work.sampling(turn))
      wall_s[p] += time.perf_counter() - t0
      ttft[p].append(engine.stats()["ttft_s"][before:])
      outputs[p].extend(answers)
    work.record(turn, outputs[names[0]][-len(prompts):])
    occupancy.append(_occupancy(engines[names[0]]))
    mean_prompt = statistics.mean(len(x) for x in prompts)
    print(f"{turn:>4} {mean_prompt:>10.0f} "
          + " ".join(f"{1e3 * statistics.mean(ttft[p][turn]):>16.1f}" for p in names))
  return outputs, ttft, wall_s, occupancy


def _run_online(engines: dict, make_work):
  """Each cache's engine in turn under the same arrivals (a fresh workload each: same users)."""
  from jaxkv.tools import online
  outputs, ttft, wall_s, figures = {}, {}, {}, {}
  occupancy = []
  for p, engine in engines.items():
    records, makespan = online.run(engine, make_work(), rate=_RATE.value,
                                   think_s=_THINK.value, seed=_CONFIG.value.seed)
    outputs[p] = [r.tokens for r in records]
    turns = max(r.turn for r in records) + 1
    ttft[p] = [[r.ttft_s for r in records if r.turn == t] for t in range(turns)]
    wall_s[p] = makespan
    figures[p] = online.summary(records, makespan)
    if not occupancy:
      occupancy.append(_occupancy(engine))
    f = figures[p]
    print(f"{p:>8}: {f['requests']} requests in {makespan:.1f} s; TTFT p50/p90 "
          f"{1e3 * f['ttft_p50_s']:.0f}/{1e3 * f['ttft_p90_s']:.0f} ms, TPOT p50 "
          f"{1e3 * f['tpot_p50_s']:.1f} ms, {f['tokens_per_s']:.1f} tok/s")
  return outputs, ttft, wall_s, occupancy, figures


def _agreement(reused: list, fresh: list) -> dict:
  """How far answers with reuse agree with recomputing, position by position:
  ``greedy_match_rate`` (the share of generated tokens equal to the no-cache run's at the
  same position of the same request; 1.0 where exact) and ``first_divergence`` (per
  request, the first position that differs, or None)."""
  same = total = 0
  first = []
  for a, b in zip(reused, fresh):
    n = max(len(a), len(b))
    same += sum(x == y for x, y in zip(a, b))
    total += n
    first.append(next((i for i in range(n) if i >= min(len(a), len(b)) or a[i] != b[i]), None))
  return {"greedy_match_rate": same / total if total else 1.0, "first_divergence": first}


def _occupancy(engine) -> dict:
  return engine.occupancy()["cached_blocks"]


def _plot(path: str, ttft: dict, occupancy: list, title: str) -> None:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:  # checked at start-up
    raise AssertionError("matplotlib vanished during the run") from None
  from matplotlib.ticker import MaxNLocator
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
  for p, turns in ttft.items():
    ax1.plot(range(len(turns)), [1e3 * statistics.mean(t) for t in turns], marker="o", label=p)
  for tier in ("device", "host", "disk"):
    ax2.plot(range(len(occupancy)), [o[tier] for o in occupancy], marker="s", label=tier)
  for ax, xlabel, ylabel, name in (
      (ax1, "turn", "mean TTFT (ms)", "Time to first token by turn"),
      (ax2, "turn (after)", "cached blocks", "Tier occupancy (jaxkv)")):
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=name)
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
  fig.suptitle(f"jaxkv serve — {title}")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _summary(stats: dict, wall_s: dict) -> dict:
  from jaxkv.metrics import percentile
  out = {}
  for p, s in stats.items():
    pct = lambda q, s=s: percentile(s["ttft_s"], q)
    out[p] = {"ttft_p50_s": pct(0.5), "ttft_p90_s": pct(0.9), "ttft_p99_s": pct(0.99),
              "tokens_per_s": s["generated_tokens"] / wall_s[p], "hits": s["hits"],
              "blocks_fetched": s["blocks_fetched"], "blocks_recomputed": s["blocks_recomputed"],
              "blocks_split": s["blocks_split"], "bytes_moved": s["bytes_moved"],
              "verify_failures": s["verify_failures"]}
    if s.get("tpot_s"):  # per request, from the engine (online runs give their own)
      out[p]["tpot_p50_s"] = percentile(s["tpot_s"], 0.5)
  return out


def _summary_table(summary: dict) -> str:
  rows = [("TTFT p50 (ms)", lambda v: f"{1e3 * v['ttft_p50_s']:.1f}"),
          ("TTFT p90 (ms)", lambda v: f"{1e3 * v['ttft_p90_s']:.1f}"),
          ("TTFT p99 (ms)", lambda v: f"{1e3 * v['ttft_p99_s']:.1f}"),
          ("throughput (tok/s)", lambda v: f"{v['tokens_per_s']:.1f}"),
          ("TPOT p50 (ms)", lambda v: f"{1e3 * v['tpot_p50_s']:.1f}" if "tpot_p50_s" in v
           else "-"),
          ("hits device/host/disk", lambda v: "/".join(str(v["hits"][k])
                                                       for k in ("device", "host", "disk"))),
          ("blocks fetched", lambda v: str(v["blocks_fetched"])),
          ("blocks recomputed", lambda v: str(v["blocks_recomputed"])),
          ("blocks split", lambda v: str(v["blocks_split"])),
          ("bytes moved", lambda v: f"{v['bytes_moved'] / 2**20:.1f} MiB"),
          ("verify failures", lambda v: str(v["verify_failures"]))]
  names = list(summary)
  lines = [f"{'':24s}" + "".join(f"{n:>14s}" for n in names)]
  for label, fmt in rows:
    lines.append(f"{label:24s}" + "".join(f"{fmt(summary[n]):>14s}" for n in names))
  return "\n".join(lines)




if __name__ == "__main__":
  _common.run(main)
