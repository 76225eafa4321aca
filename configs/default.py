"""Every field a jaxkv config has, with the embedded default's values: CPU, a tiny
random-weight Llama, 8 virtual devices (4 data x 2 model).

The other files in this folder start from this one and override what differs
(`runpy.run_path` of this file: config files are loaded by path, not imported):
`configs/cpu_tiny.py` is it as it is; the real-model configs replace the model, cache,
engine and tier sections, add a `hardware` section and size the chat workload.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.name = "default"
  c.platform = "cpu"
  c.host_device_count = 8  # virtual CPU devices (XLA_FLAGS), set before JAX starts
  c.seed = 0
  c.mesh = ml_collections.ConfigDict(dict(data=4, model=2))
  # model_dir: a Hugging Face checkpoint directory (Llama, Mistral, Qwen2) whose weights,
  # shapes and name replace the ones below (launch/serve.py --model_dir=DIR sets it);
  # empty: random weights of these shapes from `seed`. `dtype` is used either way.
  # scan_layers: the layers run under a scan over stacked weights (one layer compiled per
  # step; on XLA:CPU each step then copies every layer's weights out of the stack, which
  # measured ~15% slower decode on SmolLM2-135M); False: a Python loop of layer modules.
  c.model = ml_collections.ConfigDict(dict(
      name="llama-tiny-random", model_dir="",
      vocab_size=512, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
      head_dim=32, mlp_dim=256, dtype="float32", scan_layers=True))
  c.cache = ml_collections.ConfigDict(dict(
      page_size=16, pages_per_shard=256, max_pages_per_seq=64, attention_chunk_pages=8,
      dtype="float32", attention_impl="auto"))
  # Prefill one page per step: every block's KV is then the same bits whether it was
  # computed in a prefill, in a decode, or reused (see BUILD.md, "Exactness").
  c.engine = ml_collections.ConfigDict(dict(
      max_seqs_per_shard=2, prefill_chunk_pages=1, cache_decode_blocks=True))
  # Lower tiers are off by default; `--host_pages`, `--disk_dir` (launch/serve.py) or
  # --config.tiers.* turn them on.
  c.tiers = ml_collections.ConfigDict(dict(
      host_pages_per_shard=0, host_memory_kind="pinned_host", disk_kvstore="", disk_pages=0,
      write_policy="write_back", read_deadline_s=10.0, encryption="auto",
      # A hybrid model's (Gemma 3's) kept sliding windows evicted from the device: host
      # memory for this many of their blocks per data shard (0: none).
      host_window_pages_per_shard=0,
      # ... and each finished sequence's last window stored in the pool and on the disk
      # too (False: those tiers hold the global layers only); the disk's window records
      # (0: as many as disk_pages).
      store_windows=True, disk_window_pages=0,
      # KV events for a router (--kv_events, --kv_events_replay; '' publishes none). They
      # tell anyone who connects every tenant's blocks: bind loopback or a private address.
      kv_events="", kv_events_replay="", kv_events_topic="", kv_events_tokens=True,
      kv_events_raw_tokens=False))
  # Sequences longer than a device pool holds (prompt + max_tokens past max_pages_per_seq
  # x page_size): with `enabled` (--stream_long_contexts) they are served by streaming
  # their cold pages from the host tier through attention, `sink_pages` and the last
  # `window_pages` staying on device, up to `max_cold_pages` host pages per sequence
  # (needs --host_pages); off, they are refused. See jaxkv.StreamConfig.
  c.stream = ml_collections.ConfigDict(dict(
      enabled=False, sink_pages=1, window_pages=8, chunk_pages=4, max_cold_pages=4096,
      source="host"))
  # How lower-tier hits come back, `decision`: "cost" plans fetch / recompute / split from
  # costs calibrated at start-up (see jaxkv.SchedulerConfig for the other decisions).
  # `policy` is decision's former name, kept unset so that an old command line's
  # --config.scheduler.policy=X still parses: it sets decision, with a warning.
  c.scheduler = ml_collections.ConfigDict(dict(
      decision="cost", threshold_tokens=256, probe_every=4, probe_blocks=4,
      policy=ml_collections.config_dict.placeholder(str)))
  # `kind` picks the workload; each kind reads its own section. --trace=FILE.jsonl
  # (launch/serve.py) replays recorded requests instead.
  c.workload = ml_collections.ConfigDict(dict(
      kind="chat",
      chat=ml_collections.ConfigDict(dict(
          users=8, turns=4, system_prompt_tokens=128, user_tokens=(32, 96),
          max_new_tokens=16)),
      rag=ml_collections.ConfigDict(dict(
          requests=8, rounds=4, num_docs=6, doc_tokens=128, docs_per_request=2,
          system_prompt_tokens=64, question_tokens=(8, 24), max_new_tokens=16)),
      agent=ml_collections.ConfigDict(dict(
          agents=4, steps=6, system_prompt_tokens=128, tool_tokens=(32, 96),
          max_new_tokens=16)),
      trace=ml_collections.ConfigDict(dict(path=""))))
  return c

