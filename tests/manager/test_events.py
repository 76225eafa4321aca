"""KV events from a real engine, read off a real ZeroMQ socket and checked against vLLM's
format field by field (vLLM does not install here): three frames, gapless 8-byte seqs, a
msgpack ``[ts, events, dp_rank]`` payload with tagged-map events; what the stream says is
held equals what the index holds, medium by medium; replay, late subscribers, tenants,
hashes-only, and blocks whose tokens are learned after they were adopted."""

import collections
import time

import msgspec
import numpy as np
import pytest
import zmq

import helpers
import jaxkv
from jaxkv.manager.events import MEDIA, block_hash
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.pool.master import free_port

STORED_FIELDS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                 "lora_id", "medium", "lora_name"}


class Reader:
  """A SUB socket on the publisher that keeps every message and the state it describes."""

  def __init__(self, endpoint: str):
    self.sock = zmq.Context.instance().socket(zmq.SUB)
    self.sock.setsockopt(zmq.SUBSCRIBE, b"")
    self.sock.setsockopt(zmq.LINGER, 0)
    self.sock.connect(endpoint)
    self.messages = []  # (topic, seq, payload as plain msgpack)
    self.held = {}  # (hash, medium) -> the BlockStored map

  def read_until(self, condition, what: str, timeout_s: float = 10.0) -> None:
    """Takes messages until ``condition()`` holds; past ``timeout_s`` the test fails."""
    deadline = time.monotonic() + timeout_s
    while not condition():
      left = deadline - time.monotonic()
      if left <= 0:
        pytest.fail(f"{what}: not so after {timeout_s} s ({len(self.messages)} messages read)")
      if self.sock.poll(max(1, int(min(left, 0.1) * 1000))):
        self.take()

  def connected(self) -> None:
    """Waits for the snapshot the publisher sends each new subscriber: from then on the
    reader misses nothing (a SUB socket drops what is sent before it has subscribed)."""
    self.read_until(lambda: self.messages, "the new reader's snapshot")
    assert self.messages[0][2][1][0] == {"type": "AllBlocksCleared"}

  def take(self) -> None:
    topic, seq, payload = self.sock.recv_multipart()
    assert len(seq) == 8
    batch = msgspec.msgpack.decode(payload)
    self.messages.append((topic, int.from_bytes(seq, "big", signed=True), batch))
    for ev in batch[1]:
      if ev["type"] == "AllBlocksCleared":
        self.held.clear()
      elif ev["type"] == "BlockStored":
        self.held[ev["block_hashes"][0], ev["medium"]] = ev
      else:
        del self.held[ev["block_hashes"][0], ev["medium"]]

  def caught_up(self, engine) -> None:
    """Reads until the stream says the engine's index holds what it holds (an idle engine's
    events are all sent); past the deadline the test fails."""
    self.read_until(lambda: set(self.held) == index_state(engine),
                    "the stream to tell what the index holds")

  def close(self):
    self.sock.close(0)


def index_state(engine) -> set:
  """Every (hash, medium) the index holds (a block on several shards counts once)."""
  index, out = engine.cache.index, set()
  for tier, medium in MEDIA.items():
    if not index.has_tier(tier):
      continue
    for s in range(engine.cache.num_shards if tier != Tier.DISK else 1):
      out |= {(block_hash(k), medium) for k in index.cached_keys(s, tier)}
  return out


def endpoints():
  return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def prompts(n, length, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, 128, length).tolist() for _ in range(n)]


@pytest.fixture
def engine_with_events(mesh, tmp_path):
  made = []

  def make(tiers=None, **kw):
    pub, replay = endpoints()
    mc = helpers.tiny_model_config()
    cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=8)
    tiers = tiers or jaxkv.TierConfig(host_pages_per_shard=8, disk_kvstore=str(tmp_path / "d"),
                                      disk_pages=64)
    import dataclasses
    tiers = dataclasses.replace(tiers, kv_events=pub, kv_events_replay=replay, **kw)
    e = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=2)
    made.append(e)
    return e, pub, replay

  yield make
  for e in made:
    e.cache.close()


def test_the_stream_is_vllms_format_and_says_what_the_index_holds_medium_by_medium(
    engine_with_events):
  e, pub, _ = engine_with_events()
  reader = Reader(pub)
  try:
    reader.connected()
    ps = prompts(10, 22)
    e.generate(ps, 4)
    e.generate(ps[:3], 4)  # hits, and more evictions down the tiers
    e.flush()
    e.generate(ps[3:4], 1)  # publishes the disk writes that committed
    reader.caught_up(e)  # (what the stream says is held is what the index holds)
    seqs = [s for _, s, _ in reader.messages]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
    kinds = collections.Counter()
    for topic, _, batch in reader.messages:
      assert topic == b"" and isinstance(batch, list) and len(batch) == 3
      ts, events, rank = batch
      assert isinstance(ts, float) and abs(ts - time.time()) < 600 and rank == 0
      for ev in events:
        kinds[ev["type"]] += 1
        if ev["type"] == "BlockStored":
          assert set(ev) == STORED_FIELDS
          assert ev["block_size"] == 4 and len(ev["token_ids"]) == 4 and ev["lora_id"] is None
          assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])
          assert ev["medium"] in ("GPU", "CPU", "DISK")
        elif ev["type"] == "BlockRemoved":
          assert set(ev) == {"type", "block_hashes", "medium"}
        else:
          assert ev == {"type": "AllBlocksCleared"}
    assert kinds["BlockStored"] and kinds["BlockRemoved"] and kinds["AllBlocksCleared"] >= 1
    # ... in every medium.
    assert {m for _, m in reader.held} == {"GPU", "CPU", "DISK"}
    # Chains: a prompt's block j names block j-1 as its parent, and carries its tokens as
    # its tenant's router asks for them: one 32-bit id per token, keyed by the token and its
    # position (the same token at two positions is told as two ids), never the raw id.
    keys = e.cache.index.block_keys(ps[0], "default")
    stored = {h: ev for (h, _), ev in reader.held.items()}
    told = []
    # ps[0] ran twice and its blocks were flushed to disk: every one is held somewhere.
    assert len(keys) == 5 and all(block_hash(k) in stored for k in keys)
    for j, k in enumerate(keys):
      ev = stored[block_hash(k)]
      assert len(ev["token_ids"]) == 4 and all(0 <= t < 2**32 for t in ev["token_ids"])
      told += zip(ps[0][4 * j:4 * j + 4], ev["token_ids"])
      assert ev["parent_block_hash"] == (block_hash(keys[j - 1]) if j else None)
    assert all(raw != sent for raw, sent in told)
    repeated = [raw for raw, n in collections.Counter(r for r, _ in told).items() if n > 1]
    assert repeated  # (the prompt repeats a token: the check below means something)
    assert len({sent for _, sent in told}) == len(told)  # no repeat shows in the stream
  finally:
    reader.close()


def test_replay_answers_from_a_seq_and_a_late_reader_gets_a_snapshot(engine_with_events):
  e, pub, replay = engine_with_events()
  first = Reader(pub)
  try:
    first.connected()
    # Two runs, each read to the end before the next: at least two messages of stores after
    # the first (the publisher batches what one interval holds, so one run may be one).
    for half in (slice(0, 2), slice(2, 4)):
      e.generate(prompts(4, 18, seed=1)[half], 3)
      first.caught_up(e)
    assert len(first.messages) >= 3
    # Replay from the second message on: the same payloads, in order, then seq -1.
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay)
    start = first.messages[1][1]
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while dealer.poll(5000):
      _, seq, payload = dealer.recv_multipart()
      seq = int.from_bytes(seq, "big", signed=True)
      if seq == -1:
        assert payload == b""
        break
      got.append((seq, msgspec.msgpack.decode(payload)))
    else:
      pytest.fail("the replay did not end with seq -1")
    dealer.close(0)
    assert got[:len(first.messages) - 1] == [(s, b) for _, s, b in first.messages[1:]]
    # A reader that connects now is told everything held, after AllBlocksCleared.
    # (The publisher sends at most one snapshot a second, so it may come up to 1 s late.)
    late = Reader(pub)
    late.connected()
    late.caught_up(e)
    assert set(late.held) == set(first.held)
    assert e.cache.events_publisher.snapshots >= 2
    late.close()
  finally:
    first.close()


def test_tenants_identical_prompts_are_different_blocks_and_hashes_only_leaves_out_tokens(
    engine_with_events):
  e, pub, _ = engine_with_events(kv_events_tokens=False)
  reader = Reader(pub)
  try:
    reader.connected()
    p = prompts(1, 17, seed=2)[0]
    for tenant in ("alice", "bob"):
      e.submit(p, 2, tenant=tenant)
      while e.has_unfinished():
        e.step()
    reader.caught_up(e)
    gpu = {h for h, m in reader.held if m == "GPU"}
    a = {block_hash(k) for k in e.cache.index.block_keys(p, "alice")}
    b = {block_hash(k) for k in e.cache.index.block_keys(p, "bob")}
    assert len(a) == 4 and a <= gpu and b <= gpu and not a & b
    assert all(ev["token_ids"] == [] for ev in reader.held.values())
  finally:
    reader.close()


def told_tokens(engine, reader, prompt, tenant):
  """The token ids the stream told for ``tenant``'s blocks of ``prompt``, block by block."""
  stored = {h: ev for (h, _), ev in reader.held.items()}
  return [stored[block_hash(k)]["token_ids"] for k in engine.cache.index.block_keys(
      prompt, tenant) if block_hash(k) in stored]


def test_each_tenant_is_told_its_own_token_ids_and_raw_ids_are_an_opt_in(engine_with_events):
  """A router scoring by token ids (Dynamo's indexer) must never match one tenant's request
  against another's blocks: the same prompt's blocks carry different ids per tenant (and
  per cache_salt). kv_events_raw_tokens=True sends the prompt's own ids, as vLLM does."""
  p = prompts(1, 17, seed=3)[0]
  for raw in (False, True):
    e, pub, _ = engine_with_events(kv_events_raw_tokens=raw)
    reader = Reader(pub)
    try:
      reader.connected()
      for tenant in ("alice", "bob", "alice\x1fsalt"):
        e.submit(p, 2, tenant=tenant)
        while e.has_unfinished():
          e.step()
      reader.caught_up(e)
      told = {t: told_tokens(e, reader, p, t) for t in ("alice", "bob", "alice\x1fsalt")}
      assert all(len(blocks) == 4 for blocks in told.values()), told
      want = [p[4 * j:4 * j + 4] for j in range(4)]
      if raw:
        assert all(blocks == want for blocks in told.values())
      else:
        flat = {t: sum(blocks, []) for t, blocks in told.items()}
        assert not set(flat["alice"]) & set(flat["bob"])
        assert not set(flat["alice"]) & set(flat["alice\x1fsalt"])
        assert all(blocks != want for blocks in told.values())
    finally:
      reader.close()


def test_blocks_adopted_from_disk_are_told_once_a_prompt_names_their_tokens(
    engine_with_events, tmp_path):
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "warm"), disk_pages=64,
                           write_policy="write_through")
  first, _, _ = engine_with_events(tiers)
  p = prompts(1, 21, seed=3)[0]
  first.generate([p], 2)
  first.flush()
  first.generate([prompts(1, 5, seed=4)[0]], 1)  # the committed writes are published
  first.cache.close()
  e, pub, _ = engine_with_events(tiers)
  reader = Reader(pub)
  try:
    reader.connected()  # the snapshot: everything held that can be told
    adopted = e.cache.disk_recovered["adopted"]
    assert adopted >= 5 and e.cache.events.untold == adopted
    assert not any(m == "DISK" for _, m in reader.held)  # no tokens: not told yet
    e.generate([p], 2)
    keys = e.cache.index.block_keys(p, "default")
    state = index_state(e)
    reader.read_until(lambda: {(block_hash(k), "DISK") for k in keys} | {
        x for x in state if x[1] != "DISK"} <= set(reader.held),
                      "the stream to tell p's disk blocks and every block of another medium")
    assert set(reader.held) <= state
    assert {x for x in state if x[1] != "DISK"} <= set(reader.held)
    untold = {x for x in state if x[1] == "DISK"} - set(reader.held)
    assert len(untold) == e.cache.events.untold >= 1  # the other prompt's block
  finally:
    reader.close()


def test_a_taken_port_is_a_clear_error_naming_the_flag(mesh):
  taken = zmq.Context.instance().socket(zmq.PUB)
  port = taken.bind_to_random_port("tcp://127.0.0.1")
  try:
    with pytest.raises(jaxkv.InputError, match="kv_events='tcp://127.0.0.1:.*cannot listen"):
      helpers.make_engine(mesh, tiers=jaxkv.TierConfig(kv_events=f"tcp://127.0.0.1:{port}"))
    with pytest.raises(jaxkv.InputError, match="not an endpoint"):
      jaxkv.TierConfig(kv_events="127.0.0.1:5557")
    with pytest.raises(jaxkv.InputError, match="needs kv_events"):
      jaxkv.TierConfig(kv_events_replay="tcp://127.0.0.1:5558")
  finally:
    taken.close(0)
