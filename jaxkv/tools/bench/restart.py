"""Suite ``restart``: a warm restart from a checkpoint against a cold one.

One engine serves a multi-turn chat and saves its cache. Then, repeated and interleaved:
- ``restore``: a fresh engine restores the checkpoint (Orbax read + placement);
- ``recompute``: a fresh engine prefills the same prefixes (every saved history);
and the first turn after the restart: TTFT of the next turn on a warm engine (restored)
against a cold one (nothing cached).
"""

from __future__ import annotations

import statistics
import tempfile
import time

from flax import nnx

from jaxkv import models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.worker.checkpoint import Checkpointer
from jaxkv.config import EngineConfig
from jaxkv.serving.engine import Engine
from jaxkv.tools.workloads import Chat, ChatSpec


def run(*, quick: bool = False, reps: int = 5) -> dict:
  import jax
  mesh = common.bench_mesh()
  mc = common.bench_model_config()
  cache = common.bench_cache_config(pages_per_shard=128, max_pages_per_seq=64)
  spec = ChatSpec(users=8, turns=3 if quick else 4, system_prompt_tokens=128,
                  user_tokens=(32, 64), max_new_tokens=8, vocab_size=512, seed=5)
  engine_cfg = EngineConfig(max_seqs_per_shard=2, prefill_chunk_pages=4)

  def fresh() -> Engine:
    return Engine(models.Llama(mc, rngs=nnx.Rngs(0)), KVCache(cache, mesh), engine_cfg)

  first = fresh()
  first.warmup(max_seq_len=spec.max_seq_len())
  chat = Chat(spec)
  for turn in range(spec.turns - 1):
    chat.record(turn, first.generate(chat.prompts(turn), spec.max_new_tokens))
  histories = chat.history
  directory = tempfile.mkdtemp(prefix="jaxkv-restart-")
  t0 = time.perf_counter()
  Checkpointer(first.cache, directory).save()
  save_s = time.perf_counter() - t0
  blocks_saved = sum(first.cache.index.num_cached(s) for s in range(first.cache.num_shards))

  engines = {}

  def setup(name):
    engines[name] = fresh()

  def restore():
    Checkpointer(engines["restore"].cache, directory).restore()
    jax.block_until_ready(engines["restore"].cache.worker.pools)

  def recompute():
    engines["recompute"].generate(histories, 1)

  res = common.interleaved({"restore": restore, "recompute": recompute},
                           reps=2 if quick else reps, setup=setup)
  next_prompts = chat.prompts(spec.turns - 1)
  ttft = {"warm": [], "cold": []}
  for _ in range(2 if quick else reps):
    warm = fresh()
    Checkpointer(warm.cache, directory).restore()
    cold = fresh()
    for name, e in (("warm", warm), ("cold", cold)):
      e.generate(next_prompts, spec.max_new_tokens)
      ttft[name].append(statistics.mean(e.stats()["ttft_s"]))
  warm_s, cold_s = statistics.median(ttft["warm"]), statistics.median(ttft["cold"])
  return {
      "restore_vs_recompute": common.ratio(res["restore"], res["recompute"]),
      "first_turn_ttft_warm_s": warm_s, "first_turn_ttft_cold_s": cold_s,
      "first_turn_cold_vs_warm": cold_s / warm_s,
      "restore": res["restore"], "recompute": res["recompute"], "save_s": save_s,
      "blocks_saved": blocks_saved, "bytes_saved": blocks_saved * cache.page_bytes,
      "prefix_tokens": sum(len(h) for h in histories),
  }
