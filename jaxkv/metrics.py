"""``Engine.stats()`` (``jaxkv.stats.Stats.as_dict``) as a Prometheus text exposition (for
a node exporter's textfile collector or any scraper that reads files)."""

from __future__ import annotations

import os

import numpy as np

from jaxkv.stats import COUNTERS


def percentile(values, q: float) -> float:
  """The q-th quantile (0..1) with linear interpolation (numpy's default)."""
  return float(np.percentile(np.asarray(values, np.float64), 100 * q))


def prometheus_text(stats: dict, labels: dict | None = None) -> str:
  label = ",".join(f'{k}="{v}"' for k, v in sorted((labels or {}).items()))
  wrap = lambda extra="": "{" + ",".join(x for x in (label, extra) if x) + "}"
  lines = []

  def emit(name, kind, help_text, samples):
    lines.append(f"# HELP jaxkv_{name} {help_text}")
    lines.append(f"# TYPE jaxkv_{name} {kind}")
    for extra, value in samples:
      lines.append(f"jaxkv_{name}{wrap(extra)} {float(value):g}")

  emit("block_hits_total", "counter", "Blocks reused, by the tier they came from.",
       [(f'tier="{t}"', n) for t, n in sorted(stats.get("hits", {}).items())])
  for key in ("requests", "prompt_tokens", "hit_tokens", "computed_tokens", "generated_tokens",
              "blocks_fetched", "blocks_recomputed", "blocks_split", "bytes_moved",
              "verify_failures", "read_timeouts", "disk_write_failures"):
    emit(f"{key}_total", "counter", COUNTERS[key].capitalize() + ".", [("", stats.get(key, 0))])
  emit("evictions_total", "counter", "Blocks evicted from any tier.",
       [("", stats.get("evictions", 0))])
  ttft = stats.get("ttft_s", [])
  if ttft:
    emit("ttft_seconds", "summary", "Time to first token.",
         [(f'quantile="{q}"', percentile(ttft, q)) for q in (0.5, 0.9, 0.99)])
    lines.append(f"jaxkv_ttft_seconds_sum{wrap()} {sum(ttft):g}")
    lines.append(f"jaxkv_ttft_seconds_count{wrap()} {len(ttft)}")
  return "\n".join(lines) + "\n"


def write_prometheus(path: str, stats: dict, labels: dict | None = None) -> None:
  """Writes atomically (temporary file + rename), as textfile collectors expect."""
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(prometheus_text(stats, labels))
  os.replace(tmp, path)
