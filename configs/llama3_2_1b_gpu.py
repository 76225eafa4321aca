"""Llama-3.2-1B shapes on one NVIDIA H200 (141 GB HBM; about 139 GiB usable), host tier on.

What `launch/device_check.sh` serves on a GPU machine's first check: random weights of these
shapes, the host tier in pinned host memory. It runs a smaller chat workload, with the pool
cut so that blocks go down to the host and come back. Sizing on any machine:
`python launch/plan.py --config=configs/llama3_2_1b_gpu.py --tokens=32000`.
"""

import os
import runpy

import ml_collections

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config() -> ml_collections.ConfigDict:
  c = runpy.run_path(_DEFAULT)["get_config"]()
  c.name = "llama3_2_1b_gpu"
  c.platform = "gpu"
  c.host_device_count = 0
  c.mesh = ml_collections.ConfigDict(dict(data=1, model=1))
  # Random weights of these shapes (1.24e9 parameters, the output head tied to the
  # embedding as in the checkpoint); --model_dir=DIR (launch/serve.py) serves a Hugging
  # Face checkpoint instead (BUILD.md).
  c.model = ml_collections.ConfigDict(dict(
      name="llama-3.2-1b-random", model_dir="",
      vocab_size=128256, hidden_size=2048, num_layers=16,
      num_heads=32, num_kv_heads=8, head_dim=64, mlp_dim=8192, rope_theta=500000.0,
      tie_embeddings=True, dtype="bfloat16", scan_layers=True))
  # One block = 2 (K,V) x 16 layers x 8 kv heads x 16 tokens x 64 x 2 bytes = 512 KiB.
  # 32 GiB of HBM for KV: 65536 pages. launch/serve.py builds a second engine (the no-cache
  # baseline) with its own pool: 64 GiB for both, with 2.5 GB of weights, inside the 75% of
  # HBM that JAX takes by default.
  c.cache = ml_collections.ConfigDict(dict(
      page_size=16, pages_per_shard=65536, max_pages_per_seq=8192, attention_chunk_pages=32,
      dtype="bfloat16", attention_impl="auto"))
  c.engine = ml_collections.ConfigDict(dict(
      max_seqs_per_shard=64, prefill_chunk_pages=32, cache_decode_blocks=True))
  # 32 GiB of pinned host memory below the device pool. No disk tier by default (the first
  # machine may have no scratch NVMe): --disk_dir=DIR adds one.
  c.tiers = ml_collections.ConfigDict(dict(
      host_pages_per_shard=65536, host_memory_kind="pinned_host", disk_kvstore="",
      disk_pages=0, write_policy="write_back", read_deadline_s=10.0))
  # What the planner assumes before calibration replaces it: PCIe Gen5 x16 (64 GB/s
  # nominal, ~50 achievable one way); HBM3e 4.8 TB/s and 989 TFLOP/s dense bf16 (H200);
  # prefill at 2 x 1.24e9 FLOPs per token on 989 TFLOP/s at 40% is about 6 ms per 1000
  # tokens, 10 with attention and the launch overheads of a small model.
  c.hardware = ml_collections.ConfigDict(dict(
      host_link_gb_per_s=50.0, host_link_latency_ms=0.02, disk_gb_per_s=6.0,
      prefill_ms_per_1k=10.0, hbm_gb_per_s=4800.0, peak_tflops=989.0))
  # The chat workload at this model's scale (the other workloads as in default.py).
  c.workload.chat = ml_collections.ConfigDict(dict(
      users=64, turns=6, system_prompt_tokens=2048, user_tokens=(64, 512),
      max_new_tokens=128))
  return c
