"""Capacity planner: fetch, recompute or split a cold KV cache — no model needed.

  python launch/plan.py --kv_bytes=10e9 --tokens=20000 --link_gb_per_s=64 \
      --prefill_ms_per_1k=40
  python launch/plan.py --layers=32 --kv_heads=8 --head_dim=128 --dtype=bfloat16 \
      --tokens=32000 --requests=4 --link_gb_per_s=25 --link_latency_ms=0.05 \
      --cost_model=/tmp/costs.json          # a calibrated prefill curve
  python launch/plan.py --config=configs/llama3_8b_h200.py --tokens=32000
                                            # model shape and hardware from a config
  python launch/plan.py --config=configs/llama3_8b_h200.py --roofline_context=8192
                                            # the roofline alone (no --tokens)

Prints the three options and the chosen split; --json_out writes t_fetch_s, t_recompute_s,
decision, split_tokens and t_split_s (1 GB = 1e9 bytes). With a config whose hardware
section gives hbm_gb_per_s and peak_tflops it also prints the roofline (jaxkv.tools.roofline):
the bytes, FLOPs and least time of a decode step and a prefill chunk on one device, beside
the prefill time the cost model in use gives the same chunk; --json_out adds roofline_*
keys (roofline_decode_step_s, roofline_prefill_chunk_s, ...). Without --tokens only the
roofline is computed.
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
_TOKENS = flags.DEFINE_integer("tokens", None, "Total cold tokens over all --requests "
                               "(required, unless a --config's roofline is all you want).",
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
_ROOFLINE_CONTEXT = flags.DEFINE_integer(
    "roofline_context", 4096, "Roofline (with a --config whose hardware section gives "
    "hbm_gb_per_s and peak_tflops): tokens each sequence of the decode step holds, and the "
    "cached tokens before the prefill chunk. Giving it asks for the roofline: a config "
    "without those keys is then refused instead of skipped.")
for _name in ("kv_bytes", "link_gb_per_s", "prefill_ms_per_1k"):
  flags.register_validator(_name, lambda v: v is None or v > 0,
                           f"--{_name} must be a number > 0.")


def main(argv):
  del argv
  _common.check_output(_JSON_OUT.value, "json_out")
  cfg = _common.load_config(_CONFIG)
  tokens = _TOKENS.value
  roofline_asked = flags.FLAGS["roofline_context"].present
  if tokens is None and cfg is None:
    raise app.UsageError("give --tokens=N (the cold tokens to plan for), or a --config whose "
                         "hardware section gives hbm_gb_per_s and peak_tflops for its roofline "
                         "alone.")
  if roofline_asked and cfg is None:
    raise app.UsageError("--roofline_context needs --config=configs/<name>.py: the roofline "
                         "reads its model, cache, engine, mesh and hardware sections.")
  if tokens is not None and cfg is not None and "hardware" not in cfg and (
      (_LINK.value is None and not _COST_MODEL.value)
      or (_PREFILL.value is None and not _COST_MODEL.value)):
    raise app.UsageError(f"config {cfg.name} has no hardware section: give --link_gb_per_s "
                         "and --prefill_ms_per_1k (or --cost_model) with it.")
  _common.start_jax({"platform": "cpu"})
  import jax.numpy as jnp
  from jaxkv.tools.capacity import capacity_plan
  from jaxkv.planning.costs import LinkCost
  layers, kv_heads, head_dim, dtype = (_LAYERS.value, _KV_HEADS.value, _HEAD_DIM.value,
                                       _DTYPE.value)
  link, prefill, page = _LINK.value, _PREFILL.value, _PAGE.value
  latency = _LATENCY.value
  roof, out = None, {}
  if cfg is not None:
    if cfg.model.get("model_dir"):  # a checkpoint's shapes replace the config's
      from jaxkv.tools import builder
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
    roof, skipped = _roofline(cfg, required=roofline_asked or tokens is None)
    if skipped:
      print(f"roofline: skipped ({skipped})")
      out["roofline_skipped"] = skipped
  costs = _costs(cfg, prefill)
  if tokens is not None:
    kv_bytes = _KV_BYTES.value
    if kv_bytes is None:
      if None in (layers, kv_heads, head_dim):
        raise app.UsageError("give --kv_bytes, or the model shape --layers, --kv_heads and "
                             "--head_dim.")
      per_token = 2 * layers * kv_heads * head_dim * jnp.dtype(dtype).itemsize
      kv_bytes = float(per_token * tokens)
    per_token = kv_bytes / tokens
    if costs is None:
      raise app.UsageError("give --prefill_ms_per_1k or --cost_model.")
    if link is not None:
      costs.links["host_to_device"] = LinkCost(latency / 1e3, link * 1e9)
    if "host_to_device" not in costs.links:
      raise app.UsageError("give --link_gb_per_s (or a cost model that has host_to_device).")
    r = capacity_plan(kv_bytes=kv_bytes, tokens=tokens, costs=costs,
                      requests=_REQUESTS.value, page_size=page, context_tokens=_CONTEXT.value)
    print(f"per request: {r['tokens_per_request']} tokens, "
          f"{r['bytes_per_request'] / 1e9:.3f} GB")
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
    out.update({**r, "kv_bytes": kv_bytes, "tokens": tokens, "cost_model": costs.source,
                "bytes_per_token": per_token, "break_even_link_gb_per_s": break_even,
                "tier_tokens": tiers})
  if roof is not None:
    out.update(_report_roofline(roof, costs))
  _common.write_json(_JSON_OUT.value, out)


def _roofline(cfg, *, required: bool):
  """(the config's roofline, None), or (None, why it was skipped). ``required`` (asked for
  with --roofline_context, or all that was asked for): a config that cannot give one is
  refused instead, naming what to fix."""
  from jaxkv.tools import roofline
  from jaxkv.errors import InputError
  missing = roofline.missing_hardware(cfg)
  if missing and required:
    fix = (" Or give --tokens=N for the capacity plan alone." if _TOKENS.value is None
           else " Or drop --roofline_context.")
    raise app.UsageError(roofline.missing_message(cfg, missing) + fix)
  if missing:
    return None, f"config {cfg.name} has no {', '.join(missing)}"
  try:
    return roofline.predict(cfg, context_tokens=_ROOFLINE_CONTEXT.value), None
  except InputError as e:
    if required:
      raise
    return None, str(e)


def _costs(cfg, prefill_ms_per_1k):
  """The cost model plans use: --cost_model's calibrated one, else a linear prefill curve
  from --prefill_ms_per_1k or the config's hardware section (links are added later), else
  None."""
  from jaxkv.planning.costs import CostModel, PrefillCurve
  if _COST_MODEL.value:
    return CostModel.load(_COST_MODEL.value)
  if prefill_ms_per_1k is not None:
    return CostModel(links={}, prefill=PrefillCurve(0.0, prefill_ms_per_1k / 1e6, 0.0),
                     source="flags" if cfg is None else f"config {cfg.name}")
  return None


def _report_roofline(roof, costs) -> dict:
  """Prints a config's roofline (jaxkv.tools.roofline) beside the prefill time the cost model in
  use gives the same chunk; returns the roofline_* figures for --json_out."""
  hw, p = roof.hardware, roof.params
  print(f"roofline of {roof.name} per device, {p.model_parallel}-way tensor parallel "
        f"({hw.hbm_bytes_per_s / 1e9:,.0f} GB/s HBM, {hw.peak_flops_per_s / 1e12:,.0f} "
        f"TFLOP/s; {p.per_device / 1e9:.2f}B of {p.total / 1e9:.2f}B params each): "
        "predicted floors, not measurements")
  for label, step in (("decode step", roof.decode), ("prefill chunk", roof.prefill)):
    what = (f"{step.seqs} seqs x 1 token" if step.new_tokens == 1 and step.seqs > 1
            else f"{step.tokens} tokens") + f" after {step.context_tokens:,}"
    shards = (f" (x{roof.data_shards}: {roof.data_shards * step.tokens_per_s:,.0f})"
              if roof.data_shards > 1 else "")
    print(f"  {label:13s} {what}: {step.bytes / 1e9:.3f} GB (weights "
          f"{step.weight_bytes / 1e9:.3f}, KV read {step.kv_read_bytes / 1e9:.3f}, written "
          f"{step.kv_write_bytes / 1e9:.4f}), {step.flops / 1e12:.3f} TFLOP")
    print(f"  {'':13s} -> {1e3 * step.seconds:.3f} ms, {step.bound}-bound (memory "
          f"{1e3 * step.memory_s:.3f} ms, compute {1e3 * step.compute_s:.3f} ms); "
          f"{step.tokens_per_s:,.0f} tokens/s per shard{shards}")
  if roof.block_host_link_s is not None:
    print(f"  host link: one block ({roof.block_bytes / 2**20:.2f} MiB) in "
          f"{1e3 * roof.block_host_link_s:.3f} ms; the prefill chunk's KV in "
          f"{1e3 * roof.prefill_kv_host_link_s:.3f} ms")
  out = roof.as_json()
  if costs is not None:
    chunk = roof.prefill
    t = costs.prefill.seconds(chunk.new_tokens, chunk.context_tokens)
    kind = "measured, --cost_model" if _COST_MODEL.value else "assumed, prefill_ms_per_1k"
    print(f"  the same prefill chunk by the cost model ({costs.source}; {kind}): "
          f"{1e3 * t:.3f} ms, {t / chunk.seconds:.2f}x the roofline")
    out.update({"roofline_prefill_cost_model_s": t, "roofline_cost_model_source": costs.source,
                "roofline_cost_model_kind": "measured" if _COST_MODEL.value else "assumed"})
  return out


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
