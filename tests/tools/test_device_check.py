"""launch/device_check.sh: its dry run (no install, --quick steps on CPU) writes the one JSON
a GPU run writes, every step recorded; the verdict that keeps `auto` on jnp, judged from
hand-made step results; a failing step is recorded and the next one runs."""

import json
import math
import os
import subprocess
import sys

import pytest

import helpers

ROOT = helpers.ROOT
sys.path.insert(0, os.path.join(ROOT, "launch"))
import device_check  # noqa: E402  (launch/ is not a package)

STEPS = ("devices", "kernels", "tiers", "engine")


def _run_dry(out, timeout_s, **env_extra):
  """``bash launch/device_check.sh --dry_run`` with OUT=``out``: (exit status, output). Its
  whole session is killed if it outlives ``timeout_s``."""
  env = helpers.child_env()  # launchers set their own
  env.update(OUT=str(out), **env_extra)
  proc = subprocess.Popen(["bash", "launch/device_check.sh", "--dry_run"], cwd=ROOT, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    stdout, _ = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    helpers.kill_session(proc.pid)
    stdout, _ = proc.communicate()
    pytest.fail(f"the dry run ran over {timeout_s} s; its output ends:\n{stdout[-3000:]}")
  return proc.returncode, stdout


@pytest.fixture(scope="module")
def dry_run(device_check_dry_run):
  """``bash launch/device_check.sh --dry_run`` as CI runs it: (exit status, stdout, its JSON);
  run once a session (conftest), test_bench reads its bench figures too."""
  return device_check_dry_run[:3]


def test_dry_run_passes_and_records_every_step(dry_run):
  rc, stdout, r = dry_run
  assert rc == 0, stdout[-4000:]
  assert r is not None, stdout[-4000:]
  assert r["dry_run"] is True and r["install_s"] is None
  assert r["platform"] == "cpu" and r["jax_version"] and len(r["devices"]) == 8
  assert list(r["steps"]) == list(STEPS) and r["failed_steps"] == []
  for name, step in r["steps"].items():
    assert step["rc"] == 0 and not step["timed_out"], (name, step)
    assert step["wall_s"] > 0 and step["timeout_s"] > 0, (name, step)
    assert isinstance(step["result"], dict), name
  assert "launch/bench.py --suite=kernels --quick" in r["steps"]["kernels"]["command"]
  assert "launch/serve.py" in r["steps"]["engine"]["command"]
  assert "auto_may_switch False" in stdout  # the printed summary


def test_each_step_json_holds_what_the_step_promises(dry_run):
  _, stdout, r = dry_run
  assert r is not None, stdout[-4000:]
  res = {name: step["result"] for name, step in r["steps"].items()}
  assert {"backend", "devices", "device_kinds", "jax", "jaxkv"} <= set(res["devices"])
  assert res["devices"]["devices"] == r["devices"]
  kernels = res["kernels"]
  for step in ("decode", "prefill"):
    for impl in ("jnp", "pallas_gpu"):
      fig = kernels[f"{step}_{impl}"]
      assert fig["tokens_per_s"] > 0 and fig["interpreted"] == (impl != "jnp")
      assert f"{step}_{impl}_max_abs_error" in kernels
  host = res["tiers"]["host"]
  for name in ("jaxkv_device_to_host", "jaxkv_host_to_device", "device_put_to_host",
               "device_put_to_device"):
    assert host[name]["gb_per_s"] > 0, name
  engine = res["engine"]
  for key in ("config", "ttft_s", "hits", "stats", "summary", "output_digest"):
    assert key in engine, key
  assert engine["config"] == "cpu_tiny"  # the embedded default on a dry run
  assert engine["stats"]["demoted_host"] > 0  # the host tier was on and took blocks
  assert engine["outputs_match"] is True  # reuse (device and host) answered as recompute did
  assert r["engine"]["greedy_match_rate"] == 1.0 and r["engine"]["bf16_match_rate"] is None
  assert r["engine"]["compiles_after_warmup"] == 0
  sweep = r["host_link"]  # the tier sweep's figures reach the device JSON
  assert set(sweep["by_size"]) == {"1mib", "4mib"} and len(sweep["pool_store_ms"]) == 2
  assert sweep["hlo"]["place"]["host-execute"] == 0
  assert r["engine"]["hits"] == engine["hits"]
  for name in ("devices", "kernels", "tiers", "engine"):
    assert set(device_check.STEP_KEYS[name]) <= set(res[name]), name


def test_host_link_is_reported_beside_device_put_and_the_nominal_rate(dry_run):
  _, stdout, r = dry_run
  assert r is not None, stdout[-4000:]
  link, host = r["host_link"], r["steps"]["tiers"]["result"]["host"]
  assert link["nominal_gb_per_s"] == 50.0  # configs/llama3_2_1b_gpu.py's hardware section
  assert link["bytes_per_move"] == r["steps"]["tiers"]["result"]["bytes"]["host_moves"]
  for direction in ("device_to_host", "host_to_device"):
    fig = link[direction]
    assert fig["jaxkv_gb_per_s"] == host[f"jaxkv_{direction}"]["gb_per_s"]
    bare = "device_put_to_" + direction.split("_")[-1]  # device_put_to_host / _to_device
    assert fig["device_put_gb_per_s"] == host[bare]["gb_per_s"]
    assert math.isclose(fig["jaxkv_vs_nominal"], fig["jaxkv_gb_per_s"] / 50.0)
    assert math.isclose(fig["jaxkv_vs_device_put"],
                        fig["jaxkv_gb_per_s"] / fig["device_put_gb_per_s"])


def test_on_cpu_the_kernel_ran_interpreted_and_auto_may_not_switch(dry_run):
  _, stdout, r = dry_run
  assert r is not None, stdout[-4000:]
  v = r["verdict"]
  assert v["platform"] == "cpu" and v["kernel"] == "pallas_gpu"
  assert v["kernel_compiled"] is False and v["auto_may_switch"] is False
  assert any("interpreter" in reason for reason in v["reasons"])
  assert v["kernel_exact"] is True  # the interpreted kernel still computes attention


FAKE_PYTHON = """#!/usr/bin/env bash
# The steps of a dry run, faked: the probe and the engine write their JSON, the kernels
# suite fails, the tiers suite hangs with a child of its own; merging runs for real.
for a in "$@"; do case $a in --json_out=*) json=${a#--json_out=} ;; esac; done
case "$*" in
  *"device_check.py probe"*)
    echo '{"backend": "cpu", "devices": ["cpu:0"], "device_kinds": ["cpu"], "jax": "0", "jaxkv": "0"}' > "$json" ;;
  *suite=kernels*) echo "Traceback: the kernel did not lower" >&2; exit 3 ;;
  *suite=tiers*) sleep 300 & echo $! > "$OUT/sleeper.pid"; wait ;;
  *serve.py*) echo '{"config": "fake", "hits": {"host": 1}}' > "$json" ;;
  *) exec PYTHON "$@" ;;
esac
"""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
  except OSError:
    return False


def test_a_failing_or_hanging_step_is_recorded_and_the_next_one_runs(tmp_path):
  fake = tmp_path / "python"
  fake.write_text(FAKE_PYTHON.replace("PYTHON", sys.executable, 1))
  fake.chmod(0o755)
  out = tmp_path / "out"
  code, stdout = _run_dry(out, 300, PYTHON=str(fake), STEP_LIMIT_S="5")
  assert code == 1, stdout[-3000:]
  r = json.loads((out / "device_check.json").read_text())
  assert r["failed_steps"] == ["kernels", "tiers"], stdout[-3000:]
  kernels, tiers, engine = (r["steps"][n] for n in ("kernels", "tiers", "engine"))
  assert kernels["rc"] == 3 and "the kernel did not lower" in kernels["stderr_tail"]
  assert tiers["timed_out"] is True and tiers["result"] is None and tiers["timeout_s"] == 5
  assert not _alive(int((out / "sleeper.pid").read_text()))  # the step's whole group went
  assert engine["rc"] == 0 and engine["result"] == {"config": "fake", "hits": {"host": 1}}
  assert r["verdict"]["auto_may_switch"] is False and "missing" in r["host_link"]


# ---- the verdict, from hand-made step results ------------------------------------------------
def kernels_json(*, backend="gpu", kernel="pallas_gpu", interpreted=False, error=1e-3,
                 kernel_tps=(2000.0, 90000.0), jnp_tps=(1000.0, 60000.0), dtype="bfloat16",
                 drop=()):
  """What ``jaxkv.tools.bench.kernels.run`` writes, with the figures the verdict reads."""
  r = {"backend": backend, "shapes": {"dtype": dtype}}
  for step, ours, theirs in zip(("decode", "prefill"), kernel_tps, jnp_tps):
    r[f"{step}_jnp"] = {"tokens_per_s": theirs, "interpreted": False}
    r[f"{step}_jnp_max_abs_error"] = 0.0
    r[f"{step}_{kernel}"] = {"tokens_per_s": ours, "interpreted": interpreted}
    r[f"{step}_{kernel}_max_abs_error"] = error
  for key in drop:
    del r[key]
  return r


def test_compiled_exact_and_faster_lets_auto_switch():
  v = device_check.verdict(kernels_json())
  assert (v["kernel_compiled"], v["kernel_exact"], v["kernel_faster"]) == (True, True, True)
  assert v["auto_may_switch"] is True and v["reasons"] == []
  assert v["kernel"] == "pallas_gpu" and v["tolerance"] == device_check.TOLERANCE["bfloat16"]
  assert v["steps"]["decode"]["vs_jnp"] == 2.0
  tpu = device_check.verdict(kernels_json(backend="tpu", kernel="pallas_tpu"))
  assert tpu["kernel"] == "pallas_tpu" and tpu["auto_may_switch"] is True


@pytest.mark.parametrize("change,failed", [
    (dict(interpreted=True), "kernel_compiled"),
    (dict(error=0.5), "kernel_exact"),
    (dict(error=float("nan")), "kernel_exact"),
    (dict(error=1e-3, dtype="float32"), "kernel_exact"),  # a float32 run is held to 1e-4
    (dict(kernel_tps=(900.0, 90000.0)), "kernel_faster"),  # decode slower
    (dict(kernel_tps=(2000.0, 60000.0)), "kernel_faster"),  # prefill only as fast
])
def test_any_test_failing_keeps_auto_on_jnp(change, failed):
  v = device_check.verdict(kernels_json(**change))
  assert v[failed] is False and v["auto_may_switch"] is False
  assert sum(v[k] for k in ("kernel_compiled", "kernel_exact", "kernel_faster")) == 2
  assert v["reasons"]


@pytest.mark.parametrize("kernels", [
    None,  # the kernels step failed: no JSON
    {},
    kernels_json(drop=("prefill_pallas_gpu",)),  # a row missing
    kernels_json(drop=("decode_pallas_gpu_max_abs_error",)),
    kernels_json(drop=("decode_jnp",)),  # nothing to be faster than
    kernels_json(kernel="pallas_tpu"),  # a GPU run without the GPU kernel's rows
])
def test_anything_missing_keeps_auto_on_jnp(kernels):
  v = device_check.verdict(kernels)
  assert v["auto_may_switch"] is False and v["reasons"]


# ---- merging ---------------------------------------------------------------------------------
def write_step(steps_dir, name, rc, result=None, stderr=""):
  (steps_dir / f"{name}.meta").write_text(f"{rc}\n1.5\n30\npython launch/x.py --flag\n")
  (steps_dir / f"{name}.stderr").write_text(stderr)
  (steps_dir / f"{name}.stdout").write_text("")
  if result is not None:
    (steps_dir / f"{name}.json").write_text(json.dumps(result))


def test_a_failed_step_is_recorded_with_its_stderr_and_its_json_is_not_trusted(tmp_path):
  steps_dir = tmp_path / "steps"
  steps_dir.mkdir()
  write_step(steps_dir, "install", 0)
  write_step(steps_dir, "devices", 0, {"backend": "gpu", "devices": ["cuda:0"],
                                       "device_kinds": ["NVIDIA H200"], "jax": "0.10.2",
                                       "jaxkv": "0.1.0"})
  # A kernels JSON left over with a non-zero exit (it crashed after writing): not trusted.
  write_step(steps_dir, "kernels", 1, kernels_json(),
             stderr="".join(f"line {i}\n" for i in range(100)) + "TritonError: boom\n")
  write_step(steps_dir, "tiers", 124, stderr="")  # timed out, wrote nothing
  # engine never ran
  config = os.path.join(ROOT, "configs", "llama3_2_1b_gpu.py")
  r = device_check.merge(str(tmp_path), dry_run=False, install_s=42.0, config_path=config)
  assert r["platform"] == "gpu" and r["devices"] == ["cuda:0"] and r["install_s"] == 42.0
  assert list(r["steps"]) == ["install", "devices", "kernels", "tiers", "engine"]
  assert r["failed_steps"] == ["kernels", "tiers", "engine"]
  kernels = r["steps"]["kernels"]
  assert kernels["rc"] == 1 and kernels["command"] == "python launch/x.py --flag"
  assert kernels["stderr_tail"].endswith("TritonError: boom")
  assert len(kernels["stderr_tail"].splitlines()) == device_check.STDERR_TAIL_LINES
  assert r["steps"]["tiers"]["timed_out"] is True and r["steps"]["tiers"]["result"] is None
  assert r["steps"]["engine"]["rc"] is None
  assert "stderr_tail" not in r["steps"]["devices"]
  assert r["verdict"]["auto_may_switch"] is False and r["verdict"]["kernel"] == "pallas_gpu"
  assert r["host_link"]["nominal_gb_per_s"] == 50.0 and "missing" in r["host_link"]
  assert r["engine"] is None


def test_merge_writes_one_json_and_exits_1_when_a_step_failed(tmp_path):
  steps_dir = tmp_path / "steps"
  steps_dir.mkdir()
  for name in STEPS:
    write_step(steps_dir, name, 0 if name != "engine" else 2, {"machine": {"backend": "cpu"}})
  proc = subprocess.run([sys.executable, "launch/device_check.py", "merge",
                         f"--out_dir={tmp_path}", "--dry_run"], cwd=ROOT, capture_output=True,
                        text=True, timeout=120)
  assert proc.returncode == 1, proc.stderr
  r = json.loads((tmp_path / "device_check.json").read_text())
  assert r["failed_steps"] == ["engine"] and r["platform"] == "cpu"
  assert r["config"] == "configs/llama3_2_1b_gpu.py"
