"""launch/serve.py end to end, as a user runs it (a subprocess, small overrides)."""

import json
import re
import subprocess
import sys

import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT
SMALL = ["--config.workload.chat.users=4", "--config.workload.chat.turns=3",
         "--config.workload.chat.system_prompt_tokens=40", "--config.workload.chat.user_tokens=(8, 30)",
         "--config.workload.chat.max_new_tokens=6", *helpers.SERVE_SHAPES]


def serve(tmp_path, name, *flags):
  out = tmp_path / f"{name}.json"
  env = helpers.child_env()  # the launcher sets it
  proc = subprocess.run([sys.executable, "launch/serve.py", *SMALL, f"--json_out={out}", *flags],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  serve.stderr = proc.stderr
  return json.loads(out.read_text()), proc.stdout


def test_serve_default_and_nocache_give_the_same_output_digest(tmp_path):
  both, stdout = serve(tmp_path, "default")
  alone, _ = serve(tmp_path, "nocache", "--cache=nocache", "--nocompare")
  assert both["cache"] == both["policy"] == "jaxkv"  # "policy": the key's former name, kept
  assert alone["cache"] == alone["policy"] == "nocache" and "baseline" not in alone
  assert both["baseline"]["cache"] == both["baseline"]["policy"] == "nocache"
  assert both["output_digest"] == alone["output_digest"] == both["baseline"]["output_digest"]
  assert both["outputs_match"] is True
  assert both["greedy_match_rate"] == 1.0 and both["first_divergence"] == [None] * 12
  assert both["compiles_after_warmup"] == 0, both["compiled_after_warmup"]
  assert len(both["ttft_s"]) == 4 * 3 and all(t > 0 for t in both["ttft_s"])
  assert both["hits"]["device"] > 0 and alone["hits"]["device"] == 0
  assert both["machine"]["devices"] and len(both["machine"]["devices"]) == 8
  assert both["ttft_speedup_later_turns"] > 0
  assert "TTFT" in stdout and "output_digest" in stdout
  # Online: users arrive over time; the answers (greedy) are those of the run in rounds.
  live, stdout = serve(tmp_path, "online", "--request_rate=40", "--think_time_s=0.01")
  assert live["output_digest"] == both["output_digest"] and live["outputs_match"] is True
  assert live["online"] == {"request_rate": 40.0, "think_time_s": 0.01, "arrivals": "poisson"}
  for cache in ("jaxkv", "nocache"):
    fig = live["summary"][cache]
    assert fig["requests"] == 12 and 0 < fig["ttft_p50_s"] <= fig["ttft_p99_s"]
    assert fig["tpot_p50_s"] > 0 and fig["e2e_p90_s"] >= fig["ttft_p90_s"]
  assert len(live["ttft_s_by_turn"]) == 3 and "TPOT p50 (ms)" in stdout


def test_serve_plot_metrics_and_other_workloads(tmp_path):
  import matplotlib.image as mpimg
  import numpy as np
  png, prom = tmp_path / "serve.png", tmp_path / "metrics.prom"
  trace = tmp_path / "trace.jsonl"
  lines = [json.dumps({"round": r, "prompt": list(range(1 + r, 40 + 5 * u)), "max_new_tokens": 4})
           for r in range(2) for u in range(3)]
  trace.write_text("\n".join(lines) + "\n")
  result, stdout = serve(tmp_path, "trace", f"--trace={trace}", f"--plot={png}",
                         f"--metrics_out={prom}")
  assert result["outputs_match"] is True and len(result["ttft_s"]) == 6
  assert result["tier_occupancy_blocks"][-1]["device"] > 0
  img = mpimg.imread(str(png))
  assert img.shape[0] > 300 and img.shape[1] > 800  # two panels side by side
  rgb = (img[..., :3] * 255).astype(int).reshape(-1, 3)
  blue = np.abs(rgb - np.array([31, 119, 180])).sum(axis=1) < 30  # the first series' colour
  orange = np.abs(rgb - np.array([255, 127, 14])).sum(axis=1) < 30
  assert blue.sum() > 200 and orange.sum() > 200  # both caches are drawn
  from prometheus_client.parser import text_string_to_metric_families
  fams = {f.name: f for f in text_string_to_metric_families(prom.read_text())}
  hits = {(s.labels["policy"], s.labels["tier"]): s.value
          for s in fams["jaxkv_block_hits"].samples if s.labels["config"] == "cpu_tiny"}
  assert hits["jaxkv", "device"] == result["hits"]["device"]
  assert hits["nocache", "device"] == 0
  count = [s.value for s in fams["jaxkv_ttft_seconds"].samples
           if s.name == "jaxkv_ttft_seconds_count" and s.labels["policy"] == "jaxkv"]
  assert count == [6] and fams["jaxkv_requests"].type == "counter"
  rag, _ = serve(tmp_path, "rag", "--config.workload.kind=rag", "--config.workload.rag.rounds=2",
                 "--config.workload.rag.doc_tokens=48", "--nocompare", "--verbosity=1")
  assert rag["hits"]["device"] > 0  # the system prompt and same-order documents
  # --verbosity=1: one line per step, printed from the step's plan.
  lines = [l for l in serve.stderr.splitlines() if re.search(r"\] step \d+: rows decode", l)]
  assert len(lines) >= rag["stats"]["steps"] > 0
  assert any("admitted [0" in l for l in lines) and any("first tokens [" in l for l in lines)
  agent, _ = serve(tmp_path, "agent", "--config.workload.kind=agent",
                   "--config.workload.agent.steps=3", "--config.workload.agent.tool_tokens=(16, 40)",
                   "--config.workload.agent.system_prompt_tokens=48",
                   "--nocompare")
  assert agent["hits"]["device"] > agent["stats"]["prompt_tokens"] / 16 / 3


def test_bad_trace_file_is_one_line(tmp_path):
  env = helpers.child_env()
  proc = subprocess.run([sys.executable, "launch/serve.py", f"--trace={tmp_path / 'no.jsonl'}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "trace file" in proc.stderr and "Traceback" not in proc.stderr
