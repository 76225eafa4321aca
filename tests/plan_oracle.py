"""A brute-force twin of ``jaxkv.plan.plan`` for one (request, shard): the test oracle.

It tries every split point in plain Python loops over blocks and links, timing recompute
with the scalar ``PrefillCurve.seconds``, so the property tests can hold the vectorized plan
to it. It shares only the tier codes and the link order with the plan it checks.
"""

import math

from jaxkv.costs import LINKS, CostModel
from jaxkv.plan import ABSENT, DISK, HOST, REMOTE, SHARD


def brute_force(tiers, block_bytes, hot, end, tail_tokens, budget, share, cost_model: CostModel,
                page_size: int, chunk_tokens: int = 0, others=(0.0, 0.0),
                tail_widths: tuple = ()) -> tuple[int, float]:
  """``(s*, predicted seconds)`` for one (request, shard), by trying every split point.
  ``share``: users of each link (in ``LINKS`` order); ``others``: seconds of the other
  requests' recompute and tail prefill on the shard (both as the plan's first pass found)."""

  def rounded(n):  # whole chunks, then the narrowest step holding the rest
    if not chunk_tokens:
      return n
    full, rest = (n // chunk_tokens) * chunk_tokens, n % chunk_tokens
    return full + (min([w for w in tail_widths if w >= rest] + [chunk_tokens]) if rest else 0)

  best_s, best_t = None, math.inf
  for s in range(hot, end + 1):
    if end - s > budget or any(int(tiers[b]) == ABSENT for b in range(s, end)):
      continue
    link_bytes = dict.fromkeys(LINKS, 0.0)
    for b in range(s, end):
      t = int(tiers[b])
      if t in (HOST, DISK, REMOTE):
        link_bytes["host_to_device"] += float(block_bytes[b])
      if t == DISK:
        link_bytes["disk_to_host"] += float(block_bytes[b])
      if t == REMOTE:
        link_bytes["remote_to_host"] += float(block_bytes[b])
      if t == SHARD:
        link_bytes["cross_shard"] += float(block_bytes[b])
    t_fetch = 0.0
    for i, name in enumerate(LINKS):
      if link_bytes[name] > 0:
        link = cost_model.links[name]
        t_fetch = max(t_fetch, link.latency_s
                      + link_bytes[name] / (link.bytes_per_s / max(share[i], 1.0)))
    t_rec = cost_model.prefill.seconds(rounded((s - hot) * page_size), hot * page_size)
    t = max(t_rec + others[0], t_fetch)
    if t < best_t - 1e-12 * max(1.0, t):
      best_s, best_t = s, t
  tail = cost_model.prefill.seconds(rounded(tail_tokens), end * page_size)
  return best_s, best_t + tail + others[1]
