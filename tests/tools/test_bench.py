"""launch/bench.py --quick suites: they run, and report every figure their issues name.

The tiers and kernels suites are the ones launch/device_check.sh's dry run runs (the same
--quick command lines): their figures are read from that run's steps (conftest's
``device_check_dry_run``, once a session) instead of being measured again.

A ratio the bench reports is not checked against the quotient it was computed from (that
could not fail): each figure must be measured (positive, finite, its median within its
range over the repetitions both sides ran), its throughput what the bytes the bench says it
moved give over its median, and the ratio within what the two sides' ranges allow."""

import json
import math

import numpy as np

import helpers


def quick_bench(tmp_path, suite: str) -> dict:
  """``launch/bench.py --suite=SUITE --quick`` as a user runs it; its JSON figures."""
  out = tmp_path / f"{suite}.json"
  code, _, err = helpers.run_script(["launch/bench.py", f"--suite={suite}", "--quick",
                                     f"--json_out={out}"], timeout_s=600)
  assert code == 0, err[-3000:]
  return json.loads(out.read_text())


def dry_run_step(dry_run, name: str) -> dict:
  """The JSON the dry run's step ``name`` wrote (its launch/bench.py --quick run)."""
  code, stdout, _, out_dir = dry_run
  path = out_dir / "steps" / f"{name}.json"
  assert path.exists(), f"the dry run (exit {code}) wrote no {name}.json:\n{stdout[-3000:]}"
  return json.loads(path.read_text())


def positive(x) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def check_timed(fig: dict, reps: int, nbytes: int | None = None) -> None:
  """A figure of ``common.summary`` (``throughput`` over ``nbytes``): measured ``reps``
  times, its median within its range; with ``nbytes``, its GB/s what they give."""
  assert fig["reps"] == reps, fig
  assert all(positive(fig[k]) for k in ("min_s", "median_s", "max_s")), fig
  assert fig["min_s"] <= fig["median_s"] <= fig["max_s"], fig
  if nbytes is not None:
    assert math.isclose(fig["gb_per_s"], nbytes / fig["median_s"] / 1e9, rel_tol=1e-9), fig
    assert fig["gb_per_s_min"] <= fig["gb_per_s"] <= fig["gb_per_s_max"], fig


def check_speedup(ratio, a: dict, b: dict, *, lo="min_s", hi="max_s") -> None:
  """``ratio`` is how many times faster ``a`` ran than ``b`` (time of b over time of a):
  positive, finite, and within what their ranges allow (b at its fastest over a at its
  slowest, b at its slowest over a at its fastest)."""
  assert positive(ratio), ratio
  assert b[lo] / a[hi] <= ratio * (1 + 1e-12) and ratio <= b[hi] / a[lo] * (1 + 1e-12), (
      ratio, a, b)


def test_tiers_suite_reports_ratios_and_the_figures_behind_them(device_check_dry_run):
  r = dry_run_step(device_check_dry_run, "tiers")
  # Its ~100 MB of stores and files were removed (they were left in the temporary
  # directory, one more each run).
  assert not list((device_check_dry_run[3] / "tmp").glob("jaxkv-bench-*"))
  assert len(r["machine"]["devices"]) == 8 and r["suite"] == "tiers"
  sizes = r["bytes"]
  assert all(isinstance(n, int) and n > 0 for n in sizes.values()), sizes
  host, disk = r["host"], r["disk"]
  for fig in host.values():  # every host move is of the same bytes
    check_timed(fig, 2, sizes["host_moves"])
  for name, fig in disk.items():
    check_timed(fig, 2, sizes["disk_gather"] if "gather" in name else sizes["disk_bulk"])
  for key, a, b in (
      ("host_to_device_vs_memcpy", host["jaxkv_host_to_device"], host["memcpy"]),
      ("device_to_host_vs_memcpy", host["jaxkv_device_to_host"], host["memcpy"]),
      ("host_to_device_vs_device_put", host["jaxkv_host_to_device"],
       host["device_put_to_device"]),
      ("device_to_host_vs_device_put", host["jaxkv_device_to_host"], host["device_put_to_host"]),
      ("disk_read_vs_pread", disk["jaxkv_bulk_read"], disk["pread_bulk"]),
      ("disk_gather_vs_pread", disk["jaxkv_gather"], disk["pread_gather"]),
      ("disk_write_vs_pwrite", disk["jaxkv_write"], disk["pwrite"])):
    assert 0 < r[key] < 100, key
    check_speedup(r[key], a, b)
  sweep = r["host_sweep"]  # move sizes, pool-size sensitivity, the compiled moves
  assert sorted(sweep["sizes"]) == ["1mib", "4mib"], sweep["sizes"].keys()
  for fig in sweep["sizes"].values():
    for name in ("store", "load", "device_put_to_host", "device_put_to_device"):
      check_timed(fig[name], 2, fig["bytes"])
    check_speedup(fig["store_vs_device_put"], fig["store"], fig["device_put_to_host"])
    check_speedup(fig["load_vs_device_put"], fig["load"], fig["device_put_to_device"])
  assert len(sweep["pool_store_ms"]) == 2 and all(
      positive(ms) for ms in sweep["pool_store_ms"].values()), sweep["pool_store_ms"]
  # The compiled moves loop over their blocks and compute nothing on the host (XLA:CPU
  # here; the device check reads the same keys on a GPU).
  for name in ("place", "load"):
    assert sweep["hlo"][name]["while"] == 1, sweep["hlo"]
    assert sweep["hlo"][name]["host-execute"] == sweep["hlo"][name]["_xla_compute_type"] == 0
  assert sweep["hlo"]["stage"]["while"] == 0, sweep["hlo"]
  layout = r["chunk_layout"]
  assert layout["gather_1_per_chunk"]["reps"] == 2
  for kind in ("gather", "write"):
    for per in (1, 8):
      check_timed(layout[f"{kind}_{per}_per_chunk"], 2)
    check_speedup(layout[f"{kind}_1_vs_8_per_chunk"], layout[f"{kind}_1_per_chunk"],
                  layout[f"{kind}_8_per_chunk"])


def test_weights_suite_compares_loading_with_load_file_and_raw_reads(tmp_path):
  r = quick_bench(tmp_path, "weights")
  assert r["all_loaded_bytes_equal"] and r["checkpoint_bytes"] > 0
  loads = r["loads"]
  assert set(loads) == {"jaxkv", "load_file", "read"}
  assert all(f["reps"] == 2 and 0 < f["seconds_min"] <= f["seconds"] <= f["seconds_max"]
             and math.isclose(f["gb_per_s"], r["checkpoint_bytes"] / f["seconds"] / 1e9,
                              rel_tol=1e-9) for f in loads.values()), loads
  timed = dict(lo="seconds_min", hi="seconds_max")
  check_speedup(r["load_vs_load_file"], loads["jaxkv"], loads["load_file"], **timed)
  check_speedup(r["load_vs_read"], loads["jaxkv"], loads["read"], **timed)
  # Decode per dtype on the same checkpoint, with ratios to float32.
  decode = r["decode"]
  assert set(decode) == {"float32", "bfloat16", "bf16_storage_f32_compute"}
  assert all(f["reps"] == 2 and 0 < f["tokens_per_s_min"] <= f["tokens_per_s"]
             <= f["tokens_per_s_max"] and all(map(math.isfinite, (f["tokens_per_s_min"],
                                                                  f["tokens_per_s_max"])))
             for f in decode.values()), decode
  f32 = decode["float32"]
  assert r["decode_float32_tokens_per_s"] == f32["tokens_per_s"]
  for mode in ("bfloat16", "bf16_storage_f32_compute"):
    ratio, fig = r["decode_vs_float32"][mode], decode[mode]
    # A rate over float32's: within what their ranges allow.
    assert positive(ratio)
    assert (fig["tokens_per_s_min"] / f32["tokens_per_s_max"] <= ratio * (1 + 1e-12)
            and ratio <= fig["tokens_per_s_max"] / f32["tokens_per_s_min"] * (1 + 1e-12)), (
                mode, ratio, fig, f32)
    assert r[f"decode_{mode}_vs_float32"] == ratio
  # What was timed is what it says: bfloat16 holds half float32's bytes, and computing in
  # float32 over the bfloat16 arrays gives float32's tokens.
  assert 2 * decode["bfloat16"]["weight_bytes"] == decode["float32"]["weight_bytes"]
  assert (decode["bfloat16"]["weight_bytes"] < decode["bf16_storage_f32_compute"]["weight_bytes"]
          < decode["float32"]["weight_bytes"])
  assert decode["bf16_storage_f32_compute"]["same_tokens_as_float32"]


def test_storage_suite_reports_the_object_store_ratio_and_lost_blocks(tmp_path):
  r = quick_bench(tmp_path, "storage")
  assert r["lost_blocks"] == 0
  store = r["object_store"]
  assert set(store) == {"jaxkv_read", "client_get"}
  nbytes = r["object_store_blocks"] * r["object_store_record_bytes"]
  assert nbytes > 0
  for fig in store.values():
    check_timed(fig, 2, nbytes)
  check_speedup(r["object_store_read_vs_raw"], store["jaxkv_read"], store["client_get"])
  for where in ("file", "s3"):
    race = r["shared_store"][where]
    assert race["committed"] == race["verified"] == 2 * race["blocks_per_writer"] - race[
        "shared_blocks"]


def test_kernels_suite_times_every_impl_on_the_same_steps_and_labels_the_interpreter(
    device_check_dry_run):
  r = dry_run_step(device_check_dry_run, "kernels")
  assert r["backend"] == "cpu"
  s = r["shapes"]
  # The K and V every step reads, from the shapes alone.
  kv_bytes = 2 * s["batch"] * s["context"] * s["kv_heads"] * s["head_dim"] * np.dtype(
      s["dtype"]).itemsize
  assert r["kv_bytes_per_step"] == kv_bytes
  for step in ("decode", "prefill"):
    for impl in ("jnp", "pallas_gpu", "pallas_tpu"):
      fig = r[f"{step}_{impl}"]
      assert fig["interpreted"] == (impl != "jnp")  # off GPU/TPU the kernels are interpreted
      assert r[f"{step}_{impl}_max_abs_error"] < 1e-4  # what was timed computes attention
      check_timed(fig, 2, kv_bytes)
      check_speedup(r[f"{step}_{impl}_vs_jnp"], fig, r[f"{step}_jnp"])
      tokens = s["batch"] * (1 if step == "decode" else s["prefill_tokens"])
      assert abs(fig["tokens_per_s"] * fig["median_s"] - tokens) < 1e-6 * tokens
    # (The self-ratio jnp_vs_jnp is 1.0 by construction: not checked.) Both kernels' ratios
    # are over the same jnp timing, so their quotient is how the two kernels compare and must
    # lie within what those two kernels' own ranges allow.
    gpu, tpu = r[f"{step}_pallas_gpu"], r[f"{step}_pallas_tpu"]
    check_speedup(r[f"{step}_pallas_gpu_vs_jnp"] / r[f"{step}_pallas_tpu_vs_jnp"], gpu, tpu)
