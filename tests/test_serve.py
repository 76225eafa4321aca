"""launch/serve.py end to end, as a user runs it (a subprocess, small overrides)."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.workload.users=4", "--config.workload.turns=3",
         "--config.workload.system_prompt_tokens=40", "--config.workload.user_tokens=(8, 30)",
         "--config.workload.max_new_tokens=6", "--config.model.num_layers=2",
         "--config.model.hidden_size=64", "--config.cache.max_pages_per_seq=16"]


def serve(tmp_path, name, *flags):
  out = tmp_path / f"{name}.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the launcher sets it
  proc = subprocess.run([sys.executable, "launch/serve.py", *SMALL, f"--json_out={out}", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text()), proc.stdout


def test_serve_default_and_nocache_give_the_same_output_digest(tmp_path):
  both, stdout = serve(tmp_path, "default")
  alone, _ = serve(tmp_path, "nocache", "--policy=nocache", "--nocompare")
  assert both["policy"] == "jaxkv" and alone["policy"] == "nocache"
  assert both["output_digest"] == alone["output_digest"] == both["baseline"]["output_digest"]
  assert both["outputs_match"] is True
  assert len(both["ttft_s"]) == 4 * 3 and all(t > 0 for t in both["ttft_s"])
  assert both["hits"]["device"] > 0 and alone["hits"]["device"] == 0
  assert both["machine"]["devices"] and len(both["machine"]["devices"]) == 8
  assert both["ttft_speedup_later_turns"] > 0
  assert "TTFT" in stdout and "output_digest" in stdout
