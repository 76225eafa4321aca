"""Llama-3-8B shapes on a TPU v5e-8 slice (8 chips x 16 GB HBM): 4-way data parallel x
2-way tensor parallel (the 8 kv heads split 4 per chip).

Sizing: `python launch/plan.py --config=configs/tpu_v5e_8.py --tokens=32000`.
"""

import os
import runpy

import ml_collections

_DEFAULT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "default.py")


def get_config() -> ml_collections.ConfigDict:
  c = runpy.run_path(_DEFAULT)["get_config"]()
  c.name = "tpu_v5e_8"
  c.platform = "tpu"
  c.host_device_count = 0
  c.mesh = ml_collections.ConfigDict(dict(data=4, model=2))
  # Random weights of these shapes; --model_dir=DIR (launch/serve.py) or
  # --config.model.model_dir=DIR serves a Hugging Face checkpoint instead (BUILD.md).
  c.model = ml_collections.ConfigDict(dict(
      name="llama-3-8b-random", model_dir="",
      vocab_size=128256, hidden_size=4096, num_layers=32,
      num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336, dtype="bfloat16",
      scan_layers=True))
  # 2 MiB per block, 1 MiB per chip; 6 GiB of KV per chip: 6144 pages per data shard.
  c.cache = ml_collections.ConfigDict(dict(
      page_size=16, pages_per_shard=6144, max_pages_per_seq=2048, attention_chunk_pages=16,
      dtype="bfloat16", attention_impl="auto"))
  # For jaxkv's TPU kernel (--config.cache.attention_impl=pallas_tpu): head_dim 128 fills
  # the vector lanes, 16-token bf16 pages a packed (16, 128) tile per DMA, and a chunk of 16
  # pages is a 256-key score tile for the MXU.
  c.engine = ml_collections.ConfigDict(dict(
      max_seqs_per_shard=16, prefill_chunk_pages=16, cache_decode_blocks=True))
  c.tiers = ml_collections.ConfigDict(dict(
      host_pages_per_shard=32768, host_memory_kind="pinned_host",
      disk_kvstore="/tmp/jaxkv-disk", disk_pages=1 << 19, write_policy="write_back",
      read_deadline_s=10.0))
  # Host link per v5e host (PCIe Gen4, ~25 GB/s shared by its chips); prefill 2 x 8e9
  # FLOPs per token on one data shard's 2 chips x 197 TFLOP/s at 40%: about 100 ms per
  # 1000 tokens (each of the 4 data shards prefills its own requests). Roofline
  # (jaxkv.tools.roofline), per chip: Cloud TPU v5e spec, 819 GB/s HBM2 and 197 TFLOP/s bf16.
  c.hardware = ml_collections.ConfigDict(dict(
      host_link_gb_per_s=25.0, host_link_latency_ms=0.05, disk_gb_per_s=2.0,
      prefill_ms_per_1k=100.0, hbm_gb_per_s=819.0, peak_tflops=197.0))
  # The chat workload at this model's scale (the other workloads as in default.py).
  c.workload.chat = ml_collections.ConfigDict(dict(
      users=64, turns=8, system_prompt_tokens=2048, user_tokens=(64, 512),
      max_new_tokens=256))
  return c
