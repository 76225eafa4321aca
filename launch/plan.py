"""Capacity planner: fetch, recompute or split a cold KV cache — no model needed.

  python launch/plan.py --kv_bytes=10e9 --tokens=20000 --link_gb_per_s=64 \
      --prefill_ms_per_1k=40
  python launch/plan.py --layers=32 --kv_heads=8 --head_dim=128 --dtype=bfloat16 \
      --tokens=32000 --requests=4 --link_gb_per_s=25 --link_latency_ms=0.05 \
      --cost_model=/tmp/costs.json          # a calibrated prefill curve
  python launch/plan.py --config=configs/llama3_8b_h200.py --tokens=32000
                                            # model shape and hardware from a config

Prints the three options and the chosen split; --json_out writes t_fetch_s, t_recompute_s,
decision, split_tokens and t_split_s (1 GB = 1e9 bytes).
"""

from absl import app, flags
from ml_collections import config_flags

import _common

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Optional config (configs/*.py): its model shape, page size and "
    "hardware section give defaults for the flags below.")
_KV_BYTES = flags.DEFINE_float("kv_bytes", None, "Total bytes of the cold KV over all "
                               "--requests (or give a model shape: --layers, --kv_heads, "
                               "--head_dim, --dtype).")
_LAYERS = flags.DEFINE_integer("layers", None, "Model layers (with --kv_heads, --head_dim).",
                               lower_bound=1)
_KV_HEADS = flags.DEFINE_integer("kv_heads", None, "KV heads per layer.", lower_bound=1)
_HEAD_DIM = flags.DEFINE_integer("head_dim", None, "Head dimension.", lower_bound=1)
_DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "KV dtype.")
_TOKENS = flags.DEFINE_integer("tokens", None, "Total cold tokens over all --requests.",
                               lower_bound=1)
_REQUESTS = flags.DEFINE_integer("requests", 1, "Equal requests in one step: they share the "
                                 "link and the one device that recomputes them (the "
                                 "recompute of all is what their total tokens cost).",
                                 lower_bound=1)
_CONTEXT = flags.DEFINE_integer("context_tokens", 0, "Hot tokens before the cold ones.",
                                lower_bound=0)
_LINK = flags.DEFINE_float("link_gb_per_s", None, "Link bandwidth, GB/s (1 GB = 1e9 bytes).")
_LATENCY = flags.DEFINE_float("link_latency_ms", 0.0, "Link latency per transfer, ms.",
                              lower_bound=0.0)
_PREFILL = flags.DEFINE_float("prefill_ms_per_1k", None, "Prefill time per 1000 tokens, ms "
                              "(linear), unless --cost_model gives a calibrated curve.")
_COST_MODEL = flags.DEFINE_string("cost_model", None, "A CostModel JSON (jaxkv calibration).")
_PAGE = flags.DEFINE_integer("page_size", 16, "Tokens per block.", lower_bound=1)
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the figures here as one JSON object.")

flags.mark_flag_as_required("tokens")
for _name in ("kv_bytes", "link_gb_per_s", "prefill_ms_per_1k"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           f"--{_name} must be a number > 0.")


def main(argv):
  del argv
  _common.check_output(_JSON_OUT.value, "json_out")
  cfg = _common.load_config(_CONFIG)
  if cfg is not None and "hardware" not in cfg and (
      (_LINK.value is None and not _COST_MODEL.value)
      or (_PREFILL.value is None and not _COST_MODEL.value)):
    raise app.UsageError(f"config {cfg.name} has no hardware section: give --link_gb_per_s "
                         "and --prefill_ms_per_1k (or --cost_model) with it.")
  _common.start_jax({"platform": "cpu"})
  import jax.numpy as jnp
  from jaxkv.capacity import capacity_plan
  from jaxkv.costs import CostModel, LinkCost, PrefillCurve
  layers, kv_heads, head_dim, dtype = (_LAYERS.value, _KV_HEADS.value, _HEAD_DIM.value,
                                       _DTYPE.value)
  link, prefill, page = _LINK.value, _PREFILL.value, _PAGE.value
  latency = _LATENCY.value
  if cfg is not None:
    if cfg.model.get("model_dir"):  # a checkpoint's shapes replace the config's
      from jaxkv import builder
      builder.use_model_dir(cfg, cfg.model.model_dir)
    m, hw = cfg.model, cfg.get("hardware", {})
    layers, kv_heads, head_dim = (layers or m.num_layers, kv_heads or m.num_kv_heads,
                                  head_dim or m.head_dim)
    if not flags.FLAGS["dtype"].present:
      dtype = cfg.cache.get("dtype", m.dtype)
    if not flags.FLAGS["page_size"].present:
      page = cfg.cache.page_size
    link = link if link is not None else hw.get("host_link_gb_per_s")
    prefill = prefill if prefill is not None else hw.get("prefill_ms_per_1k")
    if not flags.FLAGS["link_latency_ms"].present:
      latency = hw.get("host_link_latency_ms", latency)
  kv_bytes = _KV_BYTES.value
  if kv_bytes is None:
    if None in (layers, kv_heads, head_dim):
      raise app.UsageError("give --kv_bytes, or the model shape --layers, --kv_heads and "
                           "--head_dim.")
    per_token = 2 * layers * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    kv_bytes = float(per_token * _TOKENS.value)
  per_token = kv_bytes / _TOKENS.value
  if _COST_MODEL.value:
    costs = CostModel.load(_COST_MODEL.value)
  elif prefill is not None:
    costs = CostModel(links={}, prefill=PrefillCurve(0.0, prefill / 1e6, 0.0),
                      source="flags" if cfg is None else f"config {cfg.name}")
  else:
    raise app.UsageError("give --prefill_ms_per_1k or --cost_model.")
  if link is not None:
    costs.links["host_to_device"] = LinkCost(latency / 1e3, link * 1e9)
  if "host_to_device" not in costs.links:
    raise app.UsageError("give --link_gb_per_s (or a cost model that has host_to_device).")
  r = capacity_plan(kv_bytes=kv_bytes, tokens=_TOKENS.value, costs=costs,
                    requests=_REQUESTS.value, page_size=page, context_tokens=_CONTEXT.value)
  print(f"per request: {r['tokens_per_request']} tokens, {r['bytes_per_request'] / 1e9:.3f} GB")
  print(f"  fetch all      {1e3 * r['t_fetch_s']:10.1f} ms")
  print(f"  recompute all  {1e3 * r['t_recompute_s']:10.1f} ms")
  print(f"  split          {1e3 * r['t_split_s']:10.1f} ms  (recompute {r['split_tokens']} "
        f"tokens while fetching {r['fetch_tokens']})")
  print(f"decision: {r['decision']}; fetch vs recompute: "
        f"{r['t_recompute_s'] / r['t_fetch_s']:.2f}x")
  # The link speed at which fetching the request's KV takes as long as recomputing it.
  link_cost = costs.links["host_to_device"]
  spare = r["t_recompute_s"] - link_cost.latency_s
  break_even = r["bytes_per_request"] / spare / 1e9 if spare > 0 else float("inf")
  print(f"KV per token: {per_token / 1024:.1f} KiB; fetching beats recomputing above "
        f"{break_even:.2f} GB/s (this link: {link_cost.bytes_per_s / 1e9:.2f} GB/s)")
  tiers = _tier_tokens(cfg) if cfg is not None else None
  if tiers:
    print("tokens each tier holds: " + ", ".join(
        f"{name} {n:,} ({n * per_token / 1e9:.1f} GB)" for name, n in tiers.items()))
  _common.write_json(_JSON_OUT.value, {**r, "kv_bytes": kv_bytes, "tokens": _TOKENS.value,
                                       "cost_model": costs.source,
                                       "bytes_per_token": per_token,
                                       "break_even_link_gb_per_s": break_even,
                                       "tier_tokens": tiers})


def _tier_tokens(cfg) -> dict:
  """Tokens of KV each tier of a config holds: device and host over every data shard."""
  page, shards = cfg.cache.page_size, cfg.mesh.data
  tiers = cfg.get("tiers", {})
  out = {"device": cfg.cache.pages_per_shard * page * shards}
  if tiers.get("host_pages_per_shard"):
    out["host"] = tiers.host_pages_per_shard * page * shards
  if tiers.get("disk_kvstore") and tiers.get("disk_pages"):
    out["disk"] = tiers.disk_pages * page
  return out


if __name__ == "__main__":
  _common.run(main)
