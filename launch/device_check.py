"""The Python half of launch/device_check.sh: probes the devices, then merges the steps'
records into one JSON with a verdict on jaxkv's attention kernel.

  python launch/device_check.py probe --json_out=DIR/steps/devices.json
  python launch/device_check.py merge --out_dir=DIR [--install_s=S] [--dry_run]

The shell script runs each step under its own time limit and leaves, per step NAME, in
DIR/steps/: NAME.meta (exit status, wall seconds, time limit, the command line), NAME.stdout,
NAME.stderr and the JSON the step wrote (NAME.json). ``merge`` writes DIR/device_check.json:

- ``platform``, ``devices``, ``jax_version``: from the probe step (jax.devices());
- ``install_s``: seconds of venv + pip install (null on a dry run);
- ``steps``: per step its command, rc, wall_s, timeout_s, timed_out, and ``result``: the
  step's own JSON object (null when it wrote none); a failed step also carries the last
  lines of its stderr;
- ``host_link``: the tiers step's HBM<->host GB/s (jaxkv's tier and a bare device_put, each
  direction) beside the link's nominal rate from the config's hardware section;
- ``engine``: the engine step's headline figures (launch/serve.py, both caches warmed and
  taking turns to run first), with ``compiles_after_warmup`` (0: nothing compiled while
  serving);
- ``verdict``: ``kernel_compiled`` (the Pallas kernel for this platform ran compiled, not in
  the interpreter), ``kernel_exact`` (its largest difference from the reference within the
  dtype's tolerance, decode and prefill), ``kernel_faster`` (its decode and prefill tokens/s
  above jnp's) and ``auto_may_switch``: all three. ``auto`` stays on jnp until a device's
  JSON says true (``jaxkv.config.resolve_attention_impl``).

Merging reads files only (no JAX), so it also runs where the install failed. Kept free of
absl flags so that tests import it (its functions are the tested part).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys

# Steps in the order the shell script runs them; "install" only outside a dry run.
STEPS = ("install", "devices", "kernels", "tiers", "engine")
# The Pallas kernel each platform compiles; elsewhere the GPU form (the first device's) is
# judged, and it ran in the interpreter.
KERNEL_FOR_PLATFORM = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}
DEFAULT_KERNEL = "pallas_gpu"
# Largest |kernel - reference| accepted, by the dtype of the pages (tests/ops/test_ops.py's
# bounds for low precision; float32 as tests/tools/test_bench.py checks the quick suite).
TOLERANCE = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 3e-2}
STDERR_TAIL_LINES = 30
STDERR_TAIL_CHARS = 4000
# What each step's JSON must hold (tests/tools/test_device_check.py checks the dry run against it).
STEP_KEYS = {
    "devices": ("backend", "devices", "device_kinds", "jax", "jaxkv"),
    "kernels": ("backend", "shapes", "decode_jnp", "prefill_jnp", "machine"),
    "tiers": ("host", "host_to_device_vs_device_put", "device_to_host_vs_device_put", "bytes",
              "machine"),
    "engine": ("config", "ttft_s", "hits", "stats", "summary", "output_digest",
               "compiles_after_warmup", "machine"),
}


# ---- verdict ---------------------------------------------------------------------------------
def judged_kernel(platform: str | None) -> str:
  return KERNEL_FOR_PLATFORM.get(platform or "", DEFAULT_KERNEL)


def verdict(kernels: dict | None, platform: str | None = None) -> dict:
  """May ``auto`` switch to the kernel on ``platform``? From the kernels suite's JSON
  (``jaxkv.tools.bench.kernels``; None when the step failed): every test must pass on both
  decode and prefill, and anything missing counts as a failure, with its reason."""
  platform = (kernels or {}).get("backend", platform)
  kernel = judged_kernel(platform)
  out = {"platform": platform, "kernel": kernel, "kernel_compiled": False,
         "kernel_exact": False, "kernel_faster": False, "auto_may_switch": False,
         "reasons": []}
  reasons = out["reasons"]
  if not kernels:
    reasons.append("the kernels step wrote no JSON (see steps.kernels)")
    return out
  dtype = (kernels.get("shapes") or {}).get("dtype", "float32")
  tol = TOLERANCE.get(dtype, TOLERANCE["float32"])
  out["tolerance"], out["dtype"] = tol, dtype
  compiled = exact = faster = True
  out["steps"] = {}
  for step in ("decode", "prefill"):
    row, base = kernels.get(f"{step}_{kernel}"), kernels.get(f"{step}_jnp")
    err = kernels.get(f"{step}_{kernel}_max_abs_error")
    fig = out["steps"][step] = {"max_abs_error": err}
    if not isinstance(row, dict):
      reasons.append(f"{step}: no {kernel} row (it did not run on {platform})")
      compiled = exact = faster = False
      continue
    fig["interpreted"] = row.get("interpreted")
    if row.get("interpreted") is not False:
      reasons.append(f"{step}: {kernel} ran in Pallas' interpreter on {platform}")
      compiled = False
    if not (isinstance(err, (int, float)) and math.isfinite(err) and err <= tol):
      reasons.append(f"{step}: {kernel} max abs error {_num(err)} is not within {tol} "
                     f"({dtype})")
      exact = False
    ours = row.get("tokens_per_s")
    theirs = base.get("tokens_per_s") if isinstance(base, dict) else None
    fig["tokens_per_s"], fig["jnp_tokens_per_s"] = ours, theirs
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)) and theirs > 0:
      fig["vs_jnp"] = ours / theirs
    if not (isinstance(ours, (int, float)) and isinstance(theirs, (int, float))
            and ours > theirs):
      reasons.append(f"{step}: {kernel} {_num(ours)} tokens/s is not above jnp's "
                     f"{_num(theirs)}")
      faster = False
  out["kernel_compiled"], out["kernel_exact"], out["kernel_faster"] = compiled, exact, faster
  out["auto_may_switch"] = compiled and exact and faster
  return out


def _num(x) -> str:
  return f"{x:.4g}" if isinstance(x, (int, float)) else str(x)


# ---- the host link ---------------------------------------------------------------------------
def nominal_link(config_path: str) -> tuple[float | None, str]:
  """The config's ``hardware.host_link_gb_per_s`` and where it came from (None and the
  reason when the config has none or does not load)."""
  try:
    cfg = runpy.run_path(config_path)["get_config"]()
    return float(cfg.hardware.host_link_gb_per_s), (
        f"{os.path.basename(config_path)} hardware.host_link_gb_per_s")
  except Exception as e:  # a missing file or section: the figure is reported as absent
    return None, f"{config_path}: {type(e).__name__}: {e}"


def host_link(tiers: dict | None, nominal_gb_per_s: float | None, source: str) -> dict:
  """HBM<->host GB/s per direction: jaxkv's tier path and a bare ``jax.device_put`` of the
  same bytes (``jaxkv.tools.bench.tiers``), each also as a fraction of the nominal rate."""
  out = {"nominal_gb_per_s": nominal_gb_per_s, "nominal_from": source}
  host = (tiers or {}).get("host")
  if not isinstance(host, dict):
    out["missing"] = "the tiers step wrote no host figures (see steps.tiers)"
    return out
  out["bytes_per_move"] = (tiers.get("bytes") or {}).get("host_moves")
  for direction, ours, bare in (("device_to_host", "jaxkv_device_to_host", "device_put_to_host"),
                                ("host_to_device", "jaxkv_host_to_device", "device_put_to_device")):
    a = (host.get(ours) or {}).get("gb_per_s")
    b = (host.get(bare) or {}).get("gb_per_s")
    fig = {"jaxkv_gb_per_s": a, "device_put_gb_per_s": b,
           "jaxkv_vs_device_put": a / b if a and b else None}
    if nominal_gb_per_s:
      fig["jaxkv_vs_nominal"] = a / nominal_gb_per_s if a else None
      fig["device_put_vs_nominal"] = b / nominal_gb_per_s if b else None
    out[direction] = fig
  sweep = tiers.get("host_sweep")
  if isinstance(sweep, dict):  # by move size; the store into a small vs a large pool; HLO
    out["by_size"] = {size: {k: fig.get(k) for k in ("store_vs_device_put", "load_vs_device_put")}
                      for size, fig in (sweep.get("sizes") or {}).items()}
    out["pool_store_ms"] = sweep.get("pool_store_ms")
    out["hlo"] = sweep.get("hlo")
  return out


# ---- merging ---------------------------------------------------------------------------------
def _read_json(path: str):
  try:
    with open(path) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def _tail(path: str) -> str:
  try:
    with open(path, errors="replace") as f:
      text = f.read()
  except OSError:
    return ""
  return "\n".join(text.splitlines()[-STDERR_TAIL_LINES:])[-STDERR_TAIL_CHARS:]


def read_step(steps_dir: str, name: str) -> dict | None:
  """One step's record from the shell's files; None when the step never ran."""
  meta_path = os.path.join(steps_dir, f"{name}.meta")
  try:
    with open(meta_path) as f:
      lines = f.read().splitlines()
  except OSError:
    return None
  rc, wall_s, timeout_s = (int(lines[0]), float(lines[1]),
                           float(lines[2]) if lines[2] else None)
  command = lines[3] if len(lines) > 3 else ""
  record = {"command": command.strip(), "rc": rc, "wall_s": wall_s, "timeout_s": timeout_s,
            "timed_out": rc in (124, 137),
            "stdout": os.path.join(steps_dir, f"{name}.stdout"),
            "stderr": os.path.join(steps_dir, f"{name}.stderr"),
            "result": _read_json(os.path.join(steps_dir, f"{name}.json"))}
  if rc != 0:
    record["stderr_tail"] = _tail(record["stderr"])
  return record


def merge(out_dir: str, *, dry_run: bool, install_s: float | None, config_path: str,
          wall_s: float | None = None, installed: bool = True) -> dict:
  """``installed``: False where no install step ran (``--no_install``: the machine's own
  Python and JAX)."""
  steps_dir = os.path.join(out_dir, "steps")
  names = [s for s in STEPS if not ((dry_run or not installed) and s == "install")]
  steps = {}
  for name in names:
    steps[name] = read_step(steps_dir, name) or {"rc": None, "result": None,
                                                 "error": "the step did not run"}
  failed = [n for n, s in steps.items() if s["rc"] != 0]
  results = {n: (s["result"] if s["rc"] == 0 else None) for n, s in steps.items()}
  probe = results.get("devices") or {}
  machine = next((r["machine"] for r in results.values()
                  if isinstance(r, dict) and isinstance(r.get("machine"), dict)), {})
  platform = probe.get("backend", machine.get("backend"))
  nominal, source = nominal_link(config_path)
  return {
      "dry_run": dry_run,
      "platform": platform,
      "devices": probe.get("devices", machine.get("devices")),
      "device_kinds": probe.get("device_kinds"),
      "jax_version": probe.get("jax", machine.get("jax")),
      "jaxkv_version": probe.get("jaxkv", machine.get("jaxkv")),
      "install_s": install_s,
      "wall_s": wall_s,
      "config": config_path,
      "steps": steps,
      "failed_steps": failed,
      "host_link": host_link(results.get("tiers"), nominal, source),
      "engine": engine_summary(results.get("engine")),
      "verdict": verdict(results.get("kernels"), platform),
  }


def engine_summary(engine: dict | None) -> dict | None:
  """The engine step's headline figures (its whole JSON is under steps.engine.result)."""
  if not isinstance(engine, dict):
    return None
  main = engine.get("cache", engine.get("policy", "jaxkv"))  # "policy": the key before "cache"
  summary = (engine.get("summary") or {}).get(main, {})
  return {"config": engine.get("config"), "hits": engine.get("hits"),
          "outputs_match": engine.get("outputs_match"),
          "ttft_speedup_later_turns": engine.get("ttft_speedup_later_turns"),
          "ttft_p50_s": summary.get("ttft_p50_s"), "tokens_per_s": summary.get("tokens_per_s"),
          "bytes_moved": summary.get("bytes_moved"),
          # XLA compiles while serving (0: the figures are steady-state figures)
          "compiles_after_warmup": engine.get("compiles_after_warmup"),
          # bf16 reuse vs recompute, token by token (1.0: every token equal)
          "bf16_match_rate": engine.get("greedy_match_rate") if engine.get("dtype") == "bfloat16"
          else None, "greedy_match_rate": engine.get("greedy_match_rate"),
          "first_divergence": engine.get("first_divergence")}


def report(result: dict) -> str:
  """A few lines for the terminal."""
  v, link = result["verdict"], result["host_link"]
  lines = [f"platform {result['platform']} devices {result['devices']} jax "
           f"{result['jax_version']} install_s {result['install_s']}"]
  for name, s in result["steps"].items():
    lines.append(f"  step {name:8s} rc {s['rc']}  {s.get('wall_s') or 0:7.1f} s"
                 + ("  (timed out)" if s.get("timed_out") else ""))
  for direction in ("device_to_host", "host_to_device"):
    fig = link.get(direction)
    if fig and fig["jaxkv_gb_per_s"] is not None:
      lines.append(f"  {direction}: jaxkv {fig['jaxkv_gb_per_s']:.2f} GB/s, device_put "
                   f"{fig['device_put_gb_per_s']:.2f} GB/s, nominal "
                   f"{link['nominal_gb_per_s']} GB/s")
  lines.append(f"  verdict ({v['kernel']} on {v['platform']}): compiled {v['kernel_compiled']}, "
               f"exact {v['kernel_exact']}, faster {v['kernel_faster']} -> auto_may_switch "
               f"{v['auto_may_switch']}")
  lines += [f"    {r}" for r in v["reasons"]]
  return "\n".join(lines)


# ---- the probe -------------------------------------------------------------------------------
def probe(json_out: str) -> dict:
  """Starts JAX as launch/bench.py does (platform as found) and records the devices."""
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import _common
  _common.check_output(json_out, "json_out")
  _common.start_jax({"platform": None, "host_device_count": 8})  # before jaxkv is imported
  import jax
  devices = jax.devices()
  print(devices)
  out = {**_common.machine_info(), "device_kinds": sorted({d.device_kind for d in devices}),
         "platforms": sorted({d.platform for d in devices}),
         "memory_kinds": sorted({m.kind for m in devices[0].addressable_memories()})}
  _common.write_json(json_out, out)
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = parser.add_subparsers(dest="action", required=True)
  p = sub.add_parser("probe", help="print jax.devices() and write them as JSON")
  p.add_argument("--json_out", required=True)
  m = sub.add_parser("merge", help="merge the steps' records into device_check.json")
  m.add_argument("--out_dir", required=True)
  m.add_argument("--install_s", type=float, default=None)
  m.add_argument("--wall_s", type=float, default=None)
  m.add_argument("--dry_run", action="store_true")
  m.add_argument("--no_install", action="store_true",
                 help="no install step ran (the machine's own Python and JAX)")
  m.add_argument("--config", default=os.path.relpath(os.path.join(
      os.path.dirname(os.path.abspath(__file__)), "..", "configs", "llama3_2_1b_gpu.py")),
                 help="the config whose hardware.host_link_gb_per_s is the nominal rate")
  args = parser.parse_args(argv)
  if args.action == "probe":
    probe(args.json_out)
    return 0
  result = merge(args.out_dir, dry_run=args.dry_run, install_s=args.install_s,
                 config_path=os.path.normpath(args.config), wall_s=args.wall_s,
                 installed=not args.no_install)
  path = os.path.join(args.out_dir, "device_check.json")
  with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=2)  # in the order written: steps in the order they ran
    f.write("\n")
  os.replace(path + ".tmp", path)
  print(report(result))
  print(f"wrote {path}")
  return 1 if result["failed_steps"] else 0


if __name__ == "__main__":
  sys.exit(main())
