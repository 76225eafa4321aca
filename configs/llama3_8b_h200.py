"""Llama-3-8B shapes on one NVIDIA H200 (141 GB HBM; about 139 GiB usable).

For `launch/serve.py` with random weights on a GPU machine, and for sizing on any machine:
`python launch/plan.py --config=configs/llama3_8b_h200.py --tokens=32000`.
"""

import os
import runpy

import ml_collections

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config() -> ml_collections.ConfigDict:
  c = runpy.run_path(_DEFAULT)["get_config"]()
  c.name = "llama3_8b_h200"
  c.platform = "gpu"
  c.host_device_count = 0
  c.mesh = ml_collections.ConfigDict(dict(data=1, model=1))
  # Random weights of these shapes; --model_dir=DIR (launch/serve.py) or
  # --config.model.model_dir=DIR serves a Hugging Face checkpoint instead (BUILD.md).
  c.model = ml_collections.ConfigDict(dict(
      name="llama-3-8b-random", model_dir="",
      vocab_size=128256, hidden_size=4096, num_layers=32,
      num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336, dtype="bfloat16",
      scan_layers=True))
  # One block = 2 (K,V) x 32 layers x 8 kv heads x 16 tokens x 128 x 2 bytes = 2 MiB.
  # 48 GiB of HBM for KV (weights take 16 GB, activations the rest): 24576 pages.
  c.cache = ml_collections.ConfigDict(dict(
      page_size=16, pages_per_shard=24576, max_pages_per_seq=8192, attention_chunk_pages=32,
      dtype="bfloat16", attention_impl="auto"))
  # --config.cache.attention_impl=pallas_gpu runs jaxkv's Triton-form kernel. The jnp path
  # walks 32 pages (512 keys) per step; the kernel's chunk is cut to what fits shared memory
  # (jaxkv.ops.kernel.gpu_pages_per_chunk: 4 pages at head_dim 128 in bf16, 128 KiB per
  # 64-row program by Triton's count, of the 227 KiB a block may use; BUILD.md).
  c.engine = ml_collections.ConfigDict(dict(
      max_seqs_per_shard=32, prefill_chunk_pages=32, cache_decode_blocks=True))
  # 256 GiB of pinned host memory and a local NVMe directory below it.
  c.tiers = ml_collections.ConfigDict(dict(
      host_pages_per_shard=131072, host_memory_kind="pinned_host",
      disk_kvstore="/mnt/nvme/jaxkv", disk_pages=1 << 20, write_policy="write_back",
      read_deadline_s=10.0))
  # What the planner assumes before calibration replaces it: PCIe Gen5 x16 (64 GB/s
  # nominal, ~50 achievable one way) and prefill at 2 x 8e9 FLOPs per token on 989 TFLOP/s
  # bf16 at 40% utilisation, about 40 ms per 1000 tokens. The roofline (jaxkv.tools.roofline)
  # reads one device's peaks: H200 datasheet, 4.8 TB/s HBM3e and 989 TFLOP/s dense bf16.
  c.hardware = ml_collections.ConfigDict(dict(
      host_link_gb_per_s=50.0, host_link_latency_ms=0.02, disk_gb_per_s=6.0,
      prefill_ms_per_1k=40.0, hbm_gb_per_s=4800.0, peak_tflops=989.0))
  # The chat workload at this model's scale (the other workloads as in default.py).
  c.workload.chat = ml_collections.ConfigDict(dict(
      users=64, turns=8, system_prompt_tokens=2048, user_tokens=(64, 512),
      max_new_tokens=256))
  return c
