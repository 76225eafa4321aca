"""Every shipped config builds valid jaxkv configs; the planner reads real-model configs."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from jaxkv import builder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".py"))


def load(name):
  spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(ROOT, "configs", name))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod.get_config()


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_valid_jaxkv_configs(name):
  cfg = load(name)
  assert cfg.name == name[:-3]
  mc = builder.model_config(cfg)
  cc = builder.cache_config(cfg)
  tiers = builder.tier_config(cfg)
  assert cc.num_kv_heads % cfg.mesh.model == 0
  assert cc.num_layers == mc.num_layers and cc.head_dim == mc.head_dim
  assert tiers.host_pages_per_shard >= 0


def test_planner_sizes_a_real_model_from_its_config(tmp_path):
  out = tmp_path / "p.json"
  proc = subprocess.run([sys.executable, "launch/plan.py", "--config=configs/llama3_8b_h200.py",
                         "--tokens=32000", f"--json_out={out}"], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  r = json.loads(out.read_text())
  assert r["kv_bytes"] == 2 * 32 * 8 * 128 * 2 * 32000  # 128 KiB per token
  assert r["t_fetch_s"] == pytest.approx(r["kv_bytes"] / 50e9 + 2e-5, rel=1e-3)
  assert r["t_recompute_s"] == pytest.approx(32 * 0.040, rel=1e-3)
  # The capacity planner's figures: KV per token, what each tier holds, the break-even link.
  assert r["bytes_per_token"] == 128 * 1024
  assert r["tier_tokens"] == {"device": 24576 * 16, "host": 131072 * 16, "disk": (1 << 20) * 16}
  assert r["break_even_link_gb_per_s"] == pytest.approx(
      r["bytes_per_request"] / (r["t_recompute_s"] - 2e-5) / 1e9, rel=1e-6)
  assert "fetching beats recomputing above" in proc.stdout


def test_serve_refuses_a_gpu_config_on_cpu_in_one_line():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "launch/serve.py", "--config=configs/llama3_8b_h200.py"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  err = [l for l in proc.stderr.splitlines() if l.strip()]
  assert len(err) == 1 and "platform 'gpu'" in err[0] and "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags,needle", [
    (["--config=configs/nope.py"], "nope.py"),
    (["--device_pages=-4"], "device_pages"),
    (["--disk_dir=/proc/jaxkv-nope", "--config.workload.chat.turns=1"], "cannot be created"),
    (["--config.cache.page_size=0"], "page_size=0"),
])
def test_bad_flags_give_one_clear_line(flags, needle):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "launch/serve.py", "--nocompare", *flags], cwd=ROOT,
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0
  assert "Traceback" not in proc.stderr
  lines = [l for l in proc.stderr.splitlines() if l.strip() and not l.startswith(("W", "I"))]
  assert any(needle in l for l in lines), proc.stderr[-1500:]
  assert len(lines) <= 2  # the error (and absl's one-line hint for flag syntax errors)
