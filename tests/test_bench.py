"""launch/bench.py --quick suites: they run, and report every figure their issues name."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quick_bench(tmp_path, suite: str) -> dict:
  """``launch/bench.py --suite=SUITE --quick`` as a user runs it; its JSON figures."""
  out = tmp_path / f"{suite}.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run([sys.executable, "launch/bench.py", f"--suite={suite}", "--quick",
                         f"--json_out={out}"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


def test_tiers_suite_reports_ratios_and_the_figures_behind_them(tmp_path):
  r = quick_bench(tmp_path, "tiers")
  for key in ("host_to_device_vs_memcpy", "device_to_host_vs_memcpy", "disk_read_vs_pread",
              "disk_gather_vs_pread", "disk_write_vs_pwrite", "host_to_device_vs_device_put",
              "device_to_host_vs_device_put"):
    assert 0 < r[key] < 100, key
  # The ratio is the quotient of the absolute figures it came from.
  host = r["host"]
  assert abs(r["host_to_device_vs_memcpy"]
             - host["jaxkv_host_to_device"]["gb_per_s"] / host["memcpy"]["gb_per_s"]) < 1e-6
  assert r["chunk_layout"]["gather_1_per_chunk"]["reps"] == 2
  assert len(r["machine"]["devices"]) == 8 and r["suite"] == "tiers"


def test_weights_suite_compares_loading_with_load_file_and_raw_reads(tmp_path):
  r = quick_bench(tmp_path, "weights")
  assert r["all_loaded_bytes_equal"] and r["checkpoint_bytes"] > 0
  loads = r["loads"]
  assert set(loads) == {"jaxkv", "load_file", "read"}
  assert abs(r["load_vs_load_file"]
             - loads["load_file"]["seconds"] / loads["jaxkv"]["seconds"]) < 1e-9
  assert all(f["reps"] == 2 and f["seconds_min"] <= f["seconds"] <= f["seconds_max"]
             for f in loads.values())
  # Decode per dtype on the same checkpoint, with ratios to float32.
  decode = r["decode"]
  assert set(decode) == {"float32", "bfloat16", "bf16_storage_f32_compute"}
  assert all(f["reps"] == 2 and f["tokens_per_s_min"] <= f["tokens_per_s"]
             <= f["tokens_per_s_max"] for f in decode.values())
  for mode in ("bfloat16", "bf16_storage_f32_compute"):
    assert abs(r["decode_vs_float32"][mode]
               - decode[mode]["tokens_per_s"] / decode["float32"]["tokens_per_s"]) < 1e-9
    assert r[f"decode_{mode}_vs_float32"] == r["decode_vs_float32"][mode]
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
  assert abs(r["object_store_read_vs_raw"]
             - store["client_get"]["median_s"] / store["jaxkv_read"]["median_s"]) < 1e-9
  for where in ("file", "s3"):
    race = r["shared_store"][where]
    assert race["committed"] == race["verified"] == 2 * race["blocks_per_writer"] - race[
        "shared_blocks"]


def test_kernels_suite_times_every_impl_on_the_same_steps_and_labels_the_interpreter(tmp_path):
  r = quick_bench(tmp_path, "kernels")
  assert r["backend"] == "cpu"
  for step in ("decode", "prefill"):
    for impl in ("jnp", "pallas_gpu", "pallas_tpu"):
      fig = r[f"{step}_{impl}"]
      assert fig["interpreted"] == (impl != "jnp")  # off GPU/TPU the kernels are interpreted
      assert r[f"{step}_{impl}_max_abs_error"] < 1e-4  # what was timed computes attention
      assert abs(r[f"{step}_{impl}_vs_jnp"]
                 - r[f"{step}_jnp"]["median_s"] / fig["median_s"]) < 1e-9
      tokens = r["shapes"]["batch"] * (1 if step == "decode" else r["shapes"]["prefill_tokens"])
      assert abs(fig["tokens_per_s"] * fig["median_s"] - tokens) < 1e-6 * tokens
