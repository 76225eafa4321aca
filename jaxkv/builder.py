"""Build a model, cache and engine from a config mapping (an ``ml_collections``
ConfigDict or a plain dict with the sections of ``configs/cpu_tiny.py``).

Launch scripts and tests use this, so a config file means the same thing everywhere.
It reads no flags: callers pass the config (and overrides) they parsed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from flax import nnx

from jaxkv import models
from jaxkv.cache import KVCache
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig, TierConfig
from jaxkv.engine import Engine
from jaxkv.pages import make_mesh
from jaxkv.errors import InputError

POLICIES = ("jaxkv", "nocache")


def _section(cfg: Mapping, name: str) -> dict:
  if name not in cfg:
    raise InputError(f"config has no '{name}' section; see configs/cpu_tiny.py for the layout.")
  sec = cfg[name]
  return dict(sec.to_dict() if hasattr(sec, "to_dict") else sec)


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim")


def use_model_dir(cfg, model_dir: str) -> None:
  """Points ``cfg`` (a ConfigDict) at a Hugging Face checkpoint directory: the model
  section takes the checkpoint's shapes and name (the directory's), so the cache, the
  workloads' vocabulary and the planner follow it; the config keeps its dtype. A
  sliding-window checkpoint caps the cache's sequence length at its window."""
  hf = models.llama_config(models.hf.read_config(model_dir), dtype=cfg.model.dtype)
  with cfg.unlocked():
    cfg.model.model_dir = model_dir
    cfg.model.name = os.path.basename(os.path.normpath(model_dir))
    for field in _SHAPE_FIELDS:
      setattr(cfg.model, field, getattr(hf, field))
    if hf.sliding_window:
      cfg.cache.max_pages_per_seq = min(cfg.cache.max_pages_per_seq,
                                        hf.sliding_window // cfg.cache.page_size)


def model_config(cfg: Mapping) -> models.LlamaConfig:
  m = _section(cfg, "model")
  m.pop("name", None)
  model_dir = m.pop("model_dir", "")
  if model_dir:
    return models.llama_config(models.hf.read_config(model_dir), dtype=m.get("dtype"))
  return models.LlamaConfig(**m)


def load_model(cfg: Mapping, mesh) -> nnx.Module:
  """The config's model: the checkpoint in ``model.model_dir`` when it names one (weights
  placed on ``mesh``), else random weights from ``cfg.seed``."""
  model_dir = _section(cfg, "model").get("model_dir", "")
  if model_dir:
    return models.from_pretrained(model_dir, dtype=cfg["model"]["dtype"], mesh=mesh)
  return models.Llama(model_config(cfg), rngs=nnx.Rngs(int(cfg.get("seed", 0))))


def share_weights(model: nnx.Module) -> nnx.Module:
  """Another model object over the same weight arrays (no copy), for a second engine:
  each engine takes over its model's KV layers."""
  return nnx.merge(*nnx.split(model))


def make_mesh_for(cfg: Mapping):
  mesh_cfg = _section(cfg, "mesh")
  cache_cfg = cache_config(cfg)
  return make_mesh(data=mesh_cfg["data"], model=mesh_cfg["model"],
                   data_axis=cache_cfg.data_axis, model_axis=cache_cfg.model_axis)


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
  elif isinstance(t["disk_kvstore"], str) and t["disk_kvstore"].lstrip().startswith("{"):
    try:  # a TensorStore kvstore spec given as JSON on the command line
      t["disk_kvstore"] = json.loads(t["disk_kvstore"])
    except json.JSONDecodeError as e:
      raise InputError(f"tiers.disk_kvstore={t['disk_kvstore']!r} is not valid JSON ({e}); give "
                       "a directory or a kvstore spec such as '{\"driver\": \"s3\", "
                       "\"bucket\": \"b\", \"path\": \"kv/\"}'.") from None
  return TierConfig(**t)


def build_engine(cfg: Mapping, *, policy: str = "jaxkv", mesh=None,
                 model: nnx.Module | None = None, deployment_key: bytes | None = None
                 ) -> Engine:
  """A cache and engine over ``model`` (default: ``load_model(cfg, mesh)``: the config's
  checkpoint, or random weights from ``cfg.seed``). A model passed in is taken over by
  this engine; give each engine its own (``share_weights``).

  The ``nocache`` policy gets no lower tiers either: it is the recompute-everything
  baseline. ``deployment_key``: see ``jaxkv.KVCache``.
  """
  if policy not in POLICIES:
    raise InputError(f"policy={policy!r} is not one of {POLICIES}.")
  cache_cfg = cache_config(cfg)
  if mesh is None:
    mesh = make_mesh_for(cfg)
  if model is None:
    model = load_model(cfg, mesh)
  engine_cfg = EngineConfig(**{**_section(cfg, "engine"), "prefix_reuse": policy == "jaxkv"})
  tiers = tier_config(cfg) if policy == "jaxkv" else TierConfig()
  scheduler = SchedulerConfig(**_section(cfg, "scheduler")) if "scheduler" in cfg else None
  return Engine(model, KVCache(cache_cfg, mesh, tiers, deployment_key=deployment_key),
                engine_cfg, scheduler=scheduler)
