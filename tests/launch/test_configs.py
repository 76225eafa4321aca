"""Every shipped config builds valid jaxkv configs; the planner reads real-model configs.
(The launchers' refusals of bad flags and configs: tests/launch/test_operations.py.)"""

import importlib.util
import json
import os
import sys

import pytest

from jaxkv.tools import builder

import helpers

ROOT = helpers.ROOT
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
  code, stdout, err = helpers.finish_process(helpers.start_process(
      [sys.executable, "launch/plan.py", "--config=configs/llama3_8b_h200.py", "--tokens=32000",
       f"--json_out={out}"]), 300, "plan.py")
  assert code == 0, err[-2000:]
  r = json.loads(out.read_text())
  assert r["kv_bytes"] == 2 * 32 * 8 * 128 * 2 * 32000  # 128 KiB per token
  assert r["t_fetch_s"] == pytest.approx(r["kv_bytes"] / 50e9 + 2e-5, rel=1e-3)
  assert r["t_recompute_s"] == pytest.approx(32 * 0.040, rel=1e-3)
  # The capacity planner's figures: KV per token, what each tier holds, the break-even link.
  assert r["bytes_per_token"] == 128 * 1024
  assert r["tier_tokens"] == {"device": 24576 * 16, "host": 131072 * 16, "disk": (1 << 20) * 16}
  assert r["break_even_link_gb_per_s"] == pytest.approx(
      r["bytes_per_request"] / (r["t_recompute_s"] - 2e-5) / 1e9, rel=1e-6)
  assert "fetching beats recomputing above" in stdout
