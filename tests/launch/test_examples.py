"""The examples in BUILD.md run as written."""

import subprocess
import sys

import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT


def test_own_model_example_runs_and_reuses_its_prefix():
  env = helpers.child_env()
  proc = subprocess.run([sys.executable, "examples/own_model.py"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "reused blocks: 2" in proc.stdout and "devices: 8" in proc.stdout
