"""Build a model, cache and engine from a config mapping (an ``ml_collections``
ConfigDict or a plain dict with the sections of ``configs/cpu_tiny.py``).

Launch scripts and tests use this, so a config file means the same thing everywhere.
It reads no flags: callers pass the config (and overrides) they parsed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping

import jax
from absl import logging
from flax import nnx

from jaxkv import models
from jaxkv.cache import KVCache
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig, StreamConfig, TierConfig
from jaxkv.serving.engine import Engine
from jaxkv.worker.pages import make_mesh
from jaxkv.errors import InputError

# What ``build_engine(cache=)`` (and launch/serve.py ``--cache``) builds: ``jaxkv`` reuses
# cached prefixes through its tiers, ``nocache`` recomputes everything (the baseline).
CACHES = ("jaxkv", "nocache")
POLICIES = CACHES  # its former name


def _section(cfg: Mapping, name: str) -> dict:
  if name not in cfg:
    raise InputError(f"config has no '{name}' section; see configs/cpu_tiny.py for the layout.")
  sec = cfg[name]
  return dict(sec.to_dict() if hasattr(sec, "to_dict") else sec)


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "mlp_dim")


def use_model_dir(cfg, model_dir: str) -> None:
  """Points ``cfg`` (a ConfigDict) at a checkpoint (a Hugging Face directory or a GGUF
  file, of any architecture ``jaxkv.models.from_pretrained`` loads): the model section
  takes the checkpoint's shapes and name (the directory's), so the cache, the workloads'
  vocabulary and the planner follow it; the config keeps its dtype. A Llama-family
  checkpoint whose every layer attends through a sliding window caps the cache's
  sequence length at its window (jaxkv computes its layers without one); a hybrid model
  (Gemma 3) computes its windowed layers exactly at any length, so it is not capped."""
  hf = models.model_config(models.hf.read_config(model_dir), dtype=cfg.model.dtype)
  with cfg.unlocked():
    cfg.model.model_dir = model_dir
    name = os.path.basename(os.path.normpath(model_dir))
    cfg.model.name = name[:-len(".gguf")] if name.endswith(".gguf") else name
    for field in _SHAPE_FIELDS:
      setattr(cfg.model, field, getattr(hf, field))
    if isinstance(hf, models.LlamaConfig) and hf.sliding_window:
      cfg.cache.max_pages_per_seq = min(cfg.cache.max_pages_per_seq,
                                        hf.sliding_window // cfg.cache.page_size)


# Prefill step of a real checkpoint on CPU, in tokens (``prefill_chunk_pages`` is this over
# the page size). Each step reads every weight once, so a 16-token step is bound by memory
# (a 1B float32 model reads 4.9 GB per step) where a 128-token one is bound by the cores.
# Measured on the 2-core CPU machine with the Llama-3.2-1B-shaped checkpoint that
# launch/bench.py --suite=weights writes, float32, one request of 200 prompt tokens, engines
# interleaved, medians of 3 (the machine was shared: +-30%): TTFT with 1-page chunks
# (16 tokens) 26.7 s, 8 pages (128) 8.0 s, 16 pages 11.9 s, 32 pages 8.2 s (16 and 32 both
# run these 200 tokens as one 256-token step: the same work). Wider steps than 128 tokens
# gain little once compute-bound and pad a short tail more, and 64, 128 and 512-token
# steps give a block's K/V the same bits on XLA:CPU (BUILD.md, "Exactness").
CPU_PREFILL_TOKENS = 128


def platform_defaults(cfg, *, platform: str, explicit=(), processes: int = 1) -> list[str]:
  """Fits the defaults of a config serving a real checkpoint (``model.model_dir``) to
  ``platform``, leaving every field named in ``explicit`` (dotted paths, as
  ``--config.engine.prefill_chunk_pages`` overrides name them) as it is. Returns one line
  per choice, for the log at load. A config without a checkpoint is not touched.

  - ``model.dtype``: on CPU float32 (``jaxkv.models.hf.platform_dtype``) when the config
    says float32 or what the checkpoint stores; another dtype in the config is its
    choice. Elsewhere the config's.
  - ``mesh`` on CPU, one process: 1 x 1 (1 x ``mesh.model`` when that was set). The
    virtual CPU devices are one machine's memory: every data shard holds the weights
    whole (a 4 x 2 mesh held a 1B checkpoint four times and ran out of 24 GB) and every
    device of the model axis its own copy of the replicated tensors (the embedding, a
    quarter of a 1B model). Splitting over virtual devices does not add cores either:
    on the 1B checkpoint (float32, 200-token prompt, 2 cores) 1 x 1 gave TTFT 5.3 s and
    decode 3.4 tok/s against 6.1 s and 2.5 tok/s for 1 x 2 (medians of 3, interleaved).
    The per-shard capacities (``cache.pages_per_shard``, ``engine.max_seqs_per_shard``,
    ``tiers.host_pages_per_shard``), the config's or overridden, are multiplied by the
    folded data factor, so the totals they describe stay the same
    (``--config.mesh.data=1`` takes them as they are).
  - ``engine.prefill_chunk_pages`` on CPU: ``CPU_PREFILL_TOKENS`` wide (capped by
    ``cache.max_pages_per_seq`` and ``cache.pages_per_shard``), and
    ``engine.cache_decode_blocks`` off: a block filled while decoding was computed one
    token per step, whose bits differ from a 64+-token
    prefill step's on XLA:CPU, so it is recomputed in the next turn's prefill instead
    (where it costs little: the step is bound by the cores), and a block's K/V is the
    same bits however it was computed — where steps hold one row each: XLA:CPU's matmuls
    also round differently for another number of rows in a step, which leaves logits
    within ~1e-6 and tokens equal (tests/tools/test_platform_defaults.py shows both).
  """
  model_dir = cfg.model.get("model_dir", "")
  if not model_dir or platform != "cpu":
    if model_dir:
      return [f"dtype {cfg.model.dtype} (the config's, on platform {platform})"]
    return []
  explicit = set(explicit)
  lines = []
  stored = models.hf.checkpoint_dtype(models.hf.read_config(model_dir))
  with cfg.unlocked():
    if "model.dtype" in explicit:
      lines.append(f"dtype {cfg.model.dtype} (asked for; checkpoint stores {stored})")
    elif cfg.model.dtype in (stored, "float32"):
      cfg.model.dtype, why = models.hf.platform_dtype(stored, platform)
      keep = f"; --config.model.dtype={stored} keeps it" if stored != cfg.model.dtype else ""
      lines.append(f"dtype {cfg.model.dtype} ({why}{keep})")
    else:
      lines.append(f"dtype {cfg.model.dtype} (the config's; checkpoint stores {stored})")
    data, model = cfg.mesh.data, cfg.mesh.model
    new_model = model if "mesh.model" in explicit else 1
    if processes == 1 and "mesh.data" not in explicit and (data, model) != (1, new_model):
      cfg.mesh.data, cfg.mesh.model = 1, new_model
      cfg.cache.pages_per_shard *= data
      cfg.engine.max_seqs_per_shard *= data
      if cfg.get("tiers") is not None and cfg.tiers.get("host_pages_per_shard"):
        cfg.tiers.host_pages_per_shard *= data
      lines.append(
          f"mesh 1 x {new_model} (data x model; platform cpu default for a checkpoint: the "
          f"config's {data} x {model} would hold the weights {data} to {data * model} times "
          f"in this machine's memory); the config's totals in one shard: "
          f"{cfg.engine.max_seqs_per_shard} rows, {cfg.cache.pages_per_shard} device pages; "
          f"--config.mesh.data={data} --config.mesh.model={model} keeps it")
    page_size = cfg.cache.page_size
    if "engine.prefill_chunk_pages" not in explicit:
      pages = min(-(-CPU_PREFILL_TOKENS // page_size), cfg.cache.max_pages_per_seq,
                  cfg.cache.pages_per_shard)  # (the cap cache_config fits a sequence to)
      if pages > cfg.engine.prefill_chunk_pages:
        was = cfg.engine.prefill_chunk_pages
        cfg.engine.prefill_chunk_pages = pages
        lines.append(f"prefill chunk {pages} pages = {pages * page_size} tokens (platform cpu "
                     f"default for a checkpoint: every step reads all weights once, so a "
                     f"wide step is bound by the cores, a narrow one by memory); "
                     f"--config.engine.prefill_chunk_pages={was} keeps the config's")
    if (cfg.engine.prefill_chunk_pages > 1 and "engine.cache_decode_blocks" not in explicit
        and cfg.engine.get("cache_decode_blocks", True)):
      cfg.engine.cache_decode_blocks = False
      lines.append("blocks filled while decoding are recomputed by the next prefill rather "
                   "than cached (a one-token step gives other bits than a prefill step on "
                   "XLA:CPU); --config.engine.cache_decode_blocks=true caches them")
  return lines


def model_config(cfg: Mapping):
  """The config's model config: its checkpoint's (``model.model_dir``, any architecture),
  else a random ``LlamaConfig`` of the model section's sizes."""
  m = _section(cfg, "model")
  m.pop("name", None)
  model_dir = m.pop("model_dir", "")
  if model_dir:
    return dataclasses.replace(
        models.model_config(models.hf.read_config(model_dir), dtype=m.get("dtype")),
        scan_layers=m.get("scan_layers", True))
  return models.LlamaConfig(**m)


def load_model(cfg: Mapping, mesh) -> nnx.Module:
  """The config's model: the checkpoint in ``model.model_dir`` when it names one (weights
  placed on ``mesh``), else random weights from ``cfg.seed``."""
  model = _section(cfg, "model")
  if model.get("model_dir", ""):
    return models.from_pretrained(model["model_dir"], dtype=model["dtype"], mesh=mesh,
                                  scan_layers=model.get("scan_layers", True))
  return models.Llama(model_config(cfg), rngs=nnx.Rngs(int(cfg.get("seed", 0))))


def share_weights(model: nnx.Module) -> nnx.Module:
  """Another model object over the same weight arrays (no copy), for a second engine:
  each engine takes over its model's KV layers."""
  return nnx.merge(*nnx.split(model))


def make_mesh_for(cfg: Mapping):
  """The config's mesh over all devices; on one process's CPU, over the first
  ``data x model`` of its virtual devices when it has more (they are one machine: a
  checkpoint's folded mesh, ``platform_defaults``, leaves the rest idle)."""
  mesh_cfg = _section(cfg, "mesh")
  cache_cfg = cache_config(cfg)
  devices, n = jax.devices(), mesh_cfg["data"] * mesh_cfg["model"]
  if n < len(devices) and jax.process_count() == 1 and devices[0].platform == "cpu":
    devices = devices[:n]
  return make_mesh(data=mesh_cfg["data"], model=mesh_cfg["model"],
                   data_axis=cache_cfg.data_axis, model_axis=cache_cfg.model_axis,
                   devices=devices)


# A disk tier named (``tiers.disk_kvstore``) without a capacity gets this many blocks.
DEFAULT_DISK_PAGES = 4096
_FITS_LOGGED: set[str] = set()  # each fit is logged once per process, not per engine built


def _log_fit(line: str) -> None:
  if line not in _FITS_LOGGED:
    _FITS_LOGGED.add(line)
    logging.info("%s", line)


def _int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def cache_config(cfg: Mapping) -> CacheConfig:
  """The config's cache: the model section's shapes (``CacheConfig.for_model`` of
  ``model_config``) with the cache section's budgets. A sequence's page cap
  (``cache.max_pages_per_seq``) above the shard's pool (``cache.pages_per_shard``) is
  lowered to the pool, however the pool was set (``--config.cache.pages_per_shard``,
  ``--device_pages``, the platform's defaults), and logged."""
  m = _section(cfg, "model")
  c = _section(cfg, "cache")
  default = {f.name: f.default for f in dataclasses.fields(CacheConfig)}
  pages = c.get("pages_per_shard", default["pages_per_shard"])
  per_seq = c.get("max_pages_per_seq", default["max_pages_per_seq"])
  if _int(pages) and _int(per_seq) and 0 < pages < per_seq:
    c["max_pages_per_seq"] = pages
    _log_fit(f"cache.max_pages_per_seq {per_seq} -> {pages}: a sequence fits in the shard's "
             f"pool of cache.pages_per_shard={pages} pages")
  return CacheConfig.for_model(model_config(cfg), model_name=m.get("name", "model"), **c)


def tier_config(cfg: Mapping) -> TierConfig:
  """The config's tiers. A disk tier named (``tiers.disk_kvstore``) without a capacity
  (``tiers.disk_pages`` 0 or unset) gets ``DEFAULT_DISK_PAGES`` blocks, logged; none named
  means no disk tier, whatever ``disk_pages`` says."""
  if "tiers" not in cfg:
    return TierConfig()
  t = _section(cfg, "tiers")
  for name in ("kv_events", "kv_events_replay"):  # '' from a flag: not published
    if name in t and not t[name]:
      t[name] = None
  if t.get("disk_kvstore") in ("", None):
    t["disk_kvstore"], t["disk_pages"] = None, 0
    return TierConfig(**t)
  if isinstance(t["disk_kvstore"], str) and t["disk_kvstore"].lstrip().startswith("{"):
    try:  # a TensorStore kvstore spec given as JSON on the command line
      t["disk_kvstore"] = json.loads(t["disk_kvstore"])
    except json.JSONDecodeError as e:
      raise InputError(f"tiers.disk_kvstore={t['disk_kvstore']!r} is not valid JSON ({e}); give "
                       "a directory or a kvstore spec such as '{\"driver\": \"s3\", "
                       "\"bucket\": \"b\", \"path\": \"kv/\"}'.") from None
  if not t.get("disk_pages"):
    t["disk_pages"] = DEFAULT_DISK_PAGES
    _log_fit(f"tiers.disk_pages {DEFAULT_DISK_PAGES}: the disk tier at {t['disk_kvstore']} "
             f"was given no capacity (--config.tiers.disk_pages=N sets one)")
  return TierConfig(**t)


def scheduler_config(cfg: Mapping) -> SchedulerConfig | None:
  """The config's ``scheduler`` section as a ``SchedulerConfig`` (None for a config without
  one). The section's former key ``policy`` (a user's own config file, or
  ``--config.scheduler.policy=...`` on an old command line: configs/default.py keeps the
  key, unset, so that override still parses) sets ``decision``, with a DeprecationWarning
  and a log line; set beside a ``decision`` other than the default, it is refused."""
  if "scheduler" not in cfg:
    return None
  section = _section(cfg, "scheduler")
  old = section.pop("policy", None)
  if old is not None:
    decision = section.get("decision", "cost")
    if decision not in ("cost", old):
      raise InputError(f"config.scheduler.decision={decision!r} and its former name "
                       f"config.scheduler.policy={old!r} disagree; set decision only.")
    message = (f"config.scheduler.policy is deprecated: it is config.scheduler.decision "
               f"(--config.scheduler.decision={old}).")
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    logging.warning("%s", message)
    section["decision"] = old
  return SchedulerConfig(**section)


def build_engine(cfg: Mapping, *, cache: str = "jaxkv", mesh=None,
                 model: nnx.Module | None = None, deployment_key: bytes | None = None,
                 policy: str | None = None) -> Engine:
  """A cache and engine over ``model`` (default: ``load_model(cfg, mesh)``: the config's
  checkpoint, or random weights from ``cfg.seed``). A model passed in is taken over by
  this engine; give each engine its own (``share_weights``).

  ``cache``: ``jaxkv`` reuses cached prefixes (the config's tiers and streaming);
  ``nocache`` gets no prefix reuse and no lower tiers: the recompute-everything baseline.
  ``policy`` is ``cache``'s former name (deprecated). ``deployment_key``: see
  ``jaxkv.KVCache``.
  """
  if policy is not None:
    warnings.warn("build_engine(policy=) is deprecated: it is build_engine(cache=).",
                  DeprecationWarning, stacklevel=2)
    if cache not in ("jaxkv", policy):
      raise InputError(f"build_engine got cache={cache!r} and its former name "
                       f"policy={policy!r}; give cache only.")
    cache = policy
  if cache not in CACHES:
    raise InputError(f"build_engine(cache={cache!r}): must be one of {CACHES} (jaxkv: prefix "
                     "reuse through the tiers; nocache: the recompute-everything baseline).")
  cache_cfg = cache_config(cfg)
  if mesh is None:
    mesh = make_mesh_for(cfg)
  if model is None:
    model = load_model(cfg, mesh)
  engine_cfg = EngineConfig(**{**_section(cfg, "engine"), "prefix_reuse": cache == "jaxkv"})
  tiers = tier_config(cfg) if cache == "jaxkv" else TierConfig()
  return Engine(model, KVCache(cache_cfg, mesh, tiers, deployment_key=deployment_key),
                engine_cfg, scheduler=scheduler_config(cfg),
                stream=stream_config(cfg) if cache == "jaxkv" else None)


def stream_config(cfg: Mapping) -> StreamConfig | None:
  """The config's ``stream`` section as a ``StreamConfig`` (None when not ``enabled``, or
  a config without the section)."""
  if "stream" not in cfg:
    return None
  section = _section(cfg, "stream")
  if not section.pop("enabled", False):
    return None
  return StreamConfig(**section)
