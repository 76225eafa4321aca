"""Engine: generation over a Flax NNX model with tiered prefix reuse, one step at a time.

The engine is a facade that builds the parts and runs one loop through them. Every
request — ``generate``, ``submit``, ``pin``, a long streamed context — enters the same
queue and leaves it through the same steps:

  ``admission``  ``validate``: the caller's prompts become frozen ``Request`` records, or
                 are refused before any work; ``admit``: a request is placed on the shard
                 where its cached prefix makes it cheapest (a frozen ``Placement``).
  ``planner``    which of a request's cached blocks are fetched and which recomputed
                 (``jaxkv.planning.plan`` over measured ``costs``).
  ``scheduler``  the step loop: each ``step`` it decides one frozen ``StepPlan`` (rows,
                 chunks, fetches to issue, fetch groups to verify) and afterwards takes
                 the runner's ``StepResult`` into its state (hits, published blocks,
                 tokens, finished requests).
  ``runner``     executes a ``StepPlan``: the jitted prefill/decode steps over compact
                 rows, the tier transfers (``transfers.TierMover``) and their
                 verification, the readback; returns the ``StepResult``.
  ``streaming``  executes the plan of a sequence longer than a device pool (hot pages on
                 device, cold ones streamed from host or disk through attention).
What goes back up is a return value. What the parts share is the ``KVCache``: its manager
(index, pins) for admission and the scheduler, its worker (pools, tiers) for the runner.
``EngineConfig(batching="static")`` is an admission policy of the same loop (admit only
into an empty batch: waves), kept to compare against.

The engine asks only this of a model: ``model(tokens [B, T] int32, batch: PageBatch)
-> logits [B, T, vocab]``, with its attention layers holding ``jaxkv.nnx.PagedKV``.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from absl import logging
from flax import nnx

from jaxkv import buckets, distributed
from jaxkv.compiles import COMPILES
from jaxkv.scheduling.admission import Admission
from jaxkv.cache import KVCache
from jaxkv.config import EngineConfig, SamplingParams, SchedulerConfig, StreamConfig
from jaxkv.worker.runner import ModelRunner
from jaxkv.planning.costs import CostModel
from jaxkv.planning.planner import Planner
from jaxkv.scheduling.scheduler import RequestHandle, Scheduler, StepOutput
from jaxkv.scheduling.step import StepPlan, StepResult
from jaxkv.worker.streaming import StreamRunner, check_stream_config
from jaxkv.errors import InputError


class Engine:
  """Prefill/decode with prefix reuse over a Flax NNX model and a ``KVCache``."""

  def __init__(self, model: nnx.Module, cache: KVCache, config: EngineConfig | None = None, *,
               scheduler: SchedulerConfig | None = None, costs: CostModel | None = None,
               stream: StreamConfig | None = None):
    if not isinstance(cache, KVCache):
      raise TypeError(f"cache must be a jaxkv.KVCache, got {type(cache).__name__}.")
    self.cache = cache
    self.config = config = config or EngineConfig()
    self.scheduler_config = scheduler or SchedulerConfig()
    self.mesh = cache.mesh
    check_stream_config(stream, cache, config)
    _check_context(model, cache)
    self.model = model
    cache.size_windows(config.max_seqs_per_shard, config.prefill_chunk_pages)
    self.runner = ModelRunner(model, cache, config.prefill_chunk_pages)
    cache.open_tiers()  # the model is known now: its stores, peers and the tier mover
    self.vocab_size = self.runner.vocab_size
    c = cache.config
    self.planner = Planner(
        self.scheduler_config, costs, num_shards=cache.num_shards, page_size=c.page_size,
        page_bytes=c.page_bytes, chunk_tokens=self.runner.chunk_tokens, stats=cache.stats,
        tail_widths=self.runner.prefill_widths, share=distributed.broadcaster())
    self.admission = Admission(cache.manager, cache.config,
                               max_seqs_per_shard=config.max_seqs_per_shard,
                               prefix_reuse=config.prefix_reuse, vocab_size=self.vocab_size,
                               planner=self.planner, stream=stream)
    self.loop = Scheduler(cache.manager, self.planner, self.admission,
                          max_seqs_per_shard=config.max_seqs_per_shard,
                          prefix_reuse=config.prefix_reuse,
                          cache_decode_blocks=config.cache_decode_blocks,
                          chunk_tokens=self.runner.chunk_tokens,
                          batching="waves" if config.batching == "static" else "continuous")
    self.stream = stream  # (sets _stream and _streamer)
    self._next_id = 0  # request ids: one space for every request, from any thread
    self._id_lock = threading.Lock()
    self._warm_mark: int | None = None  # COMPILES' position when warm-up was complete

  @property
  def stream(self) -> StreamConfig | None:
    """How sequences longer than a device pool are served (None: they are refused)."""
    return self._stream

  @stream.setter
  def stream(self, stream: StreamConfig | None) -> None:
    check_stream_config(stream, self.cache, self.config)
    if self.loop.has_work():
      raise InputError("cannot change the stream config while requests are running; finish "
                       "them first (Engine.step until has_unfinished() is False).")
    self._stream = stream
    self.admission.set_stream(stream)
    self._streamer = (None if stream is None else StreamRunner(
        self.cache, self.runner, stream, prefill_chunk_pages=self.config.prefill_chunk_pages))

  @property
  def scheduler(self) -> SchedulerConfig:
    """Deprecated: ``scheduler_config`` under its former name (the step loop's scheduler
    is ``Engine.loop``)."""
    warnings.warn("Engine.scheduler is deprecated: the SchedulerConfig is "
                  "Engine.scheduler_config (the step loop is Engine.loop).",
                  DeprecationWarning, stacklevel=2)
    return self.scheduler_config

  @property
  def costs(self) -> CostModel | None:
    """The costs the planner decides with (calibrated on first need under ``cost``)."""
    return self.planner.costs

  @costs.setter
  def costs(self, costs: CostModel | None) -> None:
    self.planner.set_costs(costs)

  @property
  def trace_counts(self) -> collections.Counter:
    """Traces per (step, shape bucket), shared by engines over the same model structure."""
    return self.runner.trace_counts

  def _plans_cold(self) -> bool:
    """Whether the ``cost`` decision plans blocks on a lower tier or another shard."""
    w = self.cache.worker
    return self.scheduler_config.decision == "cost" and bool(
        w.host or w.disk or w.remote or w.pool
        or (self.cache.num_shards > 1 and self.config.prefix_reuse))

  def _calibrate(self) -> None:
    from jaxkv.planning import calibration
    t0 = time.perf_counter()
    self.planner.set_costs(calibration.calibrate(
        self.cache, self.runner, max_seqs_per_shard=self.config.max_seqs_per_shard))
    self.cache.stats.add("calibration_s", time.perf_counter() - t0)

  # ---- generation ------------------------------------------------------------------------------
  def generate(self, prompts: Sequence[Sequence[int]],
               max_new_tokens: int | SamplingParams | Sequence[SamplingParams],
               tenant: str = "default", *, return_logits: bool = False):
    """Generates for every prompt; returns the new token ids per prompt (a list of lists).

    The second argument is ``max_new_tokens`` (greedy), a ``jaxkv.SamplingParams`` for
    every prompt, or a list with one per prompt (each its own length, sampling and stop
    tokens; a stop token is the last token returned). With ``return_logits=True`` returns
    ``(tokens, logits)`` where ``logits[i]`` is a ``[len(tokens[i]), vocab]`` float32
    array: the logits each token was chosen from. Runs steps until every prompt is done
    (other submitted requests advance meanwhile)."""
    requests = self._validate(prompts, max_new_tokens, tenant)
    handles = [self._add(r, want_logits=return_logits) for r in requests]
    while not all(h.finished for h in handles):
      self.step()
    outputs = [list(h.tokens) for h in handles]
    return (outputs, [np.stack(h.logits) for h in handles]) if return_logits else outputs

  def new_request_id(self) -> int:
    """A request id no other request of this engine has or will get (safe from any
    thread: a server names its request by it before the engine's thread sees it)."""
    with self._id_lock:
      self._next_id += 1
      return self._next_id - 1

  def _validate(self, prompts, sampling, tenant, shard: int | None = None,
                request_id: int | None = None):
    if request_id is not None and (
        not isinstance(request_id, int) or isinstance(request_id, bool) or request_id < 0
        or request_id in self.loop.handles):
      raise InputError(f"request_id={request_id!r} must be an integer >= 0 that no running "
                       "or waiting request has (take one from Engine.new_request_id()).")
    requests = self.admission.validate(prompts, sampling, tenant, first_id=0, shard=shard)
    with self._id_lock:  # the next ids, or the caller's (``new_request_id``, a job leader's)
      first = self._next_id if request_id is None else request_id
      self._next_id = max(self._next_id, first + len(requests))
    return [dataclasses.replace(r, id=first + i) for i, r in enumerate(requests)]

  def _add(self, request, *, on_token=None, want_logits: bool = False) -> RequestHandle:
    # A handle waits for its next token by running a step.
    return self.loop.add(RequestHandle(request, self.step, on_token, want_logits))

  # ---- the online API --------------------------------------------------------------------------
  def submit(self, prompt: Sequence[int], sampling: SamplingParams | int = 16,
             tenant: str = "default", *, on_token=None, request_id: int | None = None
             ) -> RequestHandle:
    """Queues one request; returns its handle at once. ``request_id``: its id (``handle.id``,
    in every log line about it), from ``new_request_id``; by default the next one.

    ``sampling``: a ``jaxkv.SamplingParams`` or ``max_new_tokens`` (greedy). The request
    joins the running batch at the next ``step`` that has a row and pages for it.
    ``on_token(token)`` is called for each token as it is generated; iterating over the
    handle yields them too (running steps as needed)."""
    request, = self._validate([prompt], sampling, tenant, request_id=request_id)
    return self._add(request, on_token=on_token)

  def step(self) -> list[StepOutput]:
    """One iteration over every running request: admits waiting ones that fit, advances
    each by one prefill chunk or one decoded token. Returns what each request produced."""
    if self._plans_cold() and self.planner.costs is None and self.loop.has_work():
      self._calibrate()
    try:
      outputs = self._run_plan()
      if self.loop.has_orders() and not self.loop.has_work():
        # The last requests left tier work (write-through of their blocks, the journal's
        # pump) and no later step would carry it: a plan of those orders alone.
        outputs += self._run_plan()
      return outputs
    except BaseException:
      # Every reference the running requests held is released, every fetch abandoned.
      self.runner.recover(self.loop.fail_all())
      raise

  def _run_plan(self) -> list[StepOutput]:
    plan = self.loop.schedule()
    if plan.empty:  # what waits, waits for a peer's answer: wait a little for it, not spin
      self.cache.manager.wait_for_peer_answer(0.05)
      return self.loop.update(plan, None)
    if logging.level_debug():  # --verbosity=1: the plan each step ran, one line
      logging.debug("%s", plan.summary())
    return self.loop.update(plan, self._execute(plan))

  def _execute(self, plan: StepPlan) -> StepResult:
    if plan.streamed is None:
      return self.runner.execute(plan)
    self.runner.quiesce()
    self.runner.carry_out(plan.orders)
    return self._streamer.step(plan)

  def abort(self, handle: RequestHandle) -> None:
    """Ends a submitted request at the next step: see ``Scheduler.abort``. Its pages are
    released; the blocks it published stay cached."""
    self.loop.abort(handle.id)

  def has_unfinished(self) -> bool:
    """Whether submitted requests are waiting or running."""
    return self.loop.has_work()

  def warmup(self, max_seq_len: int | None = None, rows_per_shard: Sequence[int] | None = None,
             *, shapes: int | None = None, stream_tokens: int = 0) -> int:
    """Compiles the prefill and decode steps for every shape bucket a workload can use.

    ``max_seq_len`` bounds prompt + generated tokens (default: the config's maximum);
    ``rows_per_shard`` lists batch buckets (default: every power of two up to
    ``max_seqs_per_shard``). With lower tiers, also compiles their page transfers; when
    blocks may come from a lower tier or another shard, measures the costs (``cost``
    decision) and compiles the plan. Runs all-padding steps, which change no page. Returns
    the (prefill, decode) bucket pairs compiled. ``shapes``: that many now, the smallest
    first; ``warm_next`` compiles the rest (a step needing one first compiles it). With a
    ``StreamConfig``, ``stream_tokens`` warms the streamed steps of sequences up to that
    many tokens (their shapes grow with the length: warm the lengths served)."""
    self._warm_mark = None
    c = self.cache.config
    max_seq_len = c.max_seq_len if max_seq_len is None else min(int(max_seq_len), c.max_seq_len)
    if rows_per_shard is None:
      rows_per_shard = buckets.row_buckets(self.config.max_seqs_per_shard)
    rows = sorted({buckets.pow2_at_least(r) for r in rows_per_shard})
    widths = self.runner.warmup(max_seq_len, rows, shapes)
    self.cache.worker.warm_moves(rows[-1] * max(widths))
    if self._plans_cold():  # blocks on another tier or shard
      if self.planner.costs is None:
        self._calibrate()
      self.planner.warm(-(-max_seq_len // c.page_size), rows[-1] * self.cache.num_shards)
    if self._streamer is not None and stream_tokens > c.max_seq_len:
      self._streamer.warm(stream_tokens)
    jax.block_until_ready(self.cache.worker.pools)
    self.mark_warm()
    return self.runner.warm_progress()[0]

  def warm_next(self) -> bool:
    """Compiles the next bucket ``warmup`` left; the last makes the engine warm. Returns
    whether any is left (all-padding steps: safe between any two steps)."""
    if not self.runner.warm_next() and self._warm_mark is None:
      self.mark_warm()
    return bool(self.runner.warm_later)

  def mark_warm(self) -> None:
    """Restarts ``compiles_after_warmup`` after one-off work (a restore); no-op while warming."""
    if not self.runner.warm_later:
      self._warm_mark = COMPILES.mark()

  @property
  def compiles_after_warmup(self) -> int | None:
    """XLA compiles in this process (any engine's: ``jaxkv.compiles``) since this engine
    was warm; None before. 0 is the goal."""
    return None if self._warm_mark is None else COMPILES.since(self._warm_mark)

  # ---- the cache -------------------------------------------------------------------------------
  def pin(self, tokens: Sequence[int], tenant: str = "default") -> int:
    """Keeps a prefix (a system prompt, a shared document) resident on device.

    Computes its full blocks on every data shard that lacks them, then holds a reference
    on them, so no eviction touches them and requests on any shard reuse them, until
    ``unpin`` with the same arguments. Returns the number of blocks pinned per shard."""
    keys = self.cache.index.block_keys(np.asarray(tokens, np.int32), tenant)
    if not keys:
      raise InputError(f"pin needs at least one full block ({self.cache.config.page_size} "
                       f"tokens); got {len(tokens)} tokens.")
    # Each shard lacking the prefix computes it through the loop; other requests may evict a
    # shard's copy meanwhile: that shard computes it again (a bounded number of times).
    for _ in range(4):
      lacking = [s for s in range(self.cache.num_shards)
                 if not self.cache.manager.holds_whole(s, keys)]
      if not lacking:
        return self.cache.hold(tokens, tenant)
      handles = [self._add(self._validate([list(tokens)], 1, tenant, shard=s)[0])
                 for s in lacking]
      while not all(h.finished for h in handles):
        self.step()
    return self.cache.hold(tokens, tenant)  # raises CapacityError naming the shard

  def unpin(self, tokens: Sequence[int], tenant: str = "default") -> None:
    """Releases one ``pin`` of the same prefix."""
    self.cache.release_hold(tokens, tenant)

  def offload(self) -> int:
    """Moves every unreferenced cached block out of device memory; see ``KVCache.offload``."""
    return self.cache.offload()

  def flush(self, timeout_s: float = 60.0) -> int:
    """Waits for lower-tier writes in flight; returns how many did not finish in time."""
    return self.cache.flush(timeout_s)

  # ---- counters --------------------------------------------------------------------------------
  def reset_stats(self) -> None:
    self.cache.stats.reset()

  def stats(self) -> dict:
    """Counters since construction (or ``reset_stats``); ``ttft_s`` lists every request;
    ``compiles_after_warmup``: as the property (which ``reset_stats`` leaves), -1 before."""
    return {**self.cache.stats.as_dict(evictions=self.cache.index.counters.evictions),
            "compiles_after_warmup": -1 if self._warm_mark is None else self.compiles_after_warmup}

  def occupancy(self) -> dict:
    """What is held now: ``cached_blocks``, ``capacity_blocks`` by tier (device and host summed
    over shards; disk is one store), ``referenced_pages`` (held by requests, transfers and pins:
    0 when idle and unpinned), ``waiting_requests`` (not yet admitted), ``running_requests``."""
    return {**self.cache.occupancy(), "waiting_requests": len(self.loop.waiting),
            "running_requests": len(self.loop.running)}


def _check_context(model, cache: KVCache) -> None:
  """A model that computes only up to ``max_context`` tokens as its checkpoint does (a
  sliding window jaxkv's attention does not apply) gets no cache for longer sequences."""
  limit, c = getattr(model, "max_context", None), cache.config
  if limit and c.max_pages_per_seq * c.page_size > limit:
    raise InputError(
        f"the model attends over at most {limit} tokens (its sliding window) but "
        f"CacheConfig allows sequences of max_pages_per_seq={c.max_pages_per_seq} x "
        f"page_size={c.page_size} tokens; set max_pages_per_seq <= {limit // c.page_size}.")
