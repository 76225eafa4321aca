"""Suite ``stream``: decoding a context 4x the device budget by streaming cold pages.

Side by side, interleaved: the same prompt decoded by an engine whose device pool holds
everything (``device``) and by ones whose pool holds a quarter of it, streaming the rest
from host memory (``stream_host``) or from disk records read back every step
(``stream_disk``). Beside them, measured on the same machine:
- ``compute_s``: the all-on-device decode step (the compute bound);
- ``transfer_s``: moving the cold pages of one step host -> device alone (the link bound).
``stream_vs_bound = max(compute_s, transfer_s) / streamed step``;
``stream_overlap = (compute_s + transfer_s - streamed step) / transfer_s`` (share of the
transfer hidden behind attention; 1 = fully hidden, 0 = fully serial), clipped to [0, 1].
"""

from __future__ import annotations

import statistics
import time

import numpy as np
from flax import nnx

from jaxkv import models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import EngineConfig, SchedulerConfig, StreamConfig, TierConfig
from jaxkv.serving.engine import Engine


def run(*, quick: bool = False, reps: int = 5) -> dict:
  mesh = common.bench_mesh()
  mc = common.bench_model_config()
  page = 16
  budget = 12 if quick else 16  # device pages for the streamed engine
  context_pages = 4 * budget
  new_tokens = 8 if quick else 16
  prompt = np.random.default_rng(0).integers(1, 512, context_pages * page - new_tokens).tolist()
  stream = StreamConfig(sink_pages=1, window_pages=4, chunk_pages=8)
  engine_cfg = EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=4, prefix_reuse=False)

  def make(pages: int, tiers, stream_cfg) -> Engine:
    cache = common.bench_cache_config(page_size=page, pages_per_shard=pages,
                        max_pages_per_seq=min(pages, context_pages + 1))
    return Engine(models.Llama(mc, rngs=nnx.Rngs(0)), KVCache(cache, mesh, tiers), engine_cfg,
                  scheduler=SchedulerConfig(decision="fetch"), stream=stream_cfg)

  import dataclasses
  import tempfile
  disk_dir = tempfile.mkdtemp(prefix="jaxkv-stream-")
  engines = {
      "device": make(context_pages + 8, None, None),
      "stream_host": make(budget, TierConfig(host_pages_per_shard=context_pages + 8), stream),
      "stream_disk": make(budget, TierConfig(host_pages_per_shard=context_pages + 8,
                                             disk_kvstore=disk_dir, disk_pages=4 * context_pages),
                          dataclasses.replace(stream, source="disk")),
  }
  decode_s = {n: [] for n in engines}
  outputs = {}
  for rep in range(reps + 1):  # the first round compiles every bucket; it is not timed
    for name, e in engines.items():
      before = len(e.stats()["ttft_s"])
      t0 = time.perf_counter()
      outputs[name] = e.generate([prompt], new_tokens)
      total = time.perf_counter() - t0
      ttft = e.stats()["ttft_s"][before]  # seconds from the call to the first token
      if rep:
        decode_s[name].append((total - ttft) / (new_tokens - 1))
  step = {n: statistics.median(v) for n, v in decode_s.items()}

  # The transfer alone: one step's cold pages, host -> device, for every layer.
  e = engines["stream_host"]
  cold_pages = context_pages - stream.sink_pages - stream.window_pages
  host = e.cache.worker.host
  ids = np.zeros((e.cache.num_shards, cold_pages), np.int32)
  ids[0] = np.arange(cold_pages)
  transfer = common.interleaved({"transfer": lambda: host.load(ids)[0].block_until_ready()},
                                reps=reps)["transfer"]["median_s"]
  compute = step["device"]
  streamed = step["stream_host"]
  bound = max(compute, transfer)
  cold_bytes = cold_pages * e.cache.config.page_bytes
  return {
      "stream_vs_bound": bound / streamed,
      "stream_overlap": float(np.clip((compute + transfer - streamed) / transfer, 0.0, 1.0)),
      "decode_tokens_per_s": {n: 1.0 / s for n, s in step.items()},
      "decode_step_s": step, "compute_s": compute, "transfer_s": transfer,
      "cold_bytes_per_step": cold_bytes, "context_tokens": len(prompt) + new_tokens,
      "device_budget_tokens": budget * page, "context_vs_budget": context_pages / budget,
      "outputs_identical": outputs["device"] == outputs["stream_host"] == outputs["stream_disk"],
      "stream_disk_vs_device": step["device"] / step["stream_disk"],
      "disk_reads": "page-cache warm (the records were just written)",
  }
