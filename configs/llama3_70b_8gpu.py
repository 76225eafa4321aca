"""Llama-3-70B shapes on 8 GPUs (H100/H200), tensor parallel over 8: the kv heads (8) are
split one per device, so every data shard is the whole node (data=1, model=8).

Sizing: `python launch/plan.py --config=configs/llama3_70b_8gpu.py --tokens=100000`.
"""

import os
import runpy

import ml_collections

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config() -> ml_collections.ConfigDict:
  c = runpy.run_path(_DEFAULT)["get_config"]()
  c.name = "llama3_70b_8gpu"
  c.platform = "gpu"
  c.host_device_count = 0
  c.mesh = ml_collections.ConfigDict(dict(data=1, model=8))
  # Random weights of these shapes; --model_dir=DIR (launch/serve.py) or
  # --config.model.model_dir=DIR serves a Hugging Face checkpoint instead (BUILD.md).
  c.model = ml_collections.ConfigDict(dict(
      name="llama-3-70b-random", model_dir="",
      vocab_size=128256, hidden_size=8192, num_layers=80,
      num_heads=64, num_kv_heads=8, head_dim=128, mlp_dim=28672, dtype="bfloat16",
      scan_layers=True))
  # One block = 2 x 80 layers x 8 kv heads x 16 tokens x 128 x 2 bytes = 5 MiB (640 KiB
  # per device). 24 GiB of KV per device: 39321 pages.
  c.cache = ml_collections.ConfigDict(dict(
      page_size=16, pages_per_shard=39321, max_pages_per_seq=8192, attention_chunk_pages=32,
      dtype="bfloat16", attention_impl="auto"))
  c.engine = ml_collections.ConfigDict(dict(
      max_seqs_per_shard=64, prefill_chunk_pages=32, cache_decode_blocks=True))
  c.tiers = ml_collections.ConfigDict(dict(
      host_pages_per_shard=204800, host_memory_kind="pinned_host",
      disk_kvstore="/mnt/nvme/jaxkv", disk_pages=1 << 21, write_policy="write_back",
      read_deadline_s=10.0))
  # 8 devices share the host's links (about 4 x 50 GB/s across the node's PCIe switches);
  # prefill: 2 x 70e9 FLOPs per token over 8 x 989 TFLOP/s at 40%: about 45 ms per 1000.
  # Roofline (jaxkv.tools.roofline), per device: H200 datasheet figures, 4.8 TB/s HBM3e and 989
  # TFLOP/s dense bf16 (an H100 SXM has the same 989 but 3.35 TB/s: set hbm_gb_per_s=3350).
  c.hardware = ml_collections.ConfigDict(dict(
      host_link_gb_per_s=200.0, host_link_latency_ms=0.02, disk_gb_per_s=12.0,
      prefill_ms_per_1k=45.0, hbm_gb_per_s=4800.0, peak_tflops=989.0))
  # The chat workload at this model's scale (the other workloads as in default.py).
  c.workload.chat = ml_collections.ConfigDict(dict(
      users=128, turns=8, system_prompt_tokens=4096, user_tokens=(64, 1024),
      max_new_tokens=256))
  return c
