"""Frozen, validated configuration for the cache and the engine.

A config is plain data: frozen ``kw_only`` dataclasses checked in ``__post_init__``.
Every check raises ``ValueError`` naming the field, the value it got, the rule it broke
and how to fix it, so a bad launch fails at its first line rather than deep in a jit.
Library code never reads flags; launch scripts build these objects from flags/configs.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import hashlib
import json
import re
import sys
import types
import warnings

import ml_dtypes
import numpy as np

from jaxkv.errors import InputError

# The dtypes a page pool may hold. Names, not objects, so configs stay JSON-friendly.
SUPPORTED_DTYPES = ("bfloat16", "float16", "float32")
# Each name's NumPy dtype, the object JAX uses for it (bfloat16 is ml_dtypes'), known
# without importing JAX: host-only modules read configs too.
_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
           "float32": np.dtype(np.float32)}

# Version of the page layout written into every fingerprint. Bump it when the meaning
# of a page's bytes changes, so caches written by an older layout are never reused.
LAYOUT_VERSION = "khpsd-v1"  # per layer: [kv_heads, num_pages, page_size, head_dim]
ATTENTION_IMPLS = ("auto", "jnp", "pallas_gpu", "pallas_tpu")


def resolve_attention_impl(impl: str) -> str:
  """What ``auto`` runs: the jnp path on every backend today. jaxkv's Pallas kernel is
  checked against the reference in Pallas' interpreter only; ``auto`` moves to it on a
  backend once it has been compiled and measured on that hardware."""
  return "jnp" if impl == "auto" else impl


def _require(ok: bool, message: str) -> None:
  if not ok:
    raise InputError(message)


def _positive_int(obj, name: str) -> None:
  value = getattr(obj, name)
  _require(
      isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0,
      f"{type(obj).__name__}.{name}={value!r} must be a positive integer; "
      f"pass e.g. {name}=16.",
  )


# The fields of a CacheConfig that are the model's shapes, read from it (``model_shapes``)
# rather than restated: ``CacheConfig.for_model`` fills them, and a cache whose fields
# differ from its model's is refused when it is attached (``check_fits_model``).
MODEL_SHAPES = ("num_layers", "num_kv_heads", "head_dim")
# A model with a window group (sliding-window layers whose pages the cache keeps only while
# a window needs them) declares these too; ``for_model`` reads them like the shapes.
WINDOW_SHAPES = ("window_layers", "sliding_window")


def _declares_shapes(obj) -> bool:
  return obj is not None and all(hasattr(obj, name) for name in MODEL_SHAPES)


def model_shapes(model_or_config) -> dict:
  """``num_layers``, ``num_kv_heads``, ``head_dim`` and ``model_name`` of a model (and its
  ``dtype`` when it declares one of ``SUPPORTED_DTYPES``), as ``CacheConfig`` names them.

  Read, in this order, from: an object that has the three shape attributes itself (a model
  config such as ``jaxkv.models.LlamaConfig``, an ``ml_collections`` model section; a plain
  mapping with those keys); a model's config attribute (``config`` or ``cfg``, as
  ``jaxkv.models.Llama`` has); else the ``jaxkv.nnx.PagedKV`` layers of an NNX model (their
  count, kv heads and head_dim, which every layer must share). ``model_name``: the
  source's ``model_name`` or ``name`` when it has one, else its class name (less a
  ``Config`` suffix: ``LlamaConfig`` and ``Llama`` both give ``"Llama"``)."""
  src = model_or_config
  if isinstance(src, collections.abc.Mapping):
    src = types.SimpleNamespace(**src)
  if not _declares_shapes(src):
    src = next((c for c in (getattr(src, "config", None), getattr(src, "cfg", None))
                if _declares_shapes(c)), None)
  if src is None:
    # An NNX model: its PagedKV layers say (``jaxkv.nnx.layer_shapes``). jaxkv.nnx imports
    # this module, so it is looked up here, never imported: a model can hold PagedKV layers
    # only once jaxkv.nnx has been imported.
    kvnnx = sys.modules.get("jaxkv.nnx")
    _require(kvnnx is not None, no_shapes(model_or_config))
    return {**kvnnx.layer_shapes(model_or_config),
            "model_name": _model_name(model_or_config, model_or_config)}
  out = {name: getattr(src, name) for name in MODEL_SHAPES}
  local = getattr(src, "window_layers", 0)
  if isinstance(local, int) and local > 0:  # a window group (jaxkv.models.Gemma3Config)
    out["num_layers"] -= local
    out["window_layers"], out["sliding_window"] = local, src.sliding_window
  dtype = getattr(src, "dtype", None)
  if isinstance(dtype, str) and dtype in SUPPORTED_DTYPES:
    out["dtype"] = dtype
  out["model_name"] = _model_name(src, model_or_config)
  return out


def no_shapes(model) -> str:
  """Why ``model`` has no shapes to read, and what to give instead."""
  return (f"the model {type(model).__name__} has no jaxkv.nnx.PagedKV layers (its attention "
          "must keep K/V in one) and no config attribute (config or cfg) with num_layers, "
          "num_kv_heads and head_dim: give a model config (e.g. jaxkv.models.LlamaConfig) or "
          "an NNX model whose attention layers hold jaxkv.nnx.PagedKV.")


def _model_name(src, model) -> str:
  for obj in (src, model):
    for attr in ("model_name", "name"):
      name = getattr(obj, attr, None)
      if isinstance(name, str) and name.strip():
        return name
  name = type(src).__name__
  return name[:-len("Config")] if name.endswith("Config") and name != "Config" else name


def check_fits_model(config: CacheConfig, model) -> None:
  """Refuses (``InputError``) a cache whose shapes (``MODEL_SHAPES``) are not ``model``'s
  (read as ``model_shapes`` reads them), naming each field that differs, both values and the
  fix. ``KVCache.attach`` calls it, before any page is allocated."""
  have = {"window_layers": 0, "sliding_window": 0, **model_shapes(model)}
  bad = [f"CacheConfig.{name}={getattr(config, name)!r} but the model has {name}={have[name]!r}"
         for name in (*MODEL_SHAPES, *WINDOW_SHAPES) if getattr(config, name) != have[name]]
  _require(not bad,
           "; ".join(bad) + ": a cache's pages hold its model's K/V, so its shapes are the "
           "model's. Build it from the model: CacheConfig.for_model(model, page_size=..., "
           "pages_per_shard=...) reads them and takes only the budgets.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
  """Shape and budget of the sharded, paged KV cache.

  Units: a *page* (a block) holds ``page_size`` tokens of K and V for every layer.
  ``pages_per_shard`` is the device budget of one data shard; every data shard owns
  its own pool and numbers its pages ``0 .. pages_per_shard-1`` (shard-local ids).
  ``max_pages_per_seq`` bounds one sequence (prompt + generated tokens).
  ``attention_chunk_pages``: attention walks a sequence's pages in chunks of this many
  (online softmax), so its memory is one chunk and its result does not depend on the
  page-table width (see ``jaxkv.ops.paged_attention``).
  ``window_layers``, ``sliding_window``: a model's window group (``jaxkv.nnx.PagedKV(window=
  W)``: Gemma 3's local layers), read from the model like the shapes; ``num_layers`` then
  counts the other layers, the ones a block holds. The window group has its own device pool,
  ``window_pages_per_shard`` pages per shard (0: sized by the engine for its running
  sequences), which keeps only what windows need (``jaxkv.manager.windows``); of the tiers
  below, host memory holds its blocks (``TierConfig.host_window_pages_per_shard``) and the
  pool each finished sequence's last window.
  ``window_copy_slots``: most window pages copied per shard in one
  order (one compiled shape; 0: sized by the engine).
  ``attention_impl``: which implementation attends (``ATTENTION_IMPLS``): ``jnp`` (the
  chunked jnp path), ``pallas_gpu`` / ``pallas_tpu`` (jaxkv's Pallas kernel in its GPU or
  TPU form; Pallas' interpreter off that hardware), ``auto`` (``resolve_attention_impl``).
  Implementations may differ in the last bits, and those bits reach later layers' K/V, so
  the resolved choice is part of the fingerprint when it is not ``jnp``: blocks of one
  never mix with another's.
  """

  model_name: str
  num_layers: int
  num_kv_heads: int
  head_dim: int
  page_size: int = 16
  dtype: str = "float32"
  pages_per_shard: int = 256
  max_pages_per_seq: int = 64
  attention_chunk_pages: int = 8
  attention_impl: str = "auto"
  data_axis: str = "data"
  model_axis: str = "model"
  # The model's structure and weights (``jaxkv.identity.weights_digest``), part of the
  # fingerprint: "" = computed from the model when an engine attaches it to the cache.
  weights_digest: str = ""
  window_layers: int = 0
  sliding_window: int = 0
  window_pages_per_shard: int = 0
  window_copy_slots: int = 0

  def __post_init__(self):
    _require(
        isinstance(self.weights_digest, str) and not any(c.isspace() for c in self.weights_digest),
        f"CacheConfig.weights_digest={self.weights_digest!r} must be a string without spaces "
        "(a hash of the weights), or '' to compute it from the model.",
    )
    _require(
        isinstance(self.model_name, str) and self.model_name.strip() != "",
        f"CacheConfig.model_name={self.model_name!r} must be a non-empty string: it is part "
        "of every block key, so caches of different models never mix. Pass the model's name.",
    )
    for name in ("num_layers", "num_kv_heads", "head_dim", "page_size", "pages_per_shard",
                 "max_pages_per_seq", "attention_chunk_pages"):
      _positive_int(self, name)
    for name in ("window_layers", "sliding_window", "window_pages_per_shard",
                 "window_copy_slots"):
      v = getattr(self, name)
      _require(isinstance(v, int) and not isinstance(v, bool) and v >= 0,
               f"CacheConfig.{name}={v!r} must be an integer >= 0.")
    _require((self.window_layers > 0) == (self.sliding_window > 0),
             f"CacheConfig window_layers={self.window_layers} and sliding_window="
             f"{self.sliding_window} must be set together (a model's window group) or both 0.")
    _require(self.attention_impl in ATTENTION_IMPLS,
             f"CacheConfig.attention_impl={self.attention_impl!r} must be one of "
             f"{ATTENTION_IMPLS}.")
    _require(
        self.dtype in SUPPORTED_DTYPES,
        f"CacheConfig.dtype={self.dtype!r} is not supported; use one of {SUPPORTED_DTYPES}.",
    )
    _require(
        self.max_pages_per_seq <= self.pages_per_shard,
        f"CacheConfig.max_pages_per_seq={self.max_pages_per_seq} exceeds "
        f"pages_per_shard={self.pages_per_shard}: one sequence could never fit in a shard's "
        "pool. Raise pages_per_shard or lower max_pages_per_seq.",
    )
    _require(
        isinstance(self.data_axis, str) and isinstance(self.model_axis, str)
        and self.data_axis and self.model_axis and self.data_axis != self.model_axis,
        f"CacheConfig axis names data_axis={self.data_axis!r}, model_axis={self.model_axis!r} "
        "must be two different non-empty strings, e.g. 'data' and 'model'.",
    )

  @classmethod
  def for_model(cls, model_or_config, **budgets) -> CacheConfig:
    """A cache for a model: ``num_layers``, ``num_kv_heads``, ``head_dim``, ``model_name``
    and, when the model declares one, ``dtype`` read from ``model_or_config`` (a model
    config such as ``jaxkv.models.LlamaConfig``, or an NNX model: see ``model_shapes``);
    ``budgets`` give every other field (``page_size``, ``pages_per_shard``,
    ``max_pages_per_seq``, ...) and may replace ``model_name`` or ``dtype``. The shapes
    themselves are the model's only: naming one here is refused."""
    restated = [name for name in (*MODEL_SHAPES, *WINDOW_SHAPES) if name in budgets]
    _require(not restated,
             f"CacheConfig.for_model reads {', '.join(restated)} from the model; drop "
             f"{', '.join(f'{n}={budgets[n]!r}' for n in restated)} from its arguments.")
    return cls(**{**model_shapes(model_or_config), **budgets})

  # ---- derived -------------------------------------------------------------------------
  @property
  def jnp_dtype(self) -> np.dtype:
    """The pool's dtype as JAX takes it (``jnp.dtype(self.dtype)``, the same object)."""
    return _DTYPES[self.dtype]

  @property
  def max_seq_len(self) -> int:
    """The most tokens (prompt + generated) one sequence can hold."""
    return self.max_pages_per_seq * self.page_size

  @property
  def has_windows(self) -> bool:
    """Whether the model has a window group (``window_layers``)."""
    return self.window_layers > 0

  @property
  def window_page_bytes(self) -> int:
    """Bytes of one window-group page: K and V of its layers for ``page_size`` tokens."""
    return (2 * self.window_layers * self.num_kv_heads * self.page_size * self.head_dim
            * self.jnp_dtype.itemsize)

  @property
  def page_bytes(self) -> int:
    """Bytes of one block: K and V of ``page_size`` tokens for all layers and kv heads (the
    window group's layers are not in a block)."""
    return (2 * self.num_layers * self.num_kv_heads * self.page_size * self.head_dim
            * self.jnp_dtype.itemsize)

  def fingerprint(self) -> bytes:
    """SHA-256 over everything that decides what a page's bytes mean.

    Parallelism (mesh shape, shard count) is deliberately *not* part of it: a block's
    content does not depend on how the pool is sharded, so caches stay reusable across
    layouts (restart onto another mesh, different tensor-parallel sizes).
    """
    meta = {
        "model_name": self.model_name,
        "dtype": self.dtype,
        "layout": LAYOUT_VERSION,
        "page_size": self.page_size,
        "num_layers": self.num_layers,
        "num_kv_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "weights": self.weights_digest,
    }
    if self.window_layers:  # (caches without a window group keep their fingerprints)
      meta["window"] = [self.window_layers, self.sliding_window]
    impl = resolve_attention_impl(self.attention_impl)
    if impl != "jnp":  # the jnp path's fingerprints stay those of earlier versions
      meta["attention"] = impl
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).digest()


BATCHING = ("continuous", "static")
MAX_LOGPROBS = 20  # most likely tokens reported per position (OpenAI's limit)
# Log-probability entries (a token's own and each alternative: positions x (logprobs + 1))
# one request's answer may hold, echoed prompts and every choice counted: about 40 bytes of
# JSON each, so an answer stays under ~5 MiB however the request multiplies them (a batch of
# prompts with echo and logprobs=20 once asked 157x its own size). lm-eval's scoring
# (echo, logprobs=1, one prompt of up to 64k tokens) stays well under it.
MAX_LOGPROB_ENTRIES = 1 << 17
# Above this, sampling is uniform to float32 precision anyway (logits / T ~ 0).
MAX_TEMPERATURE = 1e4


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
  """How the engine batches work.

  ``max_seqs_per_shard``: sequences one data shard runs together in a step (the batch
  is ``data_shards * max_seqs_per_shard`` rows, bucketed to powers of two).
  ``prefill_chunk_pages``: prefill runs in block-aligned chunks of this many pages, so a
  block's KV is produced by the same computation whether or not a prefix was cached.
  ``prefix_reuse``: False gives the no-cache baseline (every prompt is recomputed).
  ``cache_decode_blocks``: also publish blocks that filled up during decode, so a later
  turn of a conversation reuses the previous answer too.
  ``batching``: ``continuous`` (default) runs every step over whatever sequences are
  running: a request joins as soon as a row and its pages are free and leaves the step it
  finishes; ``static`` admits only into an empty batch: requests run in waves, the next
  wave admitted once the last request of this one has finished (the same step loop; for
  comparison and offline use).
  """

  max_seqs_per_shard: int = 4
  prefill_chunk_pages: int = 4
  prefix_reuse: bool = True
  cache_decode_blocks: bool = True
  batching: str = "continuous"

  def __post_init__(self):
    for name in ("max_seqs_per_shard", "prefill_chunk_pages"):
      _positive_int(self, name)
    for name in ("prefix_reuse", "cache_decode_blocks"):
      _require(isinstance(getattr(self, name), bool),
               f"EngineConfig.{name}={getattr(self, name)!r} must be True or False.")
    _require(self.batching in BATCHING,
             f"EngineConfig.batching={self.batching!r} must be one of {BATCHING}.")


WRITE_POLICIES = ("write_back", "write_through")
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
REMOTE_TRANSPORTS = ("inline", "transfer")
POOL_PROTOCOLS = ("tcp", "rdma")
ENCRYPTION = ("auto", "on", "off")


_ENDPOINT = re.compile(r"^(tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5}|\*)"
                       r"|ipc://.+)$")


def check_endpoint(value: str, flag: str) -> str:
  """``value`` if it is a ZeroMQ endpoint a publisher can bind (``tcp://HOST:PORT``,
  ``tcp://*:PORT``, ``ipc://PATH``), else an ``InputError`` naming ``flag``."""
  if not isinstance(value, str) or not _ENDPOINT.match(value):
    raise InputError(f"{flag}={value!r} is not an endpoint to publish on; give "
                     "tcp://127.0.0.1:5557 (or a private address only the router's hosts "
                     "reach: the stream tells every tenant's blocks and takes no key) or "
                     "ipc://PATH.")
  return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierConfig:
  """The tiers below device memory.

  ``host_pages_per_shard``: pages of host memory (``host_memory_kind``) per data shard, in
  the device pool's layout and sharding; 0 disables the host tier.
  ``host_window_pages_per_shard``: for a model with a window group (sliding-window layers,
  ``CacheConfig.window_layers``), host memory for that group's kept blocks, in blocks per
  data shard: a kept block evicted from the device's window pool keeps a copy there, and a
  hit whose window is there loads it back (``jaxkv.manager.windows``). 0: none (such a
  hit recomputes the window). A block of it holds only the window layers' K and V.
  ``disk_kvstore``: where the disk tier lives: a directory path, or any TensorStore kvstore
  spec (``{"driver": "file", "path": ...}``, ``{"driver": "memory"}``, gcs, s3, ...); None
  disables it. ``disk_pages``: its capacity in blocks (shared by all shards of a process).
  ``disk_queue_mb``: disk writes in flight (issued, not yet committed: each holds its
  block's bytes) are bounded to this many MiB; a write that would pass it is not issued but
  dropped and counted (``disk_writes_dropped``), so a store slower than the evictions never
  delays a step (one write is always let through when none is in flight). In a job every
  process counts every process's writes against it.
  ``store_windows``: for a model with a window group, whether each finished sequence's last
  window (the window layers' K and V of the blocks before its end) is stored in the pool
  and on the disk too, where another engine on them, or this one after a restart, loads it
  for a hit past the window edge (``jaxkv.manager.windows``). False: neither holds any
  window, and such hits recompute past the edge (the links carry only the global layers).
  ``disk_window_pages``: the disk's window records this process keeps, in blocks (each
  record holds the window layers only); 0 (the default): as many as ``disk_pages``.
  ``write_policy``: ``write_back`` copies a block down only when it is evicted from the
  tier above; ``write_through`` copies every block down as soon as it is published.
  ``read_deadline_s``: a lower-tier read that has not verified by then counts as a miss.
  ``remote_peers``: control addresses (``host:port``) of other jobs' ``BlockServer``s whose
  blocks this cache may pull (the REMOTE tier). ``remote_transport``: how their blocks
  travel: ``inline`` (in the answer to the request, over the same ZeroMQ connection) or
  ``transfer`` (a ``jax.experimental.transfer`` pull the answer offers).
  ``encryption``: whether blocks leaving the process (disk and object-store records, remote
  answers) are encrypted (AES-256-GCM) under the deployment key: ``auto`` (default) when a
  key is set, ``on`` (a key is required), ``off`` (keyed MACs only). See ``jaxkv.security``.
  ``pool_master``: ``host:port`` of a Mooncake Store master: blocks are also put in (and
  fetched from) the pool every node lends memory to (the POOL tier,
  ``jaxkv.worker.tiers.pool``); None disables it. ``pool_metadata``: the URL of its HTTP
  metadata server (default: the master's host, port 8080). ``pool_segment_mb``: host memory
  this process lends to the pool (0: it only borrows). ``pool_buffer_mb``: the client's
  local transfer buffer. ``pool_protocol``: ``tcp`` or ``rdma`` (``pool_rdma_devices`` names
  the NICs). ``pool_replicas``: copies of each block the pool keeps. ``pool_pin_s``: blocks
  reused before they are put are soft-pinned this long (0: never). ``pool_queue_mb``: puts
  waiting to be written; more are dropped (counted).
  ``kv_events``: a ZeroMQ endpoint (``tcp://HOST:PORT``) to publish KV events on, in vLLM's
  format (``jaxkv.manager.publisher``): a router learns which blocks this replica holds in
  which medium. ``kv_events_replay``: the endpoint of the replay socket a reader asks for
  messages it missed. ``kv_events_topic``: every message's first frame.
  ``kv_events_tokens``: send each block's token ids (a router that scores requests by their
  tokens needs them), each mapped under its tenant's salt so that a tenant's request matches
  only its own tenant's blocks (``launch/router.py`` maps requests the same way); False sends
  only hashes. ``kv_events_raw_tokens``: send the ids as vLLM does, unmapped (for a router
  that tokenizes text itself; it then reads every tenant's prompts: one tenant only).
  In a multi-process job process 0 publishes for the job.
  """

  host_pages_per_shard: int = 0
  host_memory_kind: str = "pinned_host"
  host_window_pages_per_shard: int = 0
  disk_kvstore: str | dict | None = None
  disk_pages: int = 0
  disk_queue_mb: int = 1024
  store_windows: bool = True
  disk_window_pages: int = 0
  write_policy: str = "write_back"
  read_deadline_s: float = 10.0
  remote_peers: tuple = ()
  remote_transport: str = "inline"
  encryption: str = "auto"
  pool_master: str | None = None
  pool_metadata: str | None = None
  pool_segment_mb: int = 256
  pool_buffer_mb: int = 64
  pool_protocol: str = "tcp"
  pool_rdma_devices: str = ""
  pool_replicas: int = 1
  pool_pin_s: float = 600.0
  pool_queue_mb: int = 256
  kv_events: str | None = None
  kv_events_replay: str | None = None
  kv_events_topic: str = ""
  kv_events_tokens: bool = True
  kv_events_raw_tokens: bool = False

  def __post_init__(self):
    for name in ("kv_events", "kv_events_replay"):
      if getattr(self, name):
        check_endpoint(getattr(self, name), f"TierConfig.{name}")
    _require(not self.kv_events_replay or self.kv_events,
             f"TierConfig.kv_events_replay={self.kv_events_replay!r} needs kv_events (the "
             "endpoint whose messages it replays).")
    _require(isinstance(self.kv_events_topic, str),
             f"TierConfig.kv_events_topic={self.kv_events_topic!r} must be a string.")
    for name in ("kv_events_tokens", "kv_events_raw_tokens", "store_windows"):
      _require(isinstance(getattr(self, name), bool),
               f"TierConfig.{name}={getattr(self, name)!r} must be True or False.")
    _require(self.pool_master is None or (
        isinstance(self.pool_master, str) and self.pool_master.rpartition(":")[2].isdigit()
        and self.pool_master.rpartition(":")[0]),
             f"TierConfig.pool_master={self.pool_master!r} must be 'host:port' (a Mooncake "
             "master's RPC address) or None.")
    _require(self.pool_metadata is None or isinstance(self.pool_metadata, str),
             f"TierConfig.pool_metadata={self.pool_metadata!r} must be a URL or None.")
    _require(self.pool_protocol in POOL_PROTOCOLS,
             f"TierConfig.pool_protocol={self.pool_protocol!r} must be one of {POOL_PROTOCOLS}.")
    for name in ("pool_segment_mb", "pool_queue_mb"):
      v = getattr(self, name)
      _require(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0,
               f"TierConfig.{name}={v!r} must be an integer >= 0.")
    for name in ("pool_buffer_mb", "pool_replicas"):
      v = getattr(self, name)
      _require(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1,
               f"TierConfig.{name}={v!r} must be an integer >= 1.")
    v = self.disk_queue_mb
    _require(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 1,
             f"TierConfig.disk_queue_mb={v!r} must be an integer >= 1 (MiB of disk writes in "
             "flight; to write no disk records, set disk_kvstore=None).")
    _require(isinstance(self.pool_pin_s, (int, float)) and not isinstance(self.pool_pin_s, bool)
             and self.pool_pin_s >= 0,
             f"TierConfig.pool_pin_s={self.pool_pin_s!r} must be a number of seconds >= 0.")
    _require(self.encryption in ENCRYPTION,
             f"TierConfig.encryption={self.encryption!r} must be one of {ENCRYPTION}.")
    _require(self.remote_transport in REMOTE_TRANSPORTS,
             f"TierConfig.remote_transport={self.remote_transport!r} must be one of "
             f"{REMOTE_TRANSPORTS}.")
    _require(isinstance(self.remote_peers, (tuple, list)) and all(
        isinstance(p, str) and ":" in p for p in self.remote_peers),
             f"TierConfig.remote_peers={self.remote_peers!r} must be a tuple of 'host:port' "
             "addresses of jaxkv block servers.")
    for name in ("host_pages_per_shard", "disk_pages", "host_window_pages_per_shard",
                 "disk_window_pages"):
      v = getattr(self, name)
      _require(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0,
               f"TierConfig.{name}={v!r} must be an integer >= 0 (0 disables the tier).")
    _require(self.host_memory_kind in HOST_MEMORY_KINDS,
             f"TierConfig.host_memory_kind={self.host_memory_kind!r} must be one of "
             f"{HOST_MEMORY_KINDS}.")
    _require(self.write_policy in WRITE_POLICIES,
             f"TierConfig.write_policy={self.write_policy!r} must be one of {WRITE_POLICIES}.")
    _require(self.disk_kvstore is None or isinstance(self.disk_kvstore, (str, dict)),
             f"TierConfig.disk_kvstore={self.disk_kvstore!r} must be a directory path, a "
             "TensorStore kvstore spec dict, or None.")
    _require((self.disk_kvstore is None) == (self.disk_pages == 0),
             f"TierConfig disk_kvstore={self.disk_kvstore!r} and disk_pages={self.disk_pages} "
             "must be set together: give both a location and a capacity, or neither.")
    _require(isinstance(self.read_deadline_s, (int, float)) and self.read_deadline_s > 0,
             f"TierConfig.read_deadline_s={self.read_deadline_s!r} must be a positive number "
             "of seconds.")

  @property
  def host_enabled(self) -> bool:
    return self.host_pages_per_shard > 0

  @property
  def disk_enabled(self) -> bool:
    return self.disk_pages > 0

  @property
  def pool_enabled(self) -> bool:
    return self.pool_master is not None


def renamed_fields(**renames: str):
  """Class decorator for a frozen config dataclass some of whose fields were renamed
  (``old="new"``): ``Cls(old=v)`` still builds ``Cls(new=v)`` and ``obj.old`` still reads
  ``obj.new``, each with a DeprecationWarning naming the new spelling, so a user's code
  keeps working while it moves. The old name is no field: ``dataclasses.fields``,
  ``asdict`` and ``repr`` show the new one only. Giving both spellings is refused."""

  def decorate(cls):
    init, name = cls.__init__, cls.__name__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
      for old, new in renames.items():
        if old in kwargs:
          _require(new not in kwargs,
                   f"{name} got {new}={kwargs.get(new)!r} and its former name "
                   f"{old}={kwargs[old]!r}; give {new} only.")
          warnings.warn(f"{name}({old}=) is deprecated: it is {name}({new}=).",
                        DeprecationWarning, stacklevel=2)
          kwargs[new] = kwargs.pop(old)
      init(self, *args, **kwargs)

    def alias(old, new):
      def get(self):
        warnings.warn(f"{name}.{old} is deprecated: it is {name}.{new}.", DeprecationWarning,
                      stacklevel=2)
        return getattr(self, new)
      return property(get, doc=f"Deprecated: ``{new}`` under its former name.")

    cls.__init__ = __init__
    for old, new in renames.items():
      setattr(cls, old, alias(old, new))
    return cls

  return decorate


# What SchedulerConfig.decision may be. SCHEDULER_POLICIES is its former name.
SCHEDULER_DECISIONS = ("cost", "fetch", "recompute", "threshold", "split")
SCHEDULER_POLICIES = SCHEDULER_DECISIONS


@renamed_fields(policy="decision")
@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
  """How cached blocks in lower tiers come back.

  ``decision``: how the fetch-or-recompute decision is made. ``cost`` (default) lets the
  jitted plan choose fetch / recompute / split from measured costs; ``fetch`` always
  fetches; ``recompute`` always recomputes; ``threshold`` fetches only when at least
  ``threshold_tokens`` tokens are cached below device (what common peers do); ``split``
  forces the split ``force_split`` blocks after the hot prefix (tests and experiments).
  Its former name ``policy`` still works, with a DeprecationWarning ("policy" also named
  the router's routing, the serve run's cache and the scheduler's batching).
  ``inflight_blocks``: most blocks one shard fetches at once (0: no limit).
  ``cost_model_path``: a calibrated CostModel JSON to load instead of calibrating.
  ``probe_every``: under ``cost``, after this many requests whose plan recomputed blocks
  a link holds without that link being timed, the next such request fetches its last
  ``probe_blocks`` blocks (recomputing the rest beside them) to time the link again: a link
  the plan stopped using after it was slow is otherwise never timed again, and never used
  again if it gets faster. 0: never probe.
  """

  decision: str = "cost"
  threshold_tokens: int = 256
  force_split: int = 0
  inflight_blocks: int = 0
  cost_model_path: str | None = None
  probe_every: int = 4
  probe_blocks: int = 4

  def __post_init__(self):
    _require(self.decision in SCHEDULER_DECISIONS,
             f"SchedulerConfig.decision={self.decision!r} must be one of "
             f"{SCHEDULER_DECISIONS}.")
    for name in ("threshold_tokens", "force_split", "inflight_blocks", "probe_every",
                 "probe_blocks"):
      v = getattr(self, name)
      _require(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v >= 0,
               f"SchedulerConfig.{name}={v!r} must be an integer >= 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StreamConfig:
  """Sequences longer than a device pool holds: which pages stay on device, how the rest
  is streamed from the host tier.

  ``sink_pages``: the first pages of the sequence stay on device (attention sinks, a
  system prompt); ``window_pages``: the most recent pages stay on device; every page in
  between lives in host memory and is streamed through attention ``chunk_pages`` at a
  time, at most two chunks per layer in flight (the device staging budget).
  ``max_cold_pages``: the most host pages one sequence may hold.
  ``source``: where cold pages live between steps: ``host`` keeps them in host slots;
  ``disk`` writes them to the disk tier and reads them back into host slots for each step
  (host memory is held only while a step runs).
  """

  sink_pages: int = 1
  window_pages: int = 8
  chunk_pages: int = 4
  max_cold_pages: int = 4096
  source: str = "host"

  def __post_init__(self):
    _require(self.source in ("host", "disk"),
             f"StreamConfig.source={self.source!r} must be 'host' or 'disk'.")
    for name in ("window_pages", "chunk_pages", "max_cold_pages"):
      _positive_int(self, name)
    _require(isinstance(self.sink_pages, int) and self.sink_pages >= 0,
             f"StreamConfig.sink_pages={self.sink_pages!r} must be an integer >= 0.")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
  """How one request's tokens are chosen and when it stops.

  ``max_new_tokens``: the most tokens generated. ``temperature``: 0 (default) is greedy;
  above 0 samples from the softmax of logits / temperature, restricted to the ``top_k``
  most likely tokens (0: all) and to the smallest set whose probability reaches ``top_p``
  (1: all). ``seed``: sampling is reproducible per request (the same seed gives the same
  tokens, alone or batched, with or without cache hits). ``stop_token_ids``: generation
  ends after any of these tokens (it is the last token returned), e.g. the model's EOS.

  ``logprobs``: each generated token's log-probability under the model (log-softmax of its
  logits before temperature, top-k and top-p), with the ``logprobs`` most likely tokens'
  (0..20; None: none). ``prompt_logprobs``: the same for every prompt token after the
  first, given the tokens before it; the prompt is then computed whole (a cached prefix
  has no logits), so such a request reuses no cached block.
  """

  max_new_tokens: int = 16
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_token_ids: tuple = ()
  logprobs: int | None = None
  prompt_logprobs: int | None = None

  def __post_init__(self):
    # Every value here ends up in a step's int32/float32/uint32 arrays: a value outside
    # those ranges is refused here, never left to overflow inside a step.
    _positive_int(self, "max_new_tokens")
    _require(self.max_new_tokens < 2**31,
             f"SamplingParams.max_new_tokens={self.max_new_tokens!r} must be < 2**31.")
    t = self.temperature
    _require(isinstance(t, (int, float, np.floating)) and not isinstance(t, bool)
             and np.isfinite(t) and 0 <= t <= MAX_TEMPERATURE,
             f"SamplingParams.temperature={t!r} must be a finite number in [0, "
             f"{MAX_TEMPERATURE:g}] (0 = greedy).")
    k = self.top_k
    _require(isinstance(k, (int, np.integer)) and not isinstance(k, bool) and 0 <= k < 2**31,
             f"SamplingParams.top_k={k!r} must be an integer in [0, 2**31) (0 = no limit; "
             "the engine also refuses one above the model's vocabulary).")
    p = self.top_p
    _require(isinstance(p, (int, float, np.floating)) and not isinstance(p, bool) and 0 < p <= 1,
             f"SamplingParams.top_p={p!r} must be in (0, 1] (1 = no limit).")
    s = self.seed
    _require(isinstance(s, (int, np.integer)) and not isinstance(s, bool) and 0 <= s < 2**32,
             f"SamplingParams.seed={s!r} must be an integer in [0, 2**32).")
    stops = self.stop_token_ids
    _require(isinstance(stops, (tuple, list)) and all(
        isinstance(x, (int, np.integer)) and not isinstance(x, bool) and 0 <= x < 2**31
        for x in stops),
             f"SamplingParams.stop_token_ids={stops!r} must be a tuple of token ids in "
             "[0, 2**31).")
    object.__setattr__(self, "stop_token_ids", tuple(int(x) for x in stops))
    for name in ("logprobs", "prompt_logprobs"):
      k = getattr(self, name)
      _require(k is None or (isinstance(k, (int, np.integer)) and not isinstance(k, bool)
                             and 0 <= k <= MAX_LOGPROBS),
               f"SamplingParams.{name}={k!r} must be None or an integer in [0, "
               f"{MAX_LOGPROBS}] (how many most likely tokens to report with each token's "
               "log-probability).")
