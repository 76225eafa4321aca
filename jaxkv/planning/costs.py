"""What bringing cached KV back costs on this machine: the numbers every plan decides with.

A cold block (cached below the device pool, or on another shard) comes back one of two ways,
and each has a measured price:

- Over links. ``LINKS`` names them: ``host_to_device`` carries every block fetched from a
  lower tier, ``disk_to_host`` the disk ones, ``remote_to_host`` the remote ones,
  ``cross_shard`` the blocks copied from another shard's device pool, and ``pool_to_host``
  the pool's (``jaxkv.worker.tiers.pool``). Moving ``bytes`` over
  a link takes ``latency_s + bytes / bytes_per_s`` (``LinkCost``). The links form a
  pipeline, so a fetch takes as long as its slowest link, not the sum of them; a link that
  several requests use (one host's PCIe) splits its bandwidth between them.
- By recompute. ``PrefillCurve``: prefilling ``n`` tokens after ``c`` cached ones takes
  ``t0 + a*n + b*n*(c + (n-1)/2)`` seconds; attention over a growing context makes it grow
  faster than linearly. The curve is fitted to measured prefill steps (``PrefillCurve.fit``).
- Both at once (a split). Recomputing the front of a prefix while its back arrives takes
  ``max(r, f) + (1 - overlap) * min(r, f)`` for ``r`` seconds of recompute and ``f`` of fetch:
  ``overlap`` 1 when the two hide each other completely (an accelerator computing while a DMA
  engine copies), less when they share something (on a CPU, the receiving thread takes cycles
  from the prefill). Calibration measures it (a prefill step beside a read of the slowest
  lower tier: ``overlap_seen``) and the splits the engine times refine it.

``CostModel`` holds the links and the curve of one machine, model and config. It is measured
(``jaxkv.planning.calibration``), saved and loaded as JSON, and refined by what actually happens (an
EWMA over observed transfers and prefills): no cost is a constant in code. ``arrays()`` gives
its dense form, ``CostArrays``, which the jitted ``jaxkv.planning.plan.plan`` reads.

One job, one set of costs: each process of a multi-process job measures its own machine, but
plans are replicated and compared by digest, so ``agree_costs`` hands every process the
costs of process 0, and what they learn afterwards is process 0's timing on every process
(``Planner.agreed``).
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from jaxkv import distributed
from jaxkv.errors import InputError

# What a remote, pool or cross-shard link is priced at before its first transfer (and no
# host link to go by): free, so that it is tried once and then priced as measured.
UNTRIED_BYTES_PER_S = 1e12

# The order of the links in CostArrays and in every [.., links] array of a plan.
LINKS = ("host_to_device", "disk_to_host", "remote_to_host", "cross_shard", "pool_to_host")


@dataclasses.dataclass(frozen=True)
class LinkCost:
  """``seconds(bytes) = latency_s + bytes / bytes_per_s`` for one link (0 for no bytes)."""

  latency_s: float
  bytes_per_s: float

  def __post_init__(self):
    if not (self.latency_s >= 0 and self.bytes_per_s > 0):
      raise InputError(f"LinkCost latency_s={self.latency_s} must be >= 0 and bytes_per_s="
                       f"{self.bytes_per_s} > 0.")

  def seconds(self, nbytes: float) -> float:
    return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0


UNTRIED_LINK = LinkCost(0.0, UNTRIED_BYTES_PER_S)


@dataclasses.dataclass(frozen=True)
class PrefillCurve:
  """``t(n, c) = t0 + a*n + b*n*(c + (n-1)/2)`` seconds for n > 0 tokens after c cached."""

  t0_s: float
  per_token_s: float
  per_token_context_s: float

  def seconds(self, n: float, c: float) -> float:
    if n <= 0:
      return 0.0
    return self.t0_s + self.per_token_s * n + self.per_token_context_s * n * (c + (n - 1) / 2)

  @staticmethod
  def fit(samples: list[tuple[float, float, float]]) -> "PrefillCurve":
    """Least-squares fit to ``(n, c, seconds)`` samples (coefficients kept >= 0)."""
    a = np.array([[1.0, n, n * (c + (n - 1) / 2)] for n, c, _ in samples])
    y = np.array([t for _, _, t in samples])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    coef = np.maximum(coef, 0.0)
    if coef[1] == 0 and coef[2] == 0:  # degenerate: fall back to a pure per-token rate
      coef[1] = float(np.sum(y) / max(np.sum(a[:, 1]), 1.0))
    return PrefillCurve(float(coef[0]), float(coef[1]), float(coef[2]))


@dataclasses.dataclass
class CostModel:
  """Link costs and the prefill curve for one machine, model and config.

  Mutable on purpose: ``observe_transfer`` and ``observe_prefill`` move it towards what the
  machine really does. Plans read a snapshot of it (``arrays()``).
  """

  links: dict  # name (one of LINKS) -> LinkCost
  prefill: PrefillCurve
  ewma: float = 0.2  # weight of a new observation of the prefill curve
  # ... and of a link's transfer (a geometric average): links change in steps (another
  # job's traffic, a retuned fabric), and a plan should follow within a few requests.
  link_ewma: float = 0.5
  # The fraction of the shorter of a split's recompute and fetch that the longer one hides
  # (module docstring): measured by calibration (1 where no lower tier could be read at
  # start), then learned at ``link_ewma``'s pace from the splits the engine times.
  overlap: float = 1.0
  source: str = "calibrated"

  def __post_init__(self):
    unknown = set(self.links) - set(LINKS)
    if unknown:
      raise InputError(f"CostModel links {sorted(unknown)} are not among {LINKS}.")
    for name in ("ewma", "link_ewma"):
      if not 0 < getattr(self, name) <= 1:
        raise InputError(f"CostModel.{name}={getattr(self, name)} must be in (0, 1].")
    if not 0 <= self.overlap <= 1:
      raise InputError(f"CostModel.overlap={self.overlap} must be in [0, 1] (1: a split's "
                       "recompute and fetch hide each other completely, 0: they run in series).")

  def link(self, name: str) -> LinkCost:
    if name not in self.links:
      raise InputError(f"CostModel has no cost for link {name!r}; calibrate it or set it "
                       f"(links known: {sorted(self.links)}).")
    return self.links[name]

  # ---- learning from what happened -----------------------------------------------------------
  def observe_transfer(self, name: str, nbytes: float, seconds: float, *,
                       latency_s: float | None = None, weight: float | None = None) -> None:
    """EWMA update of a link's bandwidth from one observed transfer (weight ``link_ewma``),
    averaged geometrically (in log space): a step change of the link by any factor is
    followed at the same pace both ways, 8x of a 64x change after one transfer at 0.5 and
    22x after two. (Averaging bytes per second at 0.2 took ~20 transfers to follow a
    slowdown; seconds per byte follows a slowdown at once but at most doubles a speed per
    transfer, so a split that fetches little learned a faster link only over many.)
    ``weight``: this observation's instead (1: it replaces what was known, an estimate
    gone stale while nothing timed the link)."""
    if nbytes <= 0 or seconds <= 0:
      return
    old = self.links.get(name)
    # ``latency_s``: the link's round trip as measured apart from this transfer (a peer's
    # lookups): it replaces the old one, so a small transfer (a split's back) is not taken
    # for a slow link.
    latency = latency_s if latency_s is not None else (old.latency_s if old else 0.0)
    rate = nbytes / max(seconds - latency, seconds * 0.1)
    if old is None:
      self.links[name] = LinkCost(latency, rate)
      return
    w = self.link_ewma if weight is None else weight
    self.links[name] = LinkCost(latency, old.bytes_per_s ** (1 - w) * rate ** w)

  def observe_prefill(self, n: float, c: float, seconds: float) -> None:
    """EWMA update of the prefill curve's scale from one observed prefill."""
    predicted = self.prefill.seconds(n, c)
    if n <= 0 or seconds <= 0 or predicted <= 0:
      return
    scale = (1 - self.ewma) + self.ewma * (seconds / predicted)
    p = self.prefill
    self.prefill = PrefillCurve(p.t0_s * scale, p.per_token_s * scale,
                                p.per_token_context_s * scale)

  def observe_split(self, recompute_s: float, fetch_s: float, seconds: float) -> None:
    """Learns ``overlap`` from one split that ran alone: ``recompute_s`` of recompute and
    ``fetch_s`` of fetch took ``seconds`` together. Full overlap
    would take the longer of the two; what it took beyond that, over the shorter one, is
    the part that did not overlap (an observation outside [0, 1] is clipped)."""
    seen = overlap_seen(recompute_s, fetch_s, seconds)
    if seen is not None:
      self.overlap = (1 - self.link_ewma) * self.overlap + self.link_ewma * seen

  # ---- persistence ---------------------------------------------------------------------------
  def to_json(self) -> str:
    return json.dumps({
        "links": {k: dataclasses.asdict(v) for k, v in sorted(self.links.items())},
        "prefill": dataclasses.asdict(self.prefill), "ewma": self.ewma,
        "link_ewma": self.link_ewma, "overlap": self.overlap, "source": self.source,
    }, indent=2, sort_keys=True)

  @staticmethod
  def from_json(text: str) -> "CostModel":
    d = json.loads(text)
    return CostModel(links={k: LinkCost(**v) for k, v in d["links"].items()},
                     prefill=PrefillCurve(**d["prefill"]), ewma=d.get("ewma", 0.2),
                     link_ewma=d.get("link_ewma", 0.5), overlap=d.get("overlap", 1.0),
                     source=d.get("source", "file"))

  def save(self, path: str) -> None:
    with open(path, "w") as f:
      f.write(self.to_json())

  @staticmethod
  def load(path: str) -> "CostModel":
    try:
      with open(path) as f:
        return CostModel.from_json(f.read())
    except (OSError, ValueError, KeyError, TypeError) as e:
      raise InputError(f"cannot read a CostModel from {path!r}: {e}") from None

  # ---- for the jitted plan -------------------------------------------------------------------
  def arrays(self) -> "CostArrays":
    lat, rate = [], []
    for name in LINKS:
      link = self.links.get(name)
      if link is None and name in ("remote_to_host", "cross_shard", "pool_to_host"):
        # Until a transfer over this link has been observed, a block over it is assumed
        # to cost what a host block does, or with no host link nothing at all: the first
        # request that can use the link fetches, and that fetch, timed, replaces this
        # (without it a link never tried would look unusable and never be tried).
        link = self.links.get("host_to_device", UNTRIED_LINK)
      elif link is None and name == "host_to_device":
        link = UNTRIED_LINK  # (no host tier: remote and pool blocks still land through it)
      lat.append(link.latency_s if link else 0.0)
      rate.append(link.bytes_per_s if link else 1.0)  # absent link: unused (no bytes)
    p = self.prefill
    # numpy: the planner places them where the plan runs (planner.plan_device)
    return CostArrays(latency_s=np.asarray(lat, np.float32),
                      bytes_per_s=np.asarray(rate, np.float32),
                      prefill=np.asarray([p.t0_s, p.per_token_s, p.per_token_context_s],
                                         np.float32),
                      overlap=np.asarray(self.overlap, np.float32))


def overlap_seen(recompute_s: float, fetch_s: float, seconds: float) -> float | None:
  """The overlap that ``recompute_s`` of recompute and ``fetch_s`` of fetch showed by taking
  ``seconds`` together: full overlap takes the longer of the two, and what it took beyond
  that, over the shorter one, is the part that did not overlap (clipped to [0, 1]). None
  when one of them is not a time."""
  shorter = min(recompute_s, fetch_s)
  if shorter <= 0 or seconds <= 0:
    return None
  return min(max(1.0 - (seconds - max(recompute_s, fetch_s)) / shorter, 0.0), 1.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CostArrays:
  """A ``CostModel`` as the dense arrays the jitted plan reads (links in ``LINKS`` order)."""

  latency_s: jax.Array  # [links]
  bytes_per_s: jax.Array  # [links]
  prefill: jax.Array  # [3]: t0, per token, per token x context
  overlap: jax.Array  # []: CostModel.overlap


def agree_costs(costs: CostModel) -> CostModel:
  """Process 0's ``costs`` on every process: the one set a job plans with. A collective:
  every process calls it at the same point. A single process gets ``costs`` back."""
  if jax.process_count() == 1:
    return costs
  text = costs.to_json().encode() if jax.process_index() == 0 else b""
  return CostModel.from_json(distributed.broadcast_bytes(text).decode())
