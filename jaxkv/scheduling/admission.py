"""Admission: what a caller asked (``Request``) and where it runs (``Placement``).

``validate`` turns a call's prompts into frozen ``Request`` records, refusing before any
work whatever no step could ever run: an empty prompt, a token outside the vocabulary, a
non-integer token, more tokens than any tier can hold.

``admit`` takes requests off the front of a queue into the free rows of the running
batch (at most ``max_seqs_per_shard`` sequences per data shard). For each one it looks up where the
longest cached prefix of its blocks is, on every shard and in every tier: this shard's
device pool, its host pool, the disk store, another shard's device pool (copied across
with a collective), another job (remote). The request goes to the shard where it is
predicted cheapest (the ``cost`` decision runs the plan over every shard when that is a
real choice), else to the one with the longest, most-on-device prefix. Placing it takes
references on its cached blocks and allocates device pages for everything it will write;
a lower-tier block becomes a ``Fetch`` into one of those pages. The result, a frozen
``Placement``, is produced once; the scheduler reads it and never changes it.

A request that does not fit now waits for a later step; once every shard is full the
rest of the queue is not looked at (each admission looks up ~one request per free row, not
the whole queue).
"""

from __future__ import annotations

import collections
import dataclasses
import warnings

import numpy as np

from jaxkv.config import SamplingParams
from jaxkv.errors import CapacityError, InputError, check_text
from jaxkv.manager.index import LOCAL_TIERS, Tier
from jaxkv.manager import PENDING, POOL_PEER
from jaxkv.scheduling.step import Fetch


@dataclasses.dataclass(frozen=True)
class Request:
  """One prompt of a call, validated."""

  id: int  # the request's id (``RequestHandle.id``): the engine's, one space for all requests
  tokens: np.ndarray  # [prompt] int32
  sampling: SamplingParams
  tenant: str
  keys: tuple  # block keys of the prompt's full blocks (empty without prefix reuse)
  num_pages_needed: int  # KV is written for the prompt and all generated tokens but the last
  streamed: bool = False  # longer than a device pool holds: cold pages stream from host
  shard: int | None = None  # runs only on this data shard (``Engine.pin``); None: any

  @property
  def max_new_tokens(self) -> int:
    return self.sampling.max_new_tokens

  @property
  def index(self) -> int:
    """Deprecated: the request's id under its former name (it was never a position)."""
    warnings.warn("Request.index is deprecated: it is Request.id.", DeprecationWarning,
                  stacklevel=2)
    return self.id


@dataclasses.dataclass(frozen=True)
class Placement:
  """Where a request runs and what it reuses: ``pages[j]`` is the device page of block j;
  its first ``len(hit_tiers)`` blocks are cached (``hit_tiers[j]`` says where), and each
  one not on this shard's device pool is a ``Fetch`` into its page."""

  request: Request
  shard: int
  pages: tuple
  hit_tiers: tuple
  fetches: tuple
  evicted: tuple = ()  # (shard, page, key) of cached blocks whose pages it took
  # The window group's (a model with sliding-window layers; ``jaxkv.manager.windows``): the
  # sequence's ring of pages, and ``(block, page)`` of the kept window blocks it pins.
  window_ring: tuple = ()
  window_held: tuple = ()

  @property
  def hot_blocks(self) -> int:
    """Leading cached blocks already on this shard's device pool."""
    return next((j for j, t in enumerate(self.hit_tiers) if t != Tier.DEVICE),
                len(self.hit_tiers))

  @property
  def cached_blocks(self) -> int:
    return len(self.hit_tiers)


class Admission:
  """Validates and places requests on one cache's shards. It sees the cache's host side
  only: the ``CacheManager`` (index, pins, allocation) and the ``CacheConfig``."""

  def __init__(self, manager, config, *, max_seqs_per_shard: int, prefix_reuse: bool,
               vocab_size: int, planner, stream=None):
    self.manager, self.config, self.planner, self.stream = manager, config, planner, stream
    self.max_seqs_per_shard, self.prefix_reuse = max_seqs_per_shard, prefix_reuse
    # Requests whose window blocks the last plan loaded from host memory (placed next).
    self._loaded_windows: set[int] = set()
    # Request id -> (keys of its blocks whose window the pool, or a peer, holds; that peer,
    # None for the pool): its last lookup beyond this cache's tiers.
    self._pooled: dict[int, tuple] = {}
    self.vocab_size = vocab_size

  def forget(self, request_ids) -> None:
    """Requests that left before being placed (aborted, failed): what admission noted."""
    for r in request_ids:
      self._loaded_windows.discard(r)
      self._pooled.pop(r, None)

  def set_stream(self, stream) -> None:
    """How sequences longer than a device pool are served from now on (None: refused)."""
    self.stream = stream

  # ---- validation ------------------------------------------------------------------------------
  def validate(self, prompts, sampling, tenant, *, first_id: int = 0,
               shard: int | None = None) -> list[Request]:
    """``sampling``: a ``SamplingParams`` for every prompt, one per prompt (a list), or an
    integer ``max_new_tokens`` (greedy). Request ids count from ``first_id``; ``shard``
    restricts every request to one data shard."""
    c = self.config
    check_text(tenant, "tenant")
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
      prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
      raise InputError("prompts must be a non-empty list of token-id lists, e.g. [[1, 2, 3]].")
    params = _sampling_per_prompt(sampling, len(prompts))
    requests = []
    for i, (p, sp) in enumerate(zip(prompts, params)):
      tokens = self._check_prompt(i, p)
      total = len(tokens) + sp.max_new_tokens - 1
      streamed = total > c.max_seq_len
      if streamed:
        self._check_streamable(i, len(tokens), sp.max_new_tokens, total)
        if sp.prompt_logprobs is not None:
          raise InputError(
              f"prompt {i}: prompt_logprobs need every prompt token's logits, which a "
              f"sequence streamed from host memory ({total} tokens, more than a device "
              f"pool's {c.max_seq_len}) does not compute together; ask for the prompt's "
              "log-probabilities on a prompt that fits (or score it in parts).")
      if sp.top_k > self.vocab_size:
        raise InputError(f"prompt {i}: top_k={sp.top_k} is more than the vocabulary's "
                         f"{self.vocab_size} tokens; pass top_k <= {self.vocab_size} (0: "
                         "no limit).")
      bad = [t for t in sp.stop_token_ids if t >= self.vocab_size]
      if bad:
        raise InputError(f"prompt {i}: stop_token_ids {bad} are outside the vocabulary "
                         f"[0, {self.vocab_size}).")
      keys = (self.manager.block_keys(tokens, tenant)
              if self.prefix_reuse and not streamed else [])
      requests.append(Request(id=first_id + i, tokens=tokens, sampling=sp, tenant=tenant,
                              keys=tuple(keys), num_pages_needed=-(-total // c.page_size),
                              streamed=streamed, shard=shard))
    # Refuse before any work what no wave could ever hold (pages held outside this call,
    # e.g. pinned blocks, can make the free budget smaller than the pool).
    shards = range(self.manager.num_shards) if shard is None else [shard]
    room = max(self.manager.index.num_available(s) for s in shards)
    for i, req in enumerate(requests):
      if not req.streamed and req.num_pages_needed > room:
        raise CapacityError(
            f"prompt {i} needs {req.num_pages_needed} device pages but at most {room} "
            f"are free or evictable on any shard (pages_per_shard={c.pages_per_shard}); "
            "release pinned blocks or raise pages_per_shard.")
    return requests

  def _check_prompt(self, i: int, prompt) -> np.ndarray:
    arr = np.asarray(prompt)
    if arr.ndim != 1 or arr.size == 0:
      raise InputError(f"prompt {i} must be a non-empty 1-D list of token ids; got shape "
                       f"{arr.shape}.")
    if arr.dtype.kind not in "iu":
      raise InputError(f"prompt {i} has dtype {arr.dtype}; token ids must be integers "
                       "(convert with np.asarray(prompt, np.int32)).")
    bad = np.flatnonzero((arr < 0) | (arr >= self.vocab_size))
    if bad.size:
      j = int(bad[0])
      raise InputError(f"prompt {i} token {j} is {int(arr[j])}, outside the vocabulary "
                       f"[0, {self.vocab_size}).")
    tokens = arr.astype(np.int32)  # a copy: the caller's list or array stays theirs
    tokens.setflags(write=False)
    return tokens

  def _check_streamable(self, i: int, prompt_len: int, max_new_tokens: int, total: int) -> None:
    """Refuses, before any work, a sequence that even the lower tiers cannot hold."""
    c, st, index = self.config, self.stream, self.manager.index
    if st is None:
      raise InputError(
          f"prompt {i} has {prompt_len} tokens + max_new_tokens={max_new_tokens} needs KV for "
          f"{total} tokens, more than a sequence can hold (max_pages_per_seq="
          f"{c.max_pages_per_seq} x page_size={c.page_size} = {c.max_seq_len}). Shorten the "
          "prompt, lower max_new_tokens, raise max_pages_per_seq, or stream long contexts "
          "from host memory (Engine(..., stream=jaxkv.StreamConfig(...))).")
    cold = -(-total // c.page_size) - st.sink_pages - st.window_pages
    room = min(st.max_cold_pages, max(index.num_available(s, Tier.HOST)
                                      for s in range(self.manager.num_shards)))
    if st.source == "disk":
      room = min(room, index.num_available(0, Tier.DISK))
    if cold > room:
      raise CapacityError(
          f"prompt {i} needs {cold} pages in host memory beyond the {st.sink_pages} sink and "
          f"{st.window_pages} window pages on device, but a shard can give it {room} "
          f"(StreamConfig.max_cold_pages={st.max_cold_pages}, host pages free or evictable); "
          "raise host_pages_per_shard or max_cold_pages, or shorten the request.")

  # ---- placement -------------------------------------------------------------------------------
  def admit(self, pending: collections.deque, running: list[int] | None = None, *,
            wait_for_own_shard: bool = True) -> list[Placement]:
    """Places requests from the front of ``pending`` (which keeps the rest, in order);
    a request with a ``shard`` goes only there (``Engine.pin``). ``running``: the
    sequences each shard runs already; the rows left are filled. ``wait_for_own_shard``:
    a request may wait for a busy shard that holds more of its prefix (continuous
    batching; a wave takes whatever shard has room)."""
    num_shards = self.manager.num_shards
    load = list(running) if running is not None else [0] * num_shards
    wave: list[Placement] = []
    waiting = collections.deque()
    asking = False  # a request waits for a peer's answer or its window (not for room)
    while pending and any(n < self.max_seqs_per_shard for n in load):
      req = pending.popleft()
      found = self._lookup(req)
      if found is PENDING:  # it waits in the queue for the answer; the others go on
        waiting.append(req)
        asking = True
        continue
      order = self._shard_order(req, found, load) if req.shard is None else [req.shard]
      if (wait_for_own_shard and req.shard is None
          and self._wait_for_own_shard(found, order, load)):
        waiting.append(req)
        continue
      if (req.id not in self._loaded_windows and load[order[0]] < self.max_seqs_per_shard
          and self._load_windows(req, order[0], found[order[0]])):
        self._loaded_windows.add(req.id)  # (once: placed next step on what is kept then)
        waiting.append(req)  # (its window comes back to the device with this step)
        asking = True
        continue
      self._loaded_windows.discard(req.id)
      self._pooled.pop(req.id, None)
      for s in order:
        placed = (self._place(req, s, found[s]) if load[s] < self.max_seqs_per_shard
                  else None)
        if placed is not None:
          load[s] += 1
          wave.append(placed)
          break
      else:
        waiting.append(req)
    pending.extendleft(reversed(waiting))
    if not wave and not any(load) and not asking:  # after validate's room check: pages leaked
      raise CapacityError("no request fits in an empty wave; the cache's page budget is held "
                          "elsewhere.")
    return wave

  def _lookup(self, req: Request):
    """Per shard, ``(tier, slot)`` of each block of the longest cached prefix that leaves
    at least one prompt token to compute (its logits give the first token); ``PENDING``
    while a remote peer's answer about a longer one has not come."""
    index, num_shards = self.manager.index, self.manager.num_shards
    if req.sampling.prompt_logprobs is not None:  # every prompt token's logits: no reuse
      return [[] for _ in range(num_shards)]
    usable = (len(req.tokens) - 1) // self.config.page_size
    keys = list(req.keys[:usable])
    tiers = self.manager.lookup_tiers()
    found = [index.locate(s, keys, tiers) if keys else [] for s in range(num_shards)]
    found = self._with_other_shards(found)
    local = max(len(f) for f in found)
    if self.manager.remote is not None and len(keys) <= local:
      self.manager.forget_peer_lookups([req.id])  # asked before it was cached here: moot
    elif self.manager.remote is not None:
      remote = self.manager.peer_prefix(req.id, keys)
      if remote is PENDING:
        return PENDING
      if remote and remote[1] > local:
        peer, n = remote[:2]
        where = (Tier.POOL, None) if peer == POOL_PEER else (Tier.REMOTE, peer)
        found = [f + [where] * (n - len(f)) for f in found]
        if len(remote) > 2:  # blocks whose window the pool (or that peer) holds too
          self._pooled[req.id] = (frozenset(keys[j] for j in remote[2] if j < len(keys)),
                                  None if peer == POOL_PEER else peer)
    return found

  def _shard_order(self, req: Request, found: list, load: list) -> list[int]:
    predicted = self.planner.shard_times([[t for t, _ in f] for f in found], len(req.tokens))
    shards = range(self.manager.num_shards)
    if predicted is not None:  # the plan's predicted time on each shard decides
      return sorted(shards, key=lambda s: (predicted[s], load[s], s))
    on_device = [sum(t == Tier.DEVICE for t, _ in f) for f in found]
    return sorted(shards, key=lambda s: (-len(found[s]), -on_device[s], load[s], s))

  def _wait_for_own_shard(self, found: list, order: list[int], load: list[int]) -> bool:
    """Continuous batching: whether a request should wait for a busy shard that can give
    it a longer cached prefix than any shard with a free row (its host-tier copies, say,
    which other shards cannot reach): it runs there as soon as a row frees instead of
    recomputing. Blocks another shard holds on device count everywhere (copied across)."""
    free = [s for s in order if load[s] < self.max_seqs_per_shard]
    if not free or load[order[0]] < self.max_seqs_per_shard:
      return False
    return len(found[order[0]]) > max(len(found[s]) for s in free)

  def _with_other_shards(self, found: list) -> list:
    """Extends each shard's cached prefix with blocks another shard holds on device: a
    request placed there can copy them across (a collective) instead of recomputing."""
    lead = [next((j for j, (t, _) in enumerate(f) if t != Tier.DEVICE), len(f)) for f in found]
    best = max(range(len(found)), key=lambda s: (lead[s], -s))
    if lead[best] == 0 or len(found) == 1:
      return found
    src = [(Tier.SHARD, (best, slot)) for _, slot in found[best][:lead[best]]]
    return [f if s == best or len(f) >= lead[best] else f + src[len(f):]
            for s, f in enumerate(found)]

  def _place(self, req: Request, shard: int, found: list) -> Placement | None:
    """Takes references for ``req`` on ``shard``: its hits (pinned) and fresh pages."""
    m = self.manager
    found = _usable(found)

    def pins(take: bool):
      for tier, slot in found:
        if tier in LOCAL_TIERS:
          (m.acquire if take else m.release)(shard, [slot], tier)
        elif tier == Tier.SHARD:  # the source page on the other shard stays put meanwhile
          (m.acquire if take else m.release)(slot[0], [slot[1]], Tier.DEVICE)

    windows = m.windows
    if windows is not None:  # a hit needs the window before its cut (and before the hot part)
      found = found[:self._window_cut(windows, shard, req.keys, found)]
    pins(True)
    ring, held = (), {}
    if windows is not None:
      hot = next((j for j, (t, _) in enumerate(found) if t != Tier.DEVICE), len(found))
      taken = windows.place(shard, req.keys, (hot, len(found)))
      if taken is None:
        pins(False)
        return None
      ring, held = taken
    n_device = sum(t == Tier.DEVICE for t, _ in found)
    fresh, evicted = self.manager.allocate_pages(shard, req.num_pages_needed - n_device)
    if fresh is None:
      pins(False)
      if windows is not None:
        windows.release(shard, ring, held.values())
      return None
    fresh = collections.deque(fresh)
    pages, fetches = [], []
    for j, (tier, slot) in enumerate(found):
      if tier == Tier.DEVICE:
        pages.append(slot)
      else:
        page = fresh.popleft()
        pages.append(page)
        fetches.append(Fetch(req.id, j, shard, tier, slot, req.keys[j], page))
    pages.extend(fresh)
    return Placement(request=req, shard=shard, pages=tuple(pages),
                     hit_tiers=tuple(t for t, _ in found), fetches=tuple(fetches),
                     evicted=evicted, window_ring=tuple(ring),
                     window_held=tuple(sorted(held.items())))

  @staticmethod
  def _window_cut(windows, shard: int, keys, found: list, host: bool = False,
                  pooled: frozenset = frozenset(), disk: bool = False) -> int:
    """How much of a cached prefix a model with a window group can use on ``shard``: the
    longest cut whose window is kept there; past the blocks on device only if the window
    before them is kept too (a plan that recomputes from there, or a fetch that fails,
    resumes at it). ``host``: counting the windows kept in host memory as well; ``disk``:
    and the disk's records; ``pooled``: and those of these keys, in the pool."""
    hot = next((j for j, (t, _) in enumerate(found) if t != Tier.DEVICE), len(found))
    cut = windows.cover(shard, keys, len(found), host=host, pooled=pooled, disk=disk)
    at_hot = windows.cover(shard, keys, hot, host=host, pooled=pooled, disk=disk)
    return at_hot if cut > hot and at_hot != hot else cut

  def _load_windows(self, req: Request, shard: int, found: list) -> bool:
    """Whether ``req`` waits a step for window blocks of its hit on ``shard`` that are kept
    only in host memory, on the disk or in the pool: loaded (checked) by this step's plan,
    kept on the device by the next, where it is placed with them."""
    windows = self.manager.windows
    found = _usable(found)
    pooled, peer = self._pooled.get(req.id, (frozenset(), None))
    disk = bool(windows is not None and windows.records.kept)
    if windows is None or not (windows.host_slots or pooled or disk) or not found:
      return False
    on_device = self._window_cut(windows, shard, req.keys, found)
    cut = self._window_cut(windows, shard, req.keys, found, True, pooled, disk)
    # From the disk or the pool only where the windows' bytes come sooner than recomputing
    # what they extend the hit by (the plan prices the blocks themselves once placed).
    if disk and cut > on_device and not self._window_loads_pay(
        windows, shard, req.keys, found, cut, "disk_to_host", True, pooled, False):
      disk = False
      cut = self._window_cut(windows, shard, req.keys, found, True, pooled)
    link = "pool_to_host" if peer is None else "remote_to_host"
    if pooled and cut > on_device and not self._window_loads_pay(
        windows, shard, req.keys, found, cut, link, disk, frozenset(), disk):
      pooled = frozenset()
      cut = self._window_cut(windows, shard, req.keys, found, True, disk=disk)
    if cut <= on_device:
      return False
    hot = next((j for j, (t, _) in enumerate(found) if t != Tier.DEVICE), len(found))
    return windows.load(shard, req.keys, (min(hot, cut), cut), pooled=pooled, disk=disk,
                        peer=peer) > 0

  def _window_loads_pay(self, windows, shard: int, keys, found: list, cut: int, link: str,
                        disk: bool, pooled: frozenset, counted_disk: bool) -> bool:
    """Whether loading the window blocks before ``cut`` that are on ``link``'s side (the
    disk's records, or the pool's or a peer's values) is predicted to take less than
    recomputing from the cut reached without them; counts the blocks skipped when not
    (``window_disk_skipped``, ``window_pool_skipped``, ``window_remote_skipped``)."""
    on_disk, others = windows.missing(shard, keys, cut, disk=disk)
    n = on_disk if link == "disk_to_host" else others
    near = self._window_cut(windows, shard, keys, found, True, pooled, counted_disk)
    c = self.config
    if not n or cut <= near or self.planner.fetch_pays(
        link, n * c.page_bytes * c.window_layers // c.num_layers,
        (cut - near) * c.page_size, near * c.page_size):
      return True
    self.manager.stats.add(f"window_{link.split('_')[0]}_skipped", n)
    return False


def _usable(found: list) -> list:
  """A cached prefix as a placement can use it: a device block after a lower-tier one is
  left out (with what follows): a split may recompute that stretch, and recomputing must
  never write into a shared page."""
  lower = next((j for j, (t, _) in enumerate(found) if t != Tier.DEVICE), None)
  if lower is not None:
    later = next((j for j, (t, _) in enumerate(found) if t == Tier.DEVICE and j > lower), None)
    if later is not None:
      return found[:later]
  return found


def _sampling_per_prompt(sampling, n: int) -> list[SamplingParams]:
  if isinstance(sampling, SamplingParams):
    return [sampling] * n
  if isinstance(sampling, (list, tuple)):
    if len(sampling) != n or not all(isinstance(s, SamplingParams) for s in sampling):
      raise InputError(f"sampling must be one jaxkv.SamplingParams or a list of {n} (one per "
                       f"prompt); got {len(sampling)} items.")
    return list(sampling)
  if (not isinstance(sampling, (int, np.integer)) or isinstance(sampling, bool)
      or sampling < 1):
    raise InputError(f"max_new_tokens={sampling!r} must be an integer >= 1 (or pass "
                     "jaxkv.SamplingParams).")
  return [SamplingParams(max_new_tokens=int(sampling))] * n
