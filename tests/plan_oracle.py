"""A brute-force twin of ``jaxkv.planning.plan.plan`` for one (request, shard): the test oracle.

It tries every split point in plain Python loops over blocks and links, timing recompute
with the scalar ``PrefillCurve.seconds``, so the property tests can hold the vectorized plan
to it. ``first_pass`` finds, the same way, what the plan's first pass shares out (each
link's users and the compute the other requests bring to a shard), so the plan's second
pass is checked against inputs it did not produce. It shares only the tier codes and the
link order with the plan it checks.
"""

import math

from jaxkv.planning.costs import LINKS, CostModel
from jaxkv.planning.plan import ABSENT, DISK, HOST, POOL, REMOTE, SHARD


def _charged(n, chunk_tokens, tail_widths):
  """Tokens a prefill of ``n`` pays for: whole chunks, then the narrowest step holding the
  rest."""
  if not chunk_tokens:
    return n
  full, rest = (n // chunk_tokens) * chunk_tokens, n % chunk_tokens
  return full + (min([w for w in tail_widths if w >= rest] + [chunk_tokens]) if rest else 0)


def brute_force(tiers, block_bytes, hot, end, tail_tokens, budget, share, cost_model: CostModel,
                page_size: int, chunk_tokens: int = 0, others=(0.0, 0.0),
                tail_widths: tuple = ()) -> tuple[int, float]:
  """``(s*, predicted seconds)`` for one (request, shard), by trying every split point.
  ``share``: users of each link (in ``LINKS`` order); ``others``: seconds of the other
  requests' recompute and tail prefill on the shard (both as ``first_pass`` finds them)."""

  rounded = lambda n: _charged(n, chunk_tokens, tail_widths)
  best_s, best_t = None, math.inf
  for s in range(hot, end + 1):
    if end - s > budget or any(int(tiers[b]) == ABSENT for b in range(s, end)):
      continue
    link_bytes = dict.fromkeys(LINKS, 0.0)
    for b in range(s, end):
      t = int(tiers[b])
      if t in (HOST, DISK, REMOTE, POOL):
        link_bytes["host_to_device"] += float(block_bytes[b])
      if t == POOL:
        link_bytes["pool_to_host"] += float(block_bytes[b])
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
    # Recompute and fetch at once: the longer hides ``overlap`` of the shorter.
    busy, wait = t_rec + others[0], t_fetch
    t = max(busy, wait) + (1.0 - cost_model.overlap) * min(busy, wait)
    if t < best_t - 1e-12 * max(1.0, t):
      best_s, best_t = s, t
  tail = cost_model.prefill.seconds(rounded(tail_tokens), end * page_size)
  return best_s, best_t + tail + others[1]


def first_pass(inputs, cost_model: CostModel) -> tuple[list, list]:
  """``(link_users, others)`` as the plan's rule defines them, from the inputs alone: with
  every link and every shard's compute free, each request's best shard (the first of the
  cheapest) and its split there (``brute_force``); ``link_users[d][l]``: the requests whose
  fetches at their best shard cross link ``l`` of a host that shard ``d`` shares (each at
  least 1); ``others[r][d]``: the recompute and tail-prefill seconds (less the one shared
  step overhead ``t0``) the other requests computing on shard ``d`` bring there.
  Requests compute on their best shard (``compute_group`` unset)."""
  assert inputs.compute_group is None
  r, d = len(inputs.valid), len(inputs.free_pages)
  ps, prefill = inputs.page_size, cost_model.prefill
  best, uses, work = [], [], []
  for i in range(r):
    options = []
    for j in range(d):
      budget = int(min(inputs.inflight_blocks[j], inputs.free_pages[j]))
      options.append(brute_force(
          inputs.tiers[i, j], inputs.block_bytes[i, j], int(inputs.hot[i, j]),
          int(inputs.cached_end[i, j]), int(inputs.tail_tokens[i]), budget, [1.0] * len(LINKS),
          cost_model, ps, inputs.chunk_tokens, tail_widths=inputs.tail_widths))
    j = min(range(d), key=lambda k: (options[k][1], k))
    s, hot, end = options[j][0], int(inputs.hot[i, j]), int(inputs.cached_end[i, j])
    fetched = [int(t) for t in inputs.tiers[i, j, s:end]]
    crossed = (any(t in (HOST, DISK, REMOTE, POOL) for t in fetched), DISK in fetched,
               REMOTE in fetched, SHARD in fetched, POOL in fetched)
    rounded = lambda n: _charged(n, inputs.chunk_tokens, inputs.tail_widths)
    t_rec = prefill.seconds(rounded((s - hot) * ps), hot * ps)
    t_tail = prefill.seconds(rounded(int(inputs.tail_tokens[i])), end * ps)
    marginal = lambda t: t - prefill.t0_s if t > 0 else 0.0
    valid = bool(inputs.valid[i])
    best.append(j)
    uses.append([valid and c for c in crossed])
    work.append((marginal(t_rec), marginal(t_tail)) if valid else (0.0, 0.0))
  group = [int(g) for g in inputs.link_group]
  link_users = [[max(1.0, float(sum(uses[i][l] for i in range(r)
                                    if group[best[i]] == group[k])))
                 for l in range(len(LINKS))] for k in range(d)]
  others = [[tuple(sum(work[o][x] for o in range(r) if o != i and best[o] == k)
                   for x in range(2)) for k in range(d)] for i in range(r)]
  return link_users, others
