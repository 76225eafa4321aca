"""Operating the launch scripts: every refusal is one line and exit 2 before any work, a bug
keeps its traceback, metrics parse with prometheus_client (file and live endpoint), logs
and progress show, --restore with nothing to restore starts cold."""

import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--config.workload.chat.users=3", "--config.workload.chat.turns=2",
         "--config.workload.chat.system_prompt_tokens=40",
         "--config.workload.chat.user_tokens=(8, 30)", "--config.workload.chat.max_new_tokens=5",
         "--config.model.num_layers=2", "--config.model.hidden_size=64",
         "--config.cache.max_pages_per_seq=16"]


def clean_env():
  """As a user's shell has it: no JAX_PLATFORMS or XLA_FLAGS inherited from the tests."""
  return {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def launch(script, *args, timeout=600):
  t0 = time.perf_counter()
  proc = subprocess.run([sys.executable, f"launch/{script}", *args], cwd=ROOT, env=clean_env(),
                        capture_output=True, text=True, timeout=timeout)
  return proc, time.perf_counter() - t0


def refusal_cases(tmp):
  a_file = tmp / "a_file"
  a_file.write_text("x")
  short_key = tmp / "short_key"
  short_key.write_text("abcd\n")
  short_key.chmod(0o600)
  a_dir = tmp / "a_dir"
  a_dir.mkdir()
  return [
      ("serve.py", ["--config=configs/llama3_8b_h200.py"], "platform 'gpu'"),
      ("serve.py", ["--config=configs/tpu_v5e_8.py"], "platform 'tpu'"),
      ("serve.py", [f"--json_out={a_dir}"], "is a directory"),
      ("serve.py", [f"--metrics_out={a_dir}"], "is a directory"),
      ("serve.py", [f"--json_out={a_file}/x.json"], "not a writable directory"),
      ("serve.py", [f"--checkpoint_dir={a_file}"], "is a file"),
      ("serve.py", ["--device_pages=-5"], "device_pages"),
      ("serve.py", ["--policy=lru"], "policy"),
      ("serve.py", ["--disk_pages=0"], "disk_pages"),
      ("serve.py", ["--metrics_port=0"], "metrics_port"),
      ("serve.py", ["--restore"], "--restore needs --checkpoint_dir"),
      ("serve.py", [f"--checkpoint_dir={tmp / 'none'}", "--restore", "--require_restore"],
       "no finished checkpoint"),
      ("serve.py", ["--config.cache.page_size=0"], "page_size=0"),
      ("serve.py", ["--config=configs/nope.py"], "nope.py"),
      ("serve.py", [f"--deployment_key_file={tmp / 'no_key'}"], "cannot be read"),
      ("serve.py", [f"--deployment_key_file={a_file}"], "chmod 600"),
      ("serve.py", [f"--deployment_key_file={short_key}"], "has 2 bytes; it needs at least 32"),
      ("server.py", ["--block_address=0.0.0.0:0"], "--allow_insecure"),
      ("server.py", ["--block_address=nowhere"], "must be HOST:PORT"),
      ("plan.py", ["--kv_bytes=1e9", "--tokens=100", "--link_gb_per_s=10",
                   "--prefill_ms_per_1k=-40"], "prefill_ms_per_1k"),
      ("plan.py", ["--config=configs/cpu_tiny.py", "--tokens=100"], "no hardware section"),
      ("plan.py", ["--kv_bytes=1e9", "--link_gb_per_s=10", "--prefill_ms_per_1k=40"],
       "--tokens"),
      ("generate.py", ["--prompt=hi"], "model_dir"),
      ("generate.py", [f"--model_dir={a_dir}", "--prompt=hi"], "config.json is missing"),
      ("generate.py", [f"--model_dir={a_dir}", "--prompt=hi", "--platform=gpu"],
       "platform 'gpu'"),
      ("bench.py", ["--suite=nope"], "suite"),
      ("bench.py", [f"--json_out={a_dir}"], "is a directory"),
  ]


def test_every_refusal_is_one_line_exit_2_before_any_work(tmp_path):
  cases = refusal_cases(tmp_path)
  before = sorted(os.listdir(tmp_path))
  for script, args, needle in cases:
    proc, seconds = launch(script, *args)
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    where = f"{script} {' '.join(args)}: {proc.stderr[-1500:]}"
    assert proc.returncode == 2, where
    assert "Traceback" not in proc.stderr and len(lines) == 1, where
    assert lines[0].startswith("error: ") and needle in lines[0], where
    assert seconds < 60, where  # JAX's import at most: nothing is built or compiled
  assert sorted(os.listdir(tmp_path)) == before  # nothing written, no .tmp left


BUGGY = """
import sys
sys.path.insert(0, "launch")
import _common
def main(argv):
  raise ValueError("an internal invariant broke")
_common.run(main)
"""


def test_an_internal_error_keeps_its_traceback_and_exits_1():
  proc = subprocess.run([sys.executable, "-c", BUGGY], cwd=ROOT, env=clean_env(),
                        capture_output=True, text=True, timeout=120)
  assert proc.returncode == 1
  assert "Traceback" in proc.stderr and "an internal invariant broke" in proc.stderr
  assert "error: an internal" not in proc.stderr


def families(text):
  return {f.name: f for f in text_string_to_metric_families(text)}


def check_families(fams, *, policies):
  for name in ("jaxkv_ttft_seconds", "jaxkv_time_per_output_token_seconds",
               "jaxkv_e2e_latency_seconds"):
    assert fams[name].type == "histogram", name
  for name in ("jaxkv_block_hits", "jaxkv_requests", "jaxkv_blocks_fetched",
               "jaxkv_blocks_recomputed", "jaxkv_blocks_split", "jaxkv_bytes_moved",
               "jaxkv_verify_failures", "jaxkv_evictions"):
    assert fams[name].type == "counter", name
  for name in ("jaxkv_cached_blocks", "jaxkv_capacity_blocks", "jaxkv_waiting_requests",
               "jaxkv_running_requests"):
    assert fams[name].type == "gauge", name
  assert {s.labels["policy"] for s in fams["jaxkv_requests"].samples} == set(policies)


def value(fams, family, sample, **labels):
  return next(s.value for s in fams[family].samples
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_file_logs_progress_and_a_cold_start_without_checkpoint(tmp_path):
  prom, out, ckpt = tmp_path / "m.prom", tmp_path / "s.json", tmp_path / "ckpt"
  proc, _ = launch("serve.py", *SMALL, f"--metrics_out={prom}", f"--json_out={out}",
                   f"--checkpoint_dir={ckpt}", "--restore", f"--disk_dir={tmp_path / 'disk'}",
                   "--config.tiers.disk_pages=100",
                   '--config.name=quote"and\\backslash')  # label values are escaped
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  fams = families(prom.read_text())
  check_families(fams, policies=("jaxkv", "nocache"))
  stats = r["stats"]
  jaxkv = dict(policy="jaxkv", config='quote"and\\backslash')
  assert value(fams, "jaxkv_requests", "jaxkv_requests_total", **jaxkv) == stats["requests"] == 6
  assert value(fams, "jaxkv_ttft_seconds", "jaxkv_ttft_seconds_count", **jaxkv) == 6
  assert value(fams, "jaxkv_ttft_seconds", "jaxkv_ttft_seconds_sum", **jaxkv) == pytest.approx(
      sum(stats["ttft_s"]))
  assert value(fams, "jaxkv_e2e_latency_seconds", "jaxkv_e2e_latency_seconds_count",
               **jaxkv) == 6
  assert value(fams, "jaxkv_block_hits", "jaxkv_block_hits_total", tier="device",
               **jaxkv) == stats["hits"]["device"] > 0
  # --config.tiers.disk_pages is kept with --disk_dir (it used to be replaced by 4096).
  assert value(fams, "jaxkv_capacity_blocks", "jaxkv_capacity_blocks", tier="disk",
               **jaxkv) == 100
  assert value(fams, "jaxkv_cached_blocks", "jaxkv_cached_blocks", tier="device",
               **jaxkv) == r["tier_occupancy_blocks"][-1]["device"]
  assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
  # Logs: start-up, adopted disk records, compile progress; the missing checkpoint warned.
  err = proc.stderr
  assert "KVCache" in err and "disk tier" in err and "adopted 0 blocks" in err
  assert "compiling prefill and decode steps: 1/" in err
  assert "no finished checkpoint" in err and "starting cold" in err
  assert "saved the cache as step 0" in proc.stdout
  # Started again, it restores what the first run saved.
  proc, _ = launch("serve.py", *SMALL, f"--checkpoint_dir={ckpt}", "--restore",
                   "--require_restore", f"--disk_dir={tmp_path / 'disk'}",
                   "--config.tiers.disk_pages=100", "--nocompare")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "restored step 0" in proc.stdout


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_metrics_are_served_live_during_a_run(tmp_path):
  port = free_port()
  proc = subprocess.Popen(
      [sys.executable, "launch/serve.py", *SMALL, "--config.workload.chat.turns=3",
       f"--metrics_port={port}", "--nocompare"],
      cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  scraped = []
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
          scraped.append(resp.read().decode())
      except (OSError, http.client.HTTPException):  # not up yet, or cut short by the exit
        pass
      time.sleep(0.5)
  finally:
    _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  # Complete answers (one racing the process's exit may come back cut short).
  complete = [t for t in scraped if "jaxkv_running_requests" in t]
  assert complete, f"no complete answer among {len(scraped)} scrapes during the run"
  fams = families(complete[-1])
  check_families(fams, policies=("jaxkv",))
  capacity = value(fams, "jaxkv_capacity_blocks", "jaxkv_capacity_blocks", tier="device",
                   policy="jaxkv")
  assert capacity == 4 * 256  # 4 data shards x pages_per_shard
