"""launch/plan.py: the capacity planner as a user runs it."""

import json
import subprocess
import sys

import pytest

import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT


def run_plan(tmp_path, *flags):
  out = tmp_path / "plan.json"
  proc = subprocess.run([sys.executable, "launch/plan.py", f"--json_out={out}", *flags],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  return proc, (json.loads(out.read_text()) if out.exists() else None)


def test_design_brief_example(tmp_path):
  proc, r = run_plan(tmp_path, "--kv_bytes=10e9", "--tokens=20000", "--link_gb_per_s=64",
                     "--prefill_ms_per_1k=40")
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert r["t_fetch_s"] == pytest.approx(10e9 / 64e9, rel=1e-4)
  assert r["t_recompute_s"] == pytest.approx(0.8, rel=1e-4)
  tf, tr = r["t_fetch_s"], r["t_recompute_s"]
  assert r["t_split_s"] == pytest.approx(tf * tr / (tf + tr), rel=2e-3)
  assert r["decision"] == "split" and 0 < r["split_tokens"] < 20000
  assert "fetch all" in proc.stdout


def test_model_shape_and_shared_link(tmp_path):
  # 32 layers x 8 kv heads x 128 x bf16 = 128 KiB per token; 4 requests share 25 GB/s.
  proc, r = run_plan(tmp_path, "--layers=32", "--kv_heads=8", "--head_dim=128",
                     "--tokens=32000", "--requests=4", "--link_gb_per_s=25",
                     "--prefill_ms_per_1k=20")
  assert proc.returncode == 0, proc.stderr[-2000:]
  per_request_bytes = 2 * 32 * 8 * 128 * 2 * 8000
  assert r["bytes_per_request"] == pytest.approx(per_request_bytes)
  assert r["t_fetch_s"] == pytest.approx(per_request_bytes / (25e9 / 4), rel=1e-3)


def test_slow_link_means_recompute_and_bad_flags_say_what_to_fix(tmp_path):
  proc, r = run_plan(tmp_path, "--kv_bytes=10e9", "--tokens=2000", "--link_gb_per_s=0.1",
                     "--prefill_ms_per_1k=1", "--link_latency_ms=5")
  assert proc.returncode == 0 and r["decision"] in ("recompute", "split")
  assert r["t_split_s"] <= r["t_recompute_s"] * (1 + 1e-6)  # the plan computes in float32
  proc, _ = run_plan(tmp_path, "--kv_bytes=1e9", "--tokens=100", "--link_gb_per_s=1")
  assert proc.returncode != 0 and "--prefill_ms_per_1k" in proc.stderr
  assert "Traceback" not in proc.stderr
