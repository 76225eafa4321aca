"""jaxkv.tools.roofline: parameter counts against the model's own weights, the step arithmetic
against a hand computation, the bounds on real hardware, and launch/plan.py's report."""

import json
import os
import runpy

import pytest
from flax import nnx

from jaxkv.tools import builder, roofline
from jaxkv.errors import InputError
from jaxkv.models import Llama, LlamaConfig
from jaxkv.models.hf import partition_spec

from helpers import run_script

import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT


def load(name):
  return runpy.run_path(os.path.join(ROOT, "configs", f"{name}.py"))["get_config"]()


def tiny_with_hardware(hbm_gb_per_s=100.0, peak_tflops=1.0):
  """configs/default.py (a tiny float32 Llama, mesh 4 data x 2 model) with a hardware
  section of round numbers."""
  cfg = load("default")
  cfg.hardware = dict(hbm_gb_per_s=hbm_gb_per_s, peak_tflops=peak_tflops,
                      host_link_gb_per_s=10.0)
  return cfg


# ---- parameters: counted from shapes == summed over the built model -----------------------------
def _counted_from_weights(mc: LlamaConfig, tp: int):
  """(total, per device, matmul per device) summed over ``Llama(mc)``'s parameters, each
  device's share from the placement rule from_pretrained uses (partition_spec)."""
  model = nnx.eval_shape(lambda: Llama(mc, rngs=nnx.Rngs(0)))
  total = per_device = matmul = 0
  for path, param in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    shape = tuple(param.get_value().shape)
    size = 1
    for d in shape:
      size *= d
    spec = partition_spec(path, shape, "model", tp)
    share = size // tp if any(axis is not None for axis in spec) else size
    total += size
    per_device += share
    owner, leaf = path[-2], path[-1]
    is_head = owner == "lm_head" or (owner == "embed" and mc.tie_embeddings)
    if leaf == "kernel" and owner != "embed" or is_head:
      matmul += share
  return total, per_device, matmul


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("variant", [
    {},  # configs/default.py's tiny model as it is
    {"tie_embeddings": True},
    {"qkv_bias": True, "out_bias": True},
    {"vocab_size": 510},  # a head the model axis does not divide stays whole on each device
])
def test_param_counts_match_the_models_own_weights(tp, variant):
  mc = builder.model_config(load("default"))
  mc = LlamaConfig(**{**{f: getattr(mc, f) for f in (
      "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
      "mlp_dim", "dtype")}, **variant})
  counts = roofline.param_counts(mc, tp)
  total, per_device, matmul = _counted_from_weights(mc, tp)
  assert (counts.total, counts.per_device, counts.matmul_per_device) == (
      total, per_device, matmul)
  table = mc.vocab_size * mc.hidden_size
  assert counts.embedding_per_device == (0 if mc.tie_embeddings else table)


def test_param_counts_of_the_llama3_configs_are_the_published_ones():
  # Meta's Llama 3 model cards: 8,030,261,248 and 70,553,706,496 parameters.
  assert roofline.param_counts(builder.model_config(load("llama3_8b_h200"))).total == (
      8_030_261_248)
  assert roofline.param_counts(builder.model_config(load("llama3_70b_8gpu"))).total == (
      70_553_706_496)


# ---- one step, by hand ---------------------------------------------------------------------------
def test_decode_and_prefill_figures_match_a_hand_computation():
  # configs/default.py: vocab 512, hidden 128, 4 layers, 4 heads, 2 kv heads, head_dim 32,
  # mlp 256, float32 weights and KV; mesh model=2; 2 seqs per shard; 16-token chunks.
  r = roofline.predict(tiny_with_hardware(), context_tokens=100)
  # One device's matmul weights per layer: q 128x64, k and v 128x32 each, o 64x128,
  # gate and up 128x128 each, down 128x128; the head 128x256 (vocab split in two).
  per_layer = 128 * 64 + 2 * 128 * 32 + 64 * 128 + 2 * 128 * 128 + 128 * 128
  matmul = 4 * per_layer + 128 * 256
  assert matmul == 327_680
  norms = 4 * 2 * 128 + 128
  kv_token = 2 * 4 * 1 * 32 * 4  # K and V, 4 layers, 1 kv head here, head_dim 32, float32

  d = r.decode  # 2 sequences x 1 new token after 100 cached
  assert (d.seqs, d.new_tokens, d.context_tokens) == (2, 1, 100)
  assert d.weight_bytes == (matmul + norms + 2 * 128) * 4  # the lookup reads 2 rows
  assert d.kv_read_bytes == 2 * 101 * kv_token  # written, then attended with the 100
  assert d.kv_write_bytes == 2 * kv_token
  assert d.matmul_flops == 2 * matmul * 2
  assert d.attention_flops == 4 * 4 * 2 * 32 * 101 * 2  # 2 q heads here, 101 keys, 2 seqs
  p = r.prefill  # 1 sequence x 16 new tokens after 100 cached
  assert (p.seqs, p.new_tokens, p.context_tokens) == (1, 16, 100)
  assert p.weight_bytes == (matmul + norms + 16 * 128) * 4
  assert p.kv_read_bytes == 116 * kv_token and p.kv_write_bytes == 16 * kv_token
  assert p.matmul_flops == 2 * matmul * 16
  pairs = sum(100 + i + 1 for i in range(16))  # causal: token i sees 100 + i + 1 keys
  assert p.attention_flops == 4 * 4 * 2 * 32 * pairs
  for step in (d, p):
    bytes_ = step.weight_bytes + step.kv_read_bytes + step.kv_write_bytes
    flops = step.matmul_flops + step.attention_flops
    assert (step.bytes, step.flops) == (bytes_, flops)
    assert step.seconds == max(bytes_ / 100e9, flops / 1e12)
    assert step.bound == ("memory" if bytes_ / 100e9 >= flops / 1e12 else "compute")
    assert step.tokens_per_s == step.tokens / step.seconds
  # One block of the whole model (both kv heads): 2 x 4 x 2 x 16 x 32 x 4 bytes, at 10 GB/s.
  assert r.block_bytes == 32768 and r.block_host_link_s == 32768 / 10e9


# ---- on real hardware ----------------------------------------------------------------------------
def test_on_the_h200_decode_is_memory_bound_and_a_512_token_chunk_compute_bound():
  r = roofline.predict(load("llama3_8b_h200"))
  assert r.decode.bound == "memory" and r.decode.seqs == 32
  assert r.prefill.new_tokens == 512 and r.prefill.bound == "compute"
  # A decode step reads every weight for 32 tokens: below the ridge (~206 FLOPs/byte).
  assert r.decode.flops / r.decode.bytes < r.hardware.ridge_flops_per_byte


def test_doubling_hbm_bandwidth_halves_a_memory_bound_step_only():
  slow = roofline.predict(tiny_with_hardware(hbm_gb_per_s=1.0), context_tokens=100)
  fast = roofline.predict(tiny_with_hardware(hbm_gb_per_s=2.0), context_tokens=100)
  assert slow.decode.bound == fast.decode.bound == "memory"
  assert fast.decode.seconds == pytest.approx(slow.decode.seconds / 2, rel=1e-12)
  cfg = load("llama3_8b_h200")
  base = roofline.predict(cfg)
  cfg.hardware.hbm_gb_per_s *= 2
  doubled = roofline.predict(cfg)
  assert doubled.decode.seconds == pytest.approx(base.decode.seconds / 2, rel=1e-12)
  assert doubled.prefill.seconds == base.prefill.seconds  # compute-bound: unchanged
  assert doubled.decode.bytes == base.decode.bytes and doubled.decode.flops == base.decode.flops


# ---- bad input -----------------------------------------------------------------------------------
def test_bad_input_is_refused_naming_the_value_and_the_fix():
  with pytest.raises(InputError, match="context_tokens=0 .*give e.g. 4096"):
    roofline.predict(load("llama3_8b_h200"), context_tokens=0)
  with pytest.raises(InputError, match="max_seq_len=131072.*at most 130560"):
    roofline.predict(load("llama3_8b_h200"), context_tokens=131072)
  assert roofline.missing_hardware(load("default")) == ["hardware.hbm_gb_per_s",
                                                       "hardware.peak_tflops"]
  assert roofline.missing_hardware(load("tpu_v5e_8")) == []
  with pytest.raises(InputError, match="no hardware.hbm_gb_per_s or hardware.peak_tflops"):
    roofline.predict(load("default"))
  cfg = load("llama3_8b_h200")
  cfg.hardware.peak_tflops = 0
  with pytest.raises(InputError, match=r"hardware.peak_tflops=0(\.0)? must be a number > 0"):
    roofline.predict(cfg)
  with pytest.raises(InputError, match="num_kv_heads=2 must be divisible by the model axis"):
    roofline.step_cost(LlamaConfig(num_kv_heads=2, num_heads=4), roofline.Hardware(
        hbm_bytes_per_s=1e9, peak_flops_per_s=1e12), kv_dtype="float32", model_parallel=4,
        seqs=1, new_tokens=1, context_tokens=0)


# ---- launch/plan.py ------------------------------------------------------------------------------
def run_plan(*flags, timeout_s=300):
  return run_script(["launch/plan.py", *flags], timeout_s)


def test_plan_prints_and_writes_the_roofline_of_a_config(tmp_path):
  path = tmp_path / "roofline.json"
  code, out, err = run_plan("--config=configs/llama3_8b_h200.py", f"--json_out={path}")
  assert code == 0, err[-3000:]
  r = json.loads(path.read_text())
  for step, seconds_key in (("decode", "roofline_decode_step_s"),
                            ("prefill", "roofline_prefill_chunk_s")):
    nbytes, flops = r[f"roofline_{step}_bytes"], r[f"roofline_{step}_flops"]
    assert nbytes > 0 and flops > 0 and r[seconds_key] > 0
    # The config's H200 section: 4.8 TB/s and 989 TFLOP/s per device.
    assert r[seconds_key] == pytest.approx(max(nbytes / 4.8e12, flops / 989e12), rel=1e-12)
    assert r[f"roofline_{step}_bound"] == (
        "memory" if nbytes / 4.8e12 >= flops / 989e12 else "compute")
  assert r["roofline_decode_bound"] == "memory" and r["roofline_prefill_bound"] == "compute"
  assert r["roofline_prefill_tokens"] == 512 and r["roofline_context_tokens"] == 4096
  # Beside the prediction: what the cost model in use (here the config's assumption) says.
  assert r["roofline_prefill_cost_model_s"] == pytest.approx(512 * 40e-6)
  assert "decode step" in out and "prefill chunk" in out and "memory-bound" in out
  assert "t_fetch_s" not in r  # no --tokens: the roofline alone


def test_plan_skips_or_refuses_a_config_without_the_hardware_peaks(tmp_path):
  path = tmp_path / "plan.json"
  code, out, err = run_plan("--config=configs/cpu_tiny.py", "--tokens=100",
                            "--link_gb_per_s=10", "--prefill_ms_per_1k=40",
                            f"--json_out={path}")
  assert code == 0, err[-3000:]
  r = json.loads(path.read_text())
  assert "t_fetch_s" in r and "roofline_decode_step_s" not in r
  assert "hardware.hbm_gb_per_s" in r["roofline_skipped"] and "roofline: skipped" in out
  code, _, err = run_plan("--config=configs/cpu_tiny.py", "--roofline_context=64")
  assert code == 2 and "Traceback" not in err
  assert "hardware.hbm_gb_per_s" in err and "configs/llama3_8b_h200.py" in err
