"""Prometheus metrics of serving engines, through ``prometheus_client``.

``EngineCollector`` reads each engine's ``stats()`` and ``occupancy()`` when scraped, so
the numbers are always the engine's own (nothing is counted twice) and a live endpoint
shows them mid-run:

    registry = jaxkv.metrics.registry({"jaxkv": engine}, labels={"config": "llama3"})
    jaxkv.metrics.serve(registry, port=9400)          # http://host:9400/metrics
    jaxkv.metrics.write_textfile(path, registry)      # atomic, for a textfile collector

Every sample carries the engine's name (the key of ``engines``; in launch/serve.py the
engine's ``--cache``: ``jaxkv`` or ``nocache``; on a server ``jaxkv``) under the label
``policy`` (``ENGINE_LABEL``), and the given labels. The label keeps that name, though it
is no policy, because dashboards and alerts select on it.

Families:
- histograms (seconds): ``jaxkv_ttft_seconds``, ``jaxkv_time_per_output_token_seconds``,
  ``jaxkv_e2e_latency_seconds`` — bucket counts, so replicas aggregate;
- counters (``_total``): block hits by ``tier``; requests, prompt/hit/computed/generated
  tokens; blocks fetched, recomputed and split; bytes moved between tiers; verification
  failures by ``reason``; disk records not adopted when the store was opened by ``reason``
  (``jaxkv_disk_discarded_at_open_total``); read timeouts; disk write failures; evictions;
  ``jaxkv_compiles_after_warmup_total``: XLA compiles since the engine was warm
  (``Engine.compiles_after_warmup``: counted for the whole process, any engine's compile
  included; no sample before warm-up; 0 is the goal: a step that compiles is no steady-state
  step); the prefill → decode hand-off (``entrypoints/openai/disagg.py``, 0 on a server of
  neither role): on a prefill node ``jaxkv_pd_prefills_handed_off_total`` (answers promising
  the whole prompt), ``jaxkv_pd_prefills_not_handed_off_total`` (promising less: puts late
  or failed) and ``jaxkv_pd_blocks_handed_off_total``; on a decode node
  ``jaxkv_pd_decodes_received_total`` and ``jaxkv_pd_blocks_promised_total`` (what their
  ``remote_block_ids`` promised: compare with ``jaxkv_block_hits_total{tier="pool"}``);
- gauges: ``jaxkv_cached_blocks`` and ``jaxkv_capacity_blocks`` by ``tier``,
  ``jaxkv_waiting_requests``, ``jaxkv_running_requests``, ``jaxkv_referenced_pages``.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, start_http_server, write_to_textfile
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

from jaxkv.stats import COUNTERS

# The label that carries each engine's name (see above): its name for dashboards' sake.
ENGINE_LABEL = "policy"

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_COUNTED = ("requests", "aborted_requests", "failed_requests", "prompt_tokens", "hit_tokens",
            "computed_tokens", "generated_tokens", "blocks_fetched", "blocks_recomputed",
            "blocks_split", "bytes_moved", "read_timeouts", "disk_write_failures")
# The hand-off's counters (``disagg.hand_off``, ``disagg.Received``), counted only by a node
# of that role: not among ``stats.COUNTERS``, so their help text is here.
_PD_COUNTED = {
    "pd_prefills_handed_off": "Prefill answers whose kv_transfer_params promise every "
                              "block of the prompt (all in the pool by the deadline).",
    "pd_prefills_not_handed_off": "Prefill answers promising less than the whole prompt "
                                  "(its puts late or failed: the decode node recomputes).",
    "pd_blocks_handed_off": "Blocks promised in prefill answers' remote_block_ids.",
    "pd_decodes_received": "Decode requests that came with a prefill's kv_transfer_params.",
    "pd_blocks_promised": "Blocks the received kv_transfer_params promised (remote_block_ids).",
}


def percentile(values, q: float) -> float:
  """The q-th quantile (0..1) with linear interpolation (numpy's default)."""
  return float(np.percentile(np.asarray(values, np.float64), 100 * q))


def _snapshot(engine) -> tuple[dict, dict]:
  """``stats()`` and ``occupancy()``, retried if the serving thread changed a counter
  while a scrape thread copied it."""
  for _ in range(5):
    try:
      return engine.stats(), engine.occupancy()
    except RuntimeError:  # "dictionary changed size during iteration"
      continue
  return engine.stats(), engine.occupancy()


class EngineCollector:
  """A ``prometheus_client`` collector over ``{engine name: engine}`` (the name goes in
  the ``ENGINE_LABEL`` label of every sample)."""

  def __init__(self, engines: dict, labels: dict | None = None):
    self.engines = dict(engines)
    self.labels = dict(labels or {})

  def collect(self):
    names = [ENGINE_LABEL, *sorted(self.labels)]
    fixed = [self.labels[k] for k in sorted(self.labels)]
    hist = {key: HistogramMetricFamily(f"jaxkv_{name}", doc, labels=names)
            for key, name, doc in (
                ("ttft_s", "ttft_seconds", "Time to first token, from submission."),
                ("tpot_s", "time_per_output_token_seconds",
                 "Time per output token after the first, per request."),
                ("e2e_s", "e2e_latency_seconds", "Submission to last token, per request."))}
    buckets = {"ttft_s": TTFT_BUCKETS, "tpot_s": TPOT_BUCKETS, "e2e_s": E2E_BUCKETS}
    hits = CounterMetricFamily("jaxkv_block_hits", "Blocks reused, by the tier they came "
                               "from.", labels=names + ["tier"])
    failures = CounterMetricFamily("jaxkv_verify_failures", "Lower-tier blocks whose bytes "
                                   "failed verification, by reason.", labels=names + ["reason"])
    discarded = CounterMetricFamily(
        "jaxkv_disk_discarded_at_open", "Disk records not adopted when the store was opened "
        "(deleted: failed verification; kept: another format version, unreadable), by reason.",
        labels=names + ["reason"])
    counters = {k: CounterMetricFamily(f"jaxkv_{k}", COUNTERS[k].capitalize() + ".",
                                       labels=names) for k in _COUNTED}
    counters.update({k: CounterMetricFamily(f"jaxkv_{k}", doc, labels=names)
                     for k, doc in _PD_COUNTED.items()})
    evictions = CounterMetricFamily("jaxkv_evictions", "Blocks evicted from any tier.",
                                    labels=names)
    late = CounterMetricFamily("jaxkv_compiles_after_warmup", "XLA compiles in this process "
                               "since the engine was warm (0 is the goal).", labels=names)
    cached = GaugeMetricFamily("jaxkv_cached_blocks", "Blocks held now, by tier.",
                               labels=names + ["tier"])
    capacity = GaugeMetricFamily("jaxkv_capacity_blocks", "Blocks each tier can hold.",
                                 labels=names + ["tier"])
    waiting = GaugeMetricFamily("jaxkv_waiting_requests", "Requests queued, not yet admitted.",
                                labels=names)
    running = GaugeMetricFamily("jaxkv_running_requests", "Requests in the running batch.",
                                labels=names)
    referenced = GaugeMetricFamily("jaxkv_referenced_pages", "Device page references held "
                                   "(running requests, transfers, pins).", labels=names)
    for engine_name, engine in self.engines.items():
      stats, occ = _snapshot(engine)
      values = [engine_name, *fixed]
      for key, family in hist.items():
        series = np.asarray(stats.get(key, []), np.float64)
        counts = [(repr(b), float(np.count_nonzero(series <= b))) for b in buckets[key]]
        family.add_metric(values, counts + [("+Inf", float(series.size))],
                          sum_value=float(series.sum()))
      for tier, n in sorted(stats["hits"].items()):
        hits.add_metric(values + [tier], n)
      for reason, n in sorted(stats.get("verify_failures_by_reason", {}).items()):
        failures.add_metric(values + [str(reason)], n)
      for reason, n in sorted(stats.get("disk_discarded_at_open_by_reason", {}).items()):
        discarded.add_metric(values + [str(reason)], n)
      for k, family in counters.items():
        family.add_metric(values, stats.get(k, 0))
      evictions.add_metric(values, stats.get("evictions", 0))
      if stats.get("compiles_after_warmup", -1) >= 0:  # (-1: not warm yet)
        late.add_metric(values, stats["compiles_after_warmup"])
      for tier, n in sorted(occ["cached_blocks"].items()):
        cached.add_metric(values + [tier], n)
      for tier, n in sorted(occ["capacity_blocks"].items()):
        capacity.add_metric(values + [tier], n)
      waiting.add_metric(values, occ["waiting_requests"])
      running.add_metric(values, occ["running_requests"])
      referenced.add_metric(values, occ["referenced_pages"])
    yield from hist.values()
    yield hits
    yield failures
    yield discarded
    yield from counters.values()
    yield evictions
    yield late
    yield from (cached, capacity, waiting, running, referenced)


def registry(engines: dict, labels: dict | None = None) -> CollectorRegistry:
  """A registry holding only jaxkv's families for ``{engine name: engine}``."""
  reg = CollectorRegistry(auto_describe=True)
  reg.register(EngineCollector(engines, labels))
  return reg


def write_textfile(path: str, reg: CollectorRegistry) -> None:
  """The exposition text at ``path``, atomically (a temporary file renamed over it)."""
  write_to_textfile(path, reg)


def serve(reg: CollectorRegistry, port: int, addr: str = "127.0.0.1"):
  """A live ``/metrics`` endpoint in a daemon thread (on loopback unless ``addr`` says
  otherwise: the figures name tenants and traffic); returns ``(server, thread)``."""
  return start_http_server(port, addr=addr, registry=reg)
