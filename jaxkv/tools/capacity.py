"""Capacity planning without a model: what the plan would decide for a hypothetical load.

``capacity_plan`` builds the plan's inputs for ``requests`` equal requests with a cold
prefix each (no engine, no cache) and runs the same jitted ``jaxkv.planning.plan.plan`` the engine
runs, so ``launch/plan.py`` answers "fetch, recompute or split?" for a machine from its
costs alone. ``stream_step_s`` and ``choose_window`` answer the same question for a
streamed decode: how many pages to keep on device so that streaming the rest hides behind
the step's compute.
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv.planning.costs import CostModel
from jaxkv.errors import InputError
from jaxkv.planning.plan import DECISIONS, DISK, HOST, HOT, REMOTE, PlanInputs, plan


def capacity_plan(*, kv_bytes: float, tokens: int, costs: CostModel, requests: int = 1,
                  page_size: int = 16, context_tokens: int = 0, tier: int = HOST) -> dict:
  """What ``plan`` decides for ``requests`` equal requests in one step, sharing one host's
  links and one device's compute, each with ``tokens / requests`` cold tokens
  (``kv_bytes / requests`` bytes) after ``context_tokens`` hot ones. Returns the figures
  ``launch/plan.py`` reports: the step's time if every request fetched everything, if
  every one recomputed everything, and with the plan's split (``t_split_s``)."""
  if requests < 1 or tokens < requests or kv_bytes <= 0:
    raise InputError(f"need requests >= 1, tokens >= requests and kv_bytes > 0; got "
                     f"requests={requests}, tokens={tokens}, kv_bytes={kv_bytes}.")
  per_tokens = tokens // requests
  blocks = max(1, -(-per_tokens // page_size))
  hot = context_tokens // page_size
  m = hot + blocks
  tiers = np.full((requests, 1, m), tier, np.int32)
  tiers[:, :, :hot] = HOT
  bytes_per_block = kv_bytes / requests / blocks
  inputs = PlanInputs(
      tiers=tiers, block_bytes=np.full(tiers.shape, bytes_per_block, np.float32),
      hot=np.full((requests, 1), hot, np.int32), cached_end=np.full((requests, 1), m, np.int32),
      tail_tokens=np.zeros((requests,), np.int32), free_pages=np.full((1,), m, np.int32),
      inflight_blocks=np.full((1,), m, np.int32), link_group=np.zeros((1,), np.int32),
      valid=np.ones((requests,), bool), page_size=page_size)
  out = jax.tree.map(np.asarray, plan(inputs, costs.arrays()))
  split_blocks = int(out.split[0, 0]) - hot
  # The two pure policies for the whole step: every request fetches everything (each link
  # carries all of their bytes) or recomputes everything (one device computes all).
  t_one = costs.prefill.seconds(blocks * page_size, hot * page_size)
  t_recompute = t_one + (requests - 1) * max(t_one - costs.prefill.t0_s, 0.0)
  links = ["host_to_device"] + {DISK: ["disk_to_host"], REMOTE: ["remote_to_host"]}.get(tier, [])
  t_fetch = max((costs.links.get(name) or costs.link("host_to_device")).seconds(kv_bytes)
                for name in links)
  return {
      "t_fetch_s": t_fetch,
      "t_recompute_s": t_recompute,
      "t_split_s": float(out.t_pred_s[0, 0]),
      "decision": DECISIONS[int(out.decision[0, 0])],
      "split_tokens": split_blocks * page_size,
      "fetch_tokens": (blocks - split_blocks) * page_size,
      "requests": requests, "tokens_per_request": per_tokens,
      "bytes_per_request": kv_bytes / requests,
  }


def stream_step_s(costs: CostModel, *, cold_pages: int, page_bytes: int, compute_s: float,
                  overlap: float = 1.0) -> float:
  """Predicted decode step of a streamed sequence: the attention compute and the transfer
  of its cold pages (host -> device) in parallel (``overlap=1``) or in series (0)."""
  link = costs.link("host_to_device")
  transfer = link.seconds(cold_pages * page_bytes)
  return max(compute_s, transfer) + (1.0 - overlap) * min(compute_s, transfer)


def choose_window(costs: CostModel, *, context_pages: int, device_pages: int, sink_pages: int,
                  page_bytes: int, compute_s: float, overlap: float = 1.0) -> dict:
  """Which window (pages kept on device) makes a streamed decode step fastest, within
  ``device_pages``. More window means fewer cold pages to stream each step."""
  best = None
  options = {}
  for window in range(1, max(1, device_pages - sink_pages) + 1):
    cold = max(0, context_pages - sink_pages - window)
    t = stream_step_s(costs, cold_pages=cold, page_bytes=page_bytes, compute_s=compute_s,
                      overlap=overlap)
    options[window] = t
    if best is None or t < options[best] - 1e-12:
      best = window
  return {"window_pages": best, "step_s": options[best],
          "all_streamed_s": options[min(options)], "options": options}
