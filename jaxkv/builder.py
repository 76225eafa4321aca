"""Build a model, cache and engine from a config mapping (an ``ml_collections``
ConfigDict or a plain dict with the sections of ``configs/cpu_tiny.py``).

Launch scripts and tests use this, so a config file means the same thing everywhere.
It reads no flags: callers pass the config (and overrides) they parsed.
"""

from __future__ import annotations

from collections.abc import Mapping

from flax import nnx

from jaxkv import models
from jaxkv.cache import KVCache
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig, TierConfig
from jaxkv.engine import Engine
from jaxkv.pages import make_mesh

POLICIES = ("jaxkv", "nocache")


def _section(cfg: Mapping, name: str) -> dict:
  if name not in cfg:
    raise ValueError(f"config has no '{name}' section; see configs/cpu_tiny.py for the layout.")
  sec = cfg[name]
  return dict(sec.to_dict() if hasattr(sec, "to_dict") else sec)


def model_config(cfg: Mapping) -> models.LlamaConfig:
  m = _section(cfg, "model")
  m.pop("name", None)
  return models.LlamaConfig(**m)


def cache_config(cfg: Mapping) -> CacheConfig:
  m = _section(cfg, "model")
  c = _section(cfg, "cache")
  return CacheConfig(model_name=m.get("name", "model"), num_layers=m["num_layers"],
                     num_kv_heads=m["num_kv_heads"], head_dim=m["head_dim"], **c)


def tier_config(cfg: Mapping) -> TierConfig:
  if "tiers" not in cfg:
    return TierConfig()
  t = _section(cfg, "tiers")
  if t.get("disk_kvstore") in ("", None):
    t["disk_kvstore"], t["disk_pages"] = None, 0
  return TierConfig(**t)


def build_engine(cfg: Mapping, *, policy: str = "jaxkv", mesh=None) -> Engine:
  """A fresh model (random weights from ``cfg.seed``), cache and engine.

  The ``nocache`` policy gets no lower tiers either: it is the recompute-everything
  baseline.
  """
  if policy not in POLICIES:
    raise ValueError(f"policy={policy!r} is not one of {POLICIES}.")
  mesh_cfg = _section(cfg, "mesh")
  cache_cfg = cache_config(cfg)
  if mesh is None:
    mesh = make_mesh(data=mesh_cfg["data"], model=mesh_cfg["model"],
                     data_axis=cache_cfg.data_axis, model_axis=cache_cfg.model_axis)
  model = models.Llama(model_config(cfg), rngs=nnx.Rngs(int(cfg.get("seed", 0))))
  engine_cfg = EngineConfig(**{**_section(cfg, "engine"), "prefix_reuse": policy == "jaxkv"})
  tiers = tier_config(cfg) if policy == "jaxkv" else TierConfig()
  scheduler = SchedulerConfig(**_section(cfg, "scheduler")) if "scheduler" in cfg else None
  return Engine(model, KVCache(cache_cfg, mesh, tiers), engine_cfg, scheduler=scheduler)
