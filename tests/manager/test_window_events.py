"""KV events of a hybrid model (``tests/hybrid_model.py``'s small Gemma 3): the global layers'
blocks and the window group's kept blocks, each event naming its group as vLLM's hybrid
events do (``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``), read
off the real socket with structs written here from vLLM's field order. A reader that knows
nothing of jaxkv but the wire computes how much of a prompt a replica can serve (the global
blocks, down to the longest cut whose window is kept) and the engine's hit is exactly that;
Dynamo's indexer, which keeps the full-attention group only, still answers the global
blocks while window blocks come and go."""

import math
import time

import jax
import msgspec
import numpy as np
import pytest
import zmq

import helpers
import jaxkv
from hybrid_model import PAGE, WINDOW, engine, prompt, run
from jaxkv.manager.events import MEDIA, block_hash
from jaxkv.manager.index import Tier
from jaxkv.tools.bench.indexer import DynamoIndexer
from jaxkv.worker.tiers.pool.master import free_port


# vLLM's events as its readers decode them (a tagged map; fields a reader does not know are
# ignored), with the hybrid fields after ``extra_keys``.
class Stored(msgspec.Struct, tag="BlockStored"):
  block_hashes: list[int]
  parent_block_hash: int | None
  token_ids: list[int]
  block_size: int
  lora_id: int | None
  medium: str | None
  lora_name: str | None = None
  extra_keys: list | None = None
  group_idx: int | None = None
  kv_cache_spec_kind: str | None = None
  kv_cache_spec_sliding_window: int | None = None


class Removed(msgspec.Struct, tag="BlockRemoved"):
  block_hashes: list[int]
  medium: str | None
  group_idx: int | None = None
  kv_cache_spec_kind: str | None = None
  kv_cache_spec_sliding_window: int | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared"):
  pass


class Batch(msgspec.Struct, array_like=True):
  ts: float
  events: list[Stored | Removed | Cleared]
  data_parallel_rank: int | None = None


class Reader:
  """A SUB socket that keeps what the stream says is held: ``(hash, medium, group_idx) ->
  Stored``, and each group's label."""

  def __init__(self, endpoint: str):
    self.sock = zmq.Context.instance().socket(zmq.SUB)
    self.sock.setsockopt(zmq.SUBSCRIBE, b"")
    self.sock.setsockopt(zmq.LINGER, 0)
    self.sock.connect(endpoint)
    self.decoder = msgspec.msgpack.Decoder(Batch)
    self.held, self.groups, self.removed = {}, {}, {0: 0, 1: 0}
    self.messages = 0

  def read_until(self, condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
      left = deadline - time.monotonic()
      if left <= 0:
        pytest.fail(f"{what}: not so after {timeout_s} s ({self.messages} messages read)")
      if self.sock.poll(max(1, int(min(left, 0.1) * 1000))):
        self.take()

  def take(self) -> None:
    _, _, payload = self.sock.recv_multipart()
    self.messages += 1
    for ev in self.decoder.decode(payload).events:
      if isinstance(ev, Cleared):
        self.held.clear()
        continue
      self.groups[ev.group_idx] = (ev.kv_cache_spec_kind, ev.kv_cache_spec_sliding_window)
      item = (ev.block_hashes[0], ev.medium, ev.group_idx)
      if isinstance(ev, Stored):
        assert item not in self.held, item  # (a medium's first copy only)
        self.held[item] = ev
      else:
        del self.held[item]  # (KeyError: removed what was never stored)
        self.removed[ev.group_idx] += 1

  def servable(self, tokens) -> int:
    """Tokens of ``tokens``' prefix the replica can serve, from the stream alone: the chain
    of full-attention blocks whose told tokens are the prompt's (any medium), cut back to
    the longest prefix whose window (the sliding-window group's blocks covering the
    ``kv_cache_spec_sliding_window`` tokens before it) is held too."""
    (full,) = [g for g, (kind, _) in self.groups.items() if kind == "full_attention"]
    (local,) = [g for g, (kind, _) in self.groups.items() if kind == "sliding_window"]
    window = math.ceil(self.groups[local][1] / PAGE)
    by_parent = {(ev.parent_block_hash, tuple(ev.token_ids)): h
                 for (h, _, g), ev in self.held.items() if g == full}
    chain, parent = [], None
    while (len(chain) + 1) * PAGE <= len(tokens):
      j = len(chain)
      parent = by_parent.get((parent, tuple(tokens[j * PAGE:(j + 1) * PAGE])))
      if parent is None:
        break
      chain.append(parent)
    local_held = {h for h, _, g in self.held if g == local}
    best = 0
    for cut in range(1, len(chain) + 1):
      if all(chain[j] in local_held for j in range(max(0, cut - window), cut)):
        best = cut
    return best * PAGE

  def close(self):
    self.sock.close(0)


def held_now(e) -> set:
  """What the engine holds, as the stream names it: ``(hash, medium, group_idx)``."""
  out = set()
  index, windows = e.cache.index, e.cache.manager.windows
  for tier, medium in MEDIA.items():
    if index.has_tier(tier):
      for s in range(e.cache.num_shards if tier != Tier.DISK else 1):
        out |= {(block_hash(k), medium, 0) for k in index.cached_keys(s, tier)}
  for s in range(e.cache.num_shards):
    out |= {(block_hash(k), "GPU", 1) for k, _ in windows.kept_items(s)}
    out |= {(block_hash(k), "CPU", 1) for k, _ in windows.host_items(s)}
  return out


def device(idx, tokens) -> int:
  """Tokens of ``tokens`` Dynamo's indexer says the engine (worker 7) holds on device."""
  return idx.query(tokens).get(7, {}).get("device", 0)


@pytest.fixture(scope="module")
def one():
  return jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])


def test_a_hybrid_models_events_say_how_far_each_prefix_is_served(one):
  """One conversation's windows are pushed out of a small window pool by other prompts
  while its global blocks stay: the stream removes the window group's blocks only, and a
  reader of the stream alone (above) predicts the engine's hit for the next turn exactly,
  before and after (the whole history, then nothing). Dynamo's indexer, fed the same
  stream, keeps answering the global blocks (it reads the full-attention group only), so a
  window group's comings and goings never take a block from its index. (Planted: no window events -> the reader finds no window
  group; window blocks told as the full-attention group -> Dynamo's answer shrinks.)"""
  pub, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
  tiers = jaxkv.TierConfig(kv_events=pub, kv_events_replay=replay, kv_events_raw_tokens=True)
  e = engine(one, rows=1, window_pages_per_shard=19, pages_per_shard=192, tiers=tiers)
  reader = Reader(pub)
  try:
    with DynamoIndexer() as idx:
      idx.register(7, pub, replay=replay, block_size=PAGE)
      reader.read_until(lambda: reader.messages, "the new reader's snapshot")
      first = prompt(14, 230)
      history = first + run(e, first, 8).tokens
      reader.read_until(lambda: set(reader.held) == held_now(e), "the stream to catch up")
      assert reader.groups == {0: ("full_attention", None), 1: ("sliding_window", WINDOW)}
      turn = history + prompt(17, 20)
      told = reader.servable(turn)
      assert told == len(history) // PAGE * PAGE
      helpers.wait_for(lambda: device(idx, turn) == told, 30, "Dynamo to hold the history")
      # Other prompts take the window pool: the first conversation's windows leave it.
      for seed in (15, 16, 18, 19):
        run(e, prompt(seed, 120), 2)
      marker = prompt(21, 3 * PAGE)  # (its blocks are told after every event before them)
      run(e, marker, 1)
      reader.read_until(lambda: set(reader.held) == held_now(e), "the stream to catch up")
      assert reader.removed[1] > 0
      assert reader.servable(turn) == 0
      helpers.wait_for(lambda: device(idx, marker) == len(marker), 30, "Dynamo to catch up")
      assert device(idx, turn) == told
      h = run(e, turn, 4)
      assert h.cached_tokens == 0
      # Answered again, its windows are kept: the next turn is served whole once more.
      history = turn + h.tokens
      turn = history + prompt(20, 20)
      reader.read_until(lambda: set(reader.held) == held_now(e), "the stream to catch up")
      told = reader.servable(turn)
      assert told == len(history) // PAGE * PAGE
      assert run(e, turn, 4).cached_tokens == told
  finally:
    reader.close()
    e.cache.close()
