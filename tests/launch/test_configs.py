"""Every shipped config builds valid jaxkv configs; the planner reads real-model configs.
(The launchers' refusals of bad flags and configs: tests/launch/test_operations.py.)"""

import dataclasses
import importlib.util
import json
import logging
import os
import sys

import pytest
from flax import nnx

import jaxkv
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


@pytest.mark.parametrize("name", CONFIGS)
def test_the_cache_takes_the_models_shapes(name):
  """builder.cache_config is CacheConfig.for_model of the model section with the cache
  section's budgets: the CacheConfig it built before, when the shapes were copied by hand."""
  cfg = load(name)
  m, c = cfg.model, cfg.cache.to_dict()
  by_hand = jaxkv.CacheConfig(model_name=m.name, num_layers=m.num_layers,
                              num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, **c)
  assert builder.cache_config(cfg) == by_hand
  assert jaxkv.CacheConfig.for_model(builder.model_config(cfg), model_name=m.name,
                                     **c) == by_hand


def test_a_model_config_or_model_gives_the_shapes_and_dtype():
  mc = builder.model_config(load("cpu_tiny.py"))
  from_config = jaxkv.CacheConfig.for_model(mc, pages_per_shard=32, max_pages_per_seq=8)
  assert (from_config.num_layers, from_config.num_kv_heads, from_config.head_dim) == (4, 2, 32)
  assert from_config.model_name == "Llama" and from_config.pages_per_shard == 32
  bf16 = dataclasses.replace(mc, dtype="bfloat16")
  model = jaxkv.models.Llama(bf16, rngs=nnx.Rngs(0))  # its cfg is read
  assert jaxkv.CacheConfig.for_model(model) == jaxkv.CacheConfig.for_model(bf16)
  assert jaxkv.CacheConfig.for_model(bf16).dtype == "bfloat16"
  assert jaxkv.CacheConfig.for_model(bf16, dtype="float32").dtype == "float32"


def test_a_sequences_cap_and_a_disk_tiers_capacity_fit_whichever_flag_set_them(caplog,
                                                                           monkeypatch):
  """What --device_pages and --disk_dir did besides setting their field is the builder's
  rule over the config's values (logged at INFO), so --config.* gives the same."""
  monkeypatch.setattr(builder, "_FITS_LOGGED", set())
  caplog.set_level(logging.INFO)
  cfg = load("cpu_tiny.py")
  with cfg.unlocked():
    cfg.cache.pages_per_shard = 40  # the config's max_pages_per_seq is 64
    cfg.tiers.disk_kvstore = "/tmp/jaxkv-unused"  # no disk_pages
  cache, tiers = builder.cache_config(cfg), builder.tier_config(cfg)
  assert (cache.pages_per_shard, cache.max_pages_per_seq) == (40, 40)
  assert (tiers.disk_kvstore, tiers.disk_pages) == ("/tmp/jaxkv-unused", 4096)
  assert "cache.max_pages_per_seq 64 -> 40" in caplog.text
  assert "tiers.disk_pages 4096" in caplog.text
  assert cfg.cache.max_pages_per_seq == 64 and cfg.tiers.disk_pages == 0  # read, not changed
  with cfg.unlocked():  # a cap within the pool and a capacity given stay as they are
    cfg.cache.max_pages_per_seq, cfg.tiers.disk_pages = 16, 100
  assert builder.cache_config(cfg).max_pages_per_seq == 16
  assert builder.tier_config(cfg).disk_pages == 100
  with cfg.unlocked():
    cfg.tiers.disk_kvstore = ""  # no disk tier, whatever its capacity says
  assert builder.tier_config(cfg).disk_pages == 0
  with cfg.unlocked():  # a kvstore spec given as JSON, with no capacity: parsed, and 4096
    cfg.tiers.disk_kvstore, cfg.tiers.disk_pages = '{"driver": "memory"}', 0
  tiers = builder.tier_config(cfg)
  assert (tiers.disk_kvstore, tiers.disk_pages) == ({"driver": "memory"}, 4096)


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
