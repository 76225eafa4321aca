"""Flags that every serving script takes (launch/serve.py, launch/server.py): the config,
the tiers, the checkpoint, the model directory and the deployment key, with the steps that
read them, so a flag means the same thing in every script."""

import os

from absl import app, flags
from ml_collections import config_flags

import _common

CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs",
                           "cpu_tiny.py"), "Config file (see configs/); fields can be overridden, "
    "e.g. --config.workload.chat.turns=6.")
# The shortcut flags, each an alias of one --config field (apply_tier_flags sets it). What
# follows from a value (a sequence's page cap within its pool, a disk tier's default
# capacity) is builder's config building, whichever flag set it.
DEVICE_PAGES = flags.DEFINE_integer(
    "device_pages", None, "Alias of --config.cache.pages_per_shard: device pages per data "
    "shard (a sequence's cap, cache.max_pages_per_seq, is lowered to fit).", lower_bound=1)
HOST_PAGES = flags.DEFINE_integer(
    "host_pages", None, "Alias of --config.tiers.host_pages_per_shard: host-memory pages per "
    "data shard (0 = no host tier).", lower_bound=0)
DISK_DIR = flags.DEFINE_string(
    "disk_dir", None, "Alias of --config.tiers.disk_kvstore: directory of the disk tier "
    "(enables it; '' disables it).")
DISK_PAGES = flags.DEFINE_integer(
    "disk_pages", None, "Alias of --config.tiers.disk_pages: the disk tier's capacity in "
    "blocks (a disk tier given none gets 4096).", lower_bound=1)
POOL = flags.DEFINE_string(
    "pool", None, "Alias of --config.tiers.pool_master: HOST:PORT of a Mooncake Store master. "
    "Blocks are also put in, and fetched from, the pool of memory every node lends (the POOL "
    "tier, between host and disk); each process lends --pool_segment_mb of its memory.")
POOL_METADATA = flags.DEFINE_string(
    "pool_metadata", None, "Alias of --config.tiers.pool_metadata: URL of the master's HTTP "
    "metadata server (default http://<--pool's host>:8080/metadata).")
POOL_SEGMENT_MB = flags.DEFINE_integer(
    "pool_segment_mb", None, "Alias of --config.tiers.pool_segment_mb: MiB of this process's "
    "memory lent to the pool (default 256; 0 lends none).", lower_bound=0)
ROLE = flags.DEFINE_enum(
    "role", "both", ["both", "prefill", "decode"], "Disaggregated serving through the pool "
    "(launch/server.py; needs --pool): 'prefill' answers every request with its prompt's KV "
    "in the pool and kv_transfer_params for a decode node (it writes through, every block "
    "soft-pinned); 'decode' takes requests whose kv_transfer_params say do_remote_prefill "
    "(and any other); 'both' does either per request, as its kv_transfer_params ask.")
KV_EVENTS = flags.DEFINE_string(
    "kv_events", None, "Alias of --config.tiers.kv_events: publish KV events (which blocks "
    "this replica holds, in which medium) on this ZeroMQ endpoint, in vLLM's format, for a "
    "router to read (Dynamo's KV indexer; launch/router.py), e.g. tcp://127.0.0.1:5557, or "
    "a private address only the router's hosts reach. Anyone who connects reads it with no "
    "key: which blocks every tenant holds and their token ids (mapped per tenant; without "
    "a deployment key anyone who knows a tenant's name maps them back; "
    "--config.tiers.kv_events_tokens=false: hashes only); a non-loopback address logs "
    "INSECURE. In a multi-process job process 0 publishes.")
KV_EVENTS_REPLAY = flags.DEFINE_string(
    "kv_events_replay", None, "Alias of --config.tiers.kv_events_replay: the endpoint of the "
    "replay socket a reader asks for the KV event messages it missed, e.g. "
    "tcp://127.0.0.1:5558; it answers anyone the stream's past messages (bind it like "
    "--kv_events).")
STREAM = flags.DEFINE_bool(
    "stream_long_contexts", None, "Alias of --config.stream.enabled: serve sequences longer "
    "than a device pool holds by streaming their cold pages from the host tier (needs "
    "--host_pages); off, they are refused.")
STREAM_WINDOW_PAGES = flags.DEFINE_integer(
    "stream_window_pages", None, "Alias of --config.stream.window_pages: a streamed "
    "sequence's most recent pages kept on device.", lower_bound=1)
STREAM_MAX_COLD_PAGES = flags.DEFINE_integer(
    "stream_max_cold_pages", None, "Alias of --config.stream.max_cold_pages: the most host "
    "pages one streamed sequence may hold.", lower_bound=1)
ALIASES = ((DEVICE_PAGES, "cache.pages_per_shard"), (HOST_PAGES, "tiers.host_pages_per_shard"),
           (DISK_DIR, "tiers.disk_kvstore"), (DISK_PAGES, "tiers.disk_pages"),
           (POOL, "tiers.pool_master"), (POOL_METADATA, "tiers.pool_metadata"),
           (POOL_SEGMENT_MB, "tiers.pool_segment_mb"), (KV_EVENTS, "tiers.kv_events"),
           (KV_EVENTS_REPLAY, "tiers.kv_events_replay"), (STREAM, "stream.enabled"),
           (STREAM_WINDOW_PAGES, "stream.window_pages"),
           (STREAM_MAX_COLD_PAGES, "stream.max_cold_pages"))
CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Save the cache here (Orbax) when the run ends.")
RESTORE = flags.DEFINE_bool("restore", False, "Start from the latest checkpoint in "
                            "--checkpoint_dir (a warm restart); with none there yet, start "
                            "cold with a warning.")
REQUIRE_RESTORE = flags.DEFINE_bool("require_restore", False, "With --restore: refuse to "
                                    "start (before compiling) when there is no checkpoint.")
MODEL_DIR = flags.DEFINE_string(
    "model_dir", None, "Serve this Hugging Face checkpoint (Llama, Mistral, Qwen2), or a "
    ".gguf file of a Llama-family model, instead of the config's random weights: its shapes "
    "replace the config's model section; text prompts need its tokenizer (tokenizer.json, "
    "or the GGUF file's own).")
SPECIAL_TOKENS_IN_CONTENT = flags.DEFINE_enum(
    "special_tokens_in_content", "parse", ["parse", "split"], "Chat: special-token text "
    "inside a message (e.g. '<|im_end|>') becomes those tokens ('parse', as vLLM and "
    "transformers do: a user can write other roles' turns), or plain text ('split').")
DEPLOYMENT_KEY_FILE = flags.DEFINE_string(
    "deployment_key_file", None, "File (mode 600) holding the deployment key: 32+ random "
    "bytes as hex or base64 (head -c 32 /dev/urandom | base64). It keys tenants' block keys, "
    "MACs (and by default encrypts) every block that leaves the process and authenticates "
    "remote peers; default $JAXKV_DEPLOYMENT_KEY_FILE or $JAXKV_DEPLOYMENT_KEY. Give every "
    "process sharing a store or peer the same key.")


def check_restore_flags() -> None:
  """Refuses, before JAX starts, restore flags that cannot go together."""
  if RESTORE.value and not CHECKPOINT_DIR.value:
    raise app.UsageError("--restore needs --checkpoint_dir=DIR (where the checkpoints are).")
  if REQUIRE_RESTORE.value and not RESTORE.value:
    raise app.UsageError("--require_restore goes with --restore.")
  _common.check_output(CHECKPOINT_DIR.value, "checkpoint_dir", directory=True)


def should_restore() -> bool:
  """Whether to restore: --restore and a finished checkpoint (without one, start cold with
  a warning, or refuse under --require_restore)."""
  from absl import logging
  from jaxkv.worker.checkpoint import latest_step
  if not RESTORE.value:
    return False
  if latest_step(CHECKPOINT_DIR.value) is None:
    if REQUIRE_RESTORE.value:
      raise app.UsageError(f"--require_restore: no finished checkpoint in "
                           f"{CHECKPOINT_DIR.value}; drop the flag to start cold.")
    logging.warning("no finished checkpoint in %s yet: starting cold (it is written when "
                    "this run ends)", CHECKPOINT_DIR.value)
    return False
  return True


def use_model_dir(cfg, tokenizer: bool = True):
  """Points the config at --model_dir (or the config's model.model_dir) and fits its
  defaults to the platform (``builder.platform_defaults``: dtype, mesh and prefill chunk
  on CPU; a ``--config.*`` override always wins), logging each choice; returns the
  tokenizer, or None (random weights, a checkpoint without tokenizer.json, or
  ``tokenizer=False``: an engine core, whose front tokenizes)."""
  import jax
  from absl import logging
  from jaxkv.tools import builder
  model_dir = MODEL_DIR.value or cfg.model.get("model_dir", "")
  if not model_dir:
    return None
  builder.use_model_dir(cfg, model_dir)
  explicit = config_flags.get_override_values(flags.FLAGS[CONFIG.name])
  for line in builder.platform_defaults(cfg, platform=jax.default_backend(),
                                        explicit=explicit, processes=jax.process_count()):
    logging.info("%s: %s", os.path.basename(os.path.normpath(model_dir)), line)
  return load_tokenizer(cfg) if tokenizer else None


def load_tokenizer(cfg):
  """The tokenizer of --model_dir (or the config's model.model_dir), or None: random
  weights, or a checkpoint without tokenizer.json. Needs no device."""
  model_dir = MODEL_DIR.value or cfg.model.get("model_dir", "")
  if not model_dir:
    return None
  from jaxkv.models import gguf
  if (not os.path.exists(os.path.join(model_dir, "tokenizer.json"))
      and gguf.find(model_dir) is None):
    return None
  from jaxkv.entrypoints.openai.tokenizer import Tokenizer
  return Tokenizer.from_dir(model_dir,
                            special_tokens_in_content=SPECIAL_TOKENS_IN_CONTENT.value)


def _available_mb() -> int | None:
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) // 1024
  except OSError:
    pass
  return None


def check_pool(cfg) -> None:
  """A pool tier the config names: its client loads, the master and its metadata server
  answer, and the segment fits in free memory (else InputError naming the flag and the
  fix). Called right after ``_common.start_jax`` (importing jaxkv imports JAX, whose flags
  start_jax sets first), before any model is loaded or compiled."""
  tiers = cfg.get("tiers", {})
  master = tiers.get("pool_master") or None
  if master is None:
    return
  from jaxkv.worker.tiers.pool import check_reachable, native
  native.load_store()
  check_reachable(master, tiers.get("pool_metadata") or None)
  segment = int(tiers.get("pool_segment_mb", 256))
  free = _available_mb()
  if free is not None and segment > free:
    from jaxkv.errors import InputError
    raise InputError(f"--pool_segment_mb={segment} is more than this machine's free memory "
                     f"({free} MiB available): lend less.")


def apply_role(cfg) -> None:
  """--role: refused without a pool; a prefill node writes every block through to it."""
  if ROLE.value == "both":
    return
  if not (cfg.get("tiers", {}).get("pool_master") or None):
    raise app.UsageError(f"--role={ROLE.value} hands KV over through the pool: give "
                         "--pool=HOST:PORT (a Mooncake master) too.")
  if ROLE.value == "prefill":
    with cfg.unlocked():
      cfg.tiers.write_policy = "write_through"


def apply_tier_flags(cfg) -> None:
  """Sets the ``--config`` field each shortcut flag given is an alias of (``ALIASES``), and
  nothing else; refuses a shortcut given with its ``--config.*`` field at another value."""
  overrides = config_flags.get_override_values(flags.FLAGS[CONFIG.name])
  for holder, field in ALIASES:
    if holder.value is None:
      continue
    if field in overrides and overrides[field] != holder.value:
      raise app.UsageError(
          f"--{holder.name}={holder.value} and --config.{field}={overrides[field]} set the same "
          f"field to different values (--{holder.name} is an alias of --config.{field}); "
          "give one of them.")
    section, name = field.split(".")
    with cfg.unlocked():
      if section not in cfg:
        cfg[section] = {}
      setattr(cfg[section], name, holder.value)
