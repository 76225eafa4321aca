"""REMOTE tier under attack: floods, forgers on the path, wrong keys and lying answers cost
a counted miss or a bounded poll, never a wrong token, a stuck engine or an exception.

The serving job here runs in this process (its ``BlockServer`` polled on a thread, as a
server's engine thread would between steps) on real loopback sockets; only the transfer
pull, which needs two processes, uses the owner subprocess of ``test_remote``.

A keyed server takes only connections that pass its handshake (a token derived from the
key). The attackers here that test the second line (challenges, MACs, the poll's budget)
hold that token, as one on the path would: it crosses in clear.
"""

import collections
import contextlib
import json
import threading
import time

import numpy as np

import google_crc32c
import jax.numpy as jnp
import pytest
import zmq

import jaxkv
from jaxkv import security
from jaxkv.errors import InputError
from jaxkv.tiers import remote
from jaxkv.tiers.remote import BlockServer, RemoteClient, RemoteError

import helpers
from test_remote import KEY, PREFIX, start_owner

OTHER_KEY = bytes(range(100, 132))
PROMPT = PREFIX + [50, 51, 52]


@contextlib.contextmanager
def serving(server):
  """``server`` answering on a thread, as an engine thread polls between steps."""
  stop = threading.Event()
  thread = threading.Thread(target=lambda: [server.poll(0.01) for _ in iter(stop.is_set, True)])
  thread.start()
  try:
    yield server
  finally:
    stop.set()
    thread.join()


def _owner(mesh, key):
  engine = helpers.make_engine(mesh, deployment_key=key)
  engine.generate([PREFIX], 2)  # the prefix the other job will reuse
  return engine


@pytest.fixture(scope="module")
def want(mesh):
  """The tokens a fresh recompute of ``PROMPT`` gives: what every reader must give."""
  return helpers.make_engine(mesh, prefix_reuse=False).generate([PROMPT], 5)


def _serving_owner(mesh, key):
  """A serving job under ``key``: its engine and its block server, answering."""
  engine = _owner(mesh, key)
  server = BlockServer(engine.cache)
  with serving(server):
    yield engine, server
  server.close()


@pytest.fixture(scope="module")
def owner(mesh):
  """A keyed serving job."""
  yield from _serving_owner(mesh, KEY)


@pytest.fixture(scope="module")
def plain_owner(mesh):
  """A serving job without a key (on loopback: allowed, and said to be insecure)."""
  yield from _serving_owner(mesh, None)


def _keys(engine):
  return engine.cache.index.block_keys(PREFIX, "default")


def _reader(mesh, peer, *, key=KEY, encryption="auto", transport="inline"):
  return helpers.make_engine(mesh, tiers=jaxkv.TierConfig(
      remote_peers=(peer,), read_deadline_s=5.0, encryption=encryption,
      remote_transport=transport), deployment_key=key)


def _raw(address, key=None):
  """A bare connection; with ``key``, it passes the handshake (its token, and only that:
  its requests still need the key's MACs)."""
  sock = zmq.Context.instance().socket(zmq.DEALER)
  sock.setsockopt(zmq.LINGER, 0)
  if key is not None:
    sock.plain_username = remote._HANDSHAKE_USER
    sock.plain_password = remote._handshake_token(key)
  sock.connect(f"tcp://{address}")
  return sock


def _auth(sock, message, key=KEY) -> bytes:
  """The auth frame of ``message`` on ``sock``: a hello's challenge, MACed with ``key``."""
  challenge = _ask(sock, "hi", remote.Hello(nonce="hi"))["challenge"]
  return f"{challenge} {security.challenge_mac(key, challenge, message.encode())}".encode()


def _ask(sock, nonce, message, auth=b""):
  """Sends one request by hand; the answer's header, read without checking its tag."""
  sock.send_multipart([nonce.encode(), message.encode(), auth])
  assert sock.poll(10_000), message
  return json.loads(sock.recv_multipart()[1])


class Proxy:
  """A man in the middle on loopback: forwards one client's requests to ``server_address``
  and the answers back, keeping every blocks frame it saw (``data_frames``). ``forge``:
  change the blocks (a few bits) and fix up the CRC-32C their header carries, if any.
  ``key``: the handshake token of a keyed server, which a man in the middle reads off the
  wire (the proxy takes it on both sides; the key itself it has not)."""

  def __init__(self, server_address: str, forge: bool = False, key=None):
    self._ctx = zmq.Context()  # its own: a keyed front needs its own handshake handler
    self.front, self.back = self._ctx.socket(zmq.ROUTER), self._ctx.socket(zmq.DEALER)
    for sock in (self.front, self.back):
      sock.setsockopt(zmq.LINGER, 0)
    self._gatekeeper = None
    if key is not None:
      token = remote._handshake_token(key)
      self._gatekeeper = remote._Gatekeeper(self._ctx, token)
      self.front.plain_server = True
      self.back.plain_username, self.back.plain_password = remote._HANDSHAKE_USER, token
    self.address = f"127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
    self.back.connect(f"tcp://{server_address}")
    self.forge, self.forged, self.data_frames = forge, 0, []
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run)
    self._thread.start()

  def _run(self):
    poller = zmq.Poller()
    poller.register(self.front, zmq.POLLIN)
    poller.register(self.back, zmq.POLLIN)
    client = None
    while not self._stop.is_set():
      for sock, _ in poller.poll(20):
        frames = sock.recv_multipart()
        if sock is self.front:
          client = frames[0]
          self.back.send_multipart(frames[1:])
          continue
        if len(frames) >= 4:  # [nonce, header, tags, blocks (sealed: a frame a piece)]
          self.data_frames.append(b"".join(frames[3:]))
          if self.forge:
            frames = self._forged(frames)
        self.front.send_multipart([client, *frames])

  def _forged(self, frames):
    nonce, header, tag, data, *more = frames
    data = bytearray(data)
    for i in range(64, len(data), 997):
      data[i] ^= 0x10
    answer = json.loads(header)
    if answer.get("crc32c") is not None:  # CRC-32C is no proof: anyone can recompute it
      answer["crc32c"] = google_crc32c.value(bytes(data))
      header = json.dumps(answer).encode()
    self.forged += 1
    return [nonce, header, tag, bytes(data), *more]

  def close(self):
    self._stop.set()
    self._thread.join()
    self.front.close(0)
    self.back.close(0)
    if self._gatekeeper is not None:
      self._gatekeeper.close()
    self._ctx.term()


def test_without_the_handshake_token_nothing_is_queued(owner):
  """ZeroMQ caps a frame, not a message: a connection that could reach ``poll`` could have
  it queue one message of hundreds of maximal frames. Connections without the handshake
  token (none at all, or another key's) each send a message of 200 frames of 1 MiB and
  1,000 hellos: the handshake turns them away before libzmq queues any of it, so the
  server reads nothing (its counts do not move), counts the other key's handshakes, and
  still serves a keyed client."""
  engine, server = owner
  before, refused = +server.counts, server.handshakes_refused  # (+: nonzero counts)
  socks = [_raw(server.address), _raw(server.address, OTHER_KEY)]
  try:
    for sock in socks:  # as much as ZeroMQ takes (it stops taking once a handshake failed)
      with contextlib.suppress(zmq.Again):
        sock.send_multipart([b"big", *[bytes(1 << 20)] * 200], flags=zmq.NOBLOCK)
        for i in range(1000):
          sock.send_multipart([b"h%d" % i, remote.Hello(nonce=f"h{i}").encode(), b""],
                              flags=zmq.NOBLOCK)
    time.sleep(1.0)  # long enough for 200 MiB and the hellos to cross loopback, and be read
    assert +server.counts == before
    assert server.handshakes_refused > refused
    assert not any(sock.poll(0) for sock in socks)  # and nothing came back
  finally:
    for sock in socks:
      sock.close(0)
  client = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=KEY)
  assert client.lookup(_keys(engine)) == 10 and not client.failures_by_reason


def test_a_client_with_another_key_is_refused_in_the_handshake(owner):
  """A client with the wrong key gets no answer at all: its lookup is a miss counted as
  "refused" as soon as the handshake fails (well within its deadline), and the server
  queued nothing of its (only the refused handshake is counted)."""
  engine, server = owner
  before, refused = +server.counts, server.handshakes_refused  # (+: nonzero counts)
  wrong = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=OTHER_KEY)
  assert wrong.lookup(_keys(engine)) == 0
  # "refused", not "deadline": it was told by the handshake, not left to time out.
  assert wrong.failures_by_reason == {"refused": 1} and wrong.hellos == 0
  # Nothing of its reached the server. ("answered" is left out: the module's server keeps
  # serving, and an earlier test's client may still have an answer in flight.)
  strangers = lambda counts: {k: v for k, v in counts.items() if k != "answered"}
  assert strangers(+server.counts) == strangers(before)
  assert server.handshakes_refused >= refused + 1


def test_a_hello_flood_evicts_no_peer(owner):
  """5,000 hellos from 25 connections (no key needed for a hello, the handshake token
  only) while a keyed peer is connected: the server keeps no challenge, so the peer's
  lookups are answered under the challenge it already had, without saying hello again."""
  engine, server = owner
  keys = _keys(engine)
  client = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=KEY)
  assert client.lookup(keys) == 10 and client.hellos == 1
  hellos = server.counts["hello"]
  socks = [_raw(server.address, KEY) for _ in range(25)]
  try:
    for i in range(5000):
      nonce = f"flood{i}"
      socks[i % 25].send_multipart([nonce.encode(), remote.Hello(nonce=nonce).encode(), b""])
    assert client.lookup(keys) == 10  # in the middle of the flood
    for _ in range(600):  # until the flood is answered (each poll answers 64 at most)
      if server.counts["hello"] - hellos >= 5000:
        break
      time.sleep(0.1)
    assert server.counts["hello"] - hellos == 5000
    assert client.lookup(keys) == 10
    assert client.hellos == 1 and not client.failures_by_reason
  finally:
    for sock in socks:
      sock.close(0)


def test_a_flood_of_junk_costs_a_poll_its_budget_at_most(owner):
  """One connection with the handshake token, but not the key, sends junk for 2 s as fast
  as it can: each
  ``poll(0.01)`` reads at most ``max_messages_per_poll`` messages and answers at most
  ``max_messages_per_peer`` of one peer's, then returns with the rest still queued."""
  engine, _ = owner
  server = BlockServer(engine.cache)
  fp = engine.cache.config.fingerprint().hex()
  junk = [[b"j1", remote.Lookup(nonce="j1", fingerprint=fp, keys=tuple(_keys(engine))).encode(),
           b"0-deadbeef 00"],
          [b"j2", b"\x00\xff not json", b""],
          [b"j3"], [b"j4", b"a", b"b", b"c", b"d"]]
  stop = threading.Event()
  sent = collections.Counter()

  def flood():
    sock = _raw(server.address, KEY)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and not stop.is_set():
      try:
        sock.send_multipart(junk[sent["n"] % len(junk)], flags=zmq.NOBLOCK)
        sent["n"] += 1
      except zmq.Again:
        time.sleep(0.001)
    sock.close(0)

  thread = threading.Thread(target=flood)
  thread.start()
  try:
    for _ in range(1000):
      if server.waiting():
        break
      time.sleep(0.01)
    polls = []
    while thread.is_alive():  # the whole flood
      answered = server.poll(0.01)
      polls.append((answered, server.waiting()))
    assert polls and all(n <= server.max_messages_per_peer <= server.max_messages_per_poll
                         for n, _ in polls), polls
    assert any(still_waiting for _, still_waiting in polls), polls  # returned with work left
    assert server.counts["shed"] > 0 and server.counts["unauthenticated"] > 0
    assert server.counts["malformed"] > 0
  finally:
    stop.set()
    thread.join()
  with serving(server):  # and the next keyed peer is served
    client = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=KEY)
    assert client.lookup(_keys(engine)) == 10
  server.close()


@pytest.mark.parametrize("encryption", ["off", "auto"])
@pytest.mark.parametrize("piece_bytes", [None, 1000])
def test_a_forged_payload_with_a_fixed_up_crc_is_rejected(mesh, owner, want, encryption,
                                                          piece_bytes, monkeypatch):
  """A forger between reader and owner changes the blocks and fixes up any CRC-32C: a
  keyed reader rejects them (the tags cover the bytes; sealed ones do not open), counts
  why, and recomputes: its tokens equal a fresh recompute's. (``piece_bytes``: blocks
  tagged or sealed in many pieces.)"""
  _, server = owner
  if piece_bytes:
    monkeypatch.setattr(remote, "_CHUNK_BYTES", piece_bytes)
  proxy = Proxy(server.address, forge=True, key=KEY)
  try:
    engine = _reader(mesh, proxy.address, encryption=encryption)
    assert engine.generate([PROMPT], 5) == want
    s = engine.stats()
    assert proxy.forged == 1 and s["hits"]["remote"] == 0
    assert s["verify_failures_by_reason"] == {"mac": 10}
    assert engine.cache.remotes[0].failures_by_reason == {"mac": 1}
  finally:
    proxy.close()


def test_the_same_forgery_passes_a_crc(plain_owner):
  """The control: without a key the same forgery is accepted (a CRC-32C is fixed up as
  easily as the bytes are changed): why a keyless server is loopback-only by default."""
  engine, server = plain_owner
  fp, shape = engine.cache.config.fingerprint(), engine.cache.payload_shape
  dtype = engine.cache.config.jnp_dtype
  honest = RemoteClient(server.address, fp).fetch(_keys(engine), shape, dtype,
                                                  time.monotonic() + 30)
  proxy = Proxy(server.address, forge=True)
  try:
    client = RemoteClient(proxy.address, fp)
    forged = client.fetch(_keys(engine), shape, dtype, time.monotonic() + 30)
    assert proxy.forged == 1 and not client.failures_by_reason
    assert forged.tobytes() != honest.tobytes()
  finally:
    proxy.close()


def test_a_wrong_key_peer_gets_no_answer(owner):
  """A peer without the key gets no membership answer. With the handshake token (read off
  the wire) but another key, its lookups are refused before the server looks at a block
  key (counted); a client with another key, or none, is refused in the handshake."""
  engine, server = owner
  keys, fp = _keys(engine), engine.cache.config.fingerprint()
  lookup = remote.Lookup(nonce="q1", fingerprint=fp.hex(), keys=tuple(keys))
  for key, holds in ((OTHER_KEY, False), (KEY, True)):  # by hand: the server's answers
    sock = _raw(server.address, KEY)
    refused = server.refused
    welcome = _ask(sock, "h1", remote.Hello(nonce="h1"))
    body = lookup.encode()
    auth = f"{welcome['challenge']} {security.challenge_mac(key, welcome['challenge'], body)}"
    answer = _ask(sock, "q1", lookup, auth.encode())
    sock.close(0)
    if holds:  # the control: the same request under the right key
      assert answer["op"] == "have" and answer["have"] == 10 and server.refused == refused
    else:
      assert answer["op"] == "refusal" and "have" not in answer, answer
      assert answer["error"].startswith("unauthenticated") and server.refused == refused + 1
  wrong = RemoteClient(server.address, fp, secret=OTHER_KEY)
  assert wrong.lookup(keys) == 0 and wrong.failures_by_reason == {"refused": 1}
  keyless = RemoteClient(server.address, fp)
  assert keyless.lookup(keys) == 0 and keyless.failures_by_reason == {"refused": 1}
  with pytest.raises(RemoteError, match="handshake") as e:
    RemoteClient(server.address, fp, secret=OTHER_KEY, encrypt=True).fetch(
        keys, engine.cache.payload_shape, engine.cache.config.jnp_dtype, time.monotonic() + 10)
  assert e.value.reason == "refused"


def test_a_replayed_request_is_refused(owner):
  """An attacker on the path re-sends a recorded transfer fetch (and a lookup), frames
  unchanged: each is answered once; the replays are refused ("replay", counted) before
  any blocks are gathered, so they make no transfer offers. What the server remembers is
  bounded: a request pushed out by ``max_remembered_nonces`` later ones is forgotten."""
  engine, server = owner
  keys, fp = tuple(_keys(engine)), engine.cache.config.fingerprint().hex()
  sock = _raw(server.address, KEY)
  fetch = remote.FetchBlocks(nonce="f1", fingerprint=fp, keys=keys, token="t",
                             transport="transfer", sealed=False, wait_ms=300)
  lookups = [remote.Lookup(nonce=f"q{i}", fingerprint=fp, keys=keys) for i in range(3)]
  replays, busy = server.counts["replay"], server.counts["offers_refused"]
  try:
    auth = _auth(sock, fetch)
    assert _ask(sock, "f1", fetch, auth)["op"] == "offer"
    for _ in range(3):
      answer = _ask(sock, "f1", fetch, auth)
      assert answer["op"] == "refusal" and answer["error"].startswith("replay"), answer
    assert server.counts["replay"] == replays + 3
    assert server.counts["offers_refused"] == busy  # no offer was even attempted
    server.max_remembered_nonces = 2
    auths = [_auth(sock, q) for q in lookups]
    assert all(_ask(sock, q.nonce, q, a)["op"] == "have" for q, a in zip(lookups, auths))
    assert _ask(sock, "q2", lookups[2], auths[2])["op"] == "refusal"  # remembered
    assert _ask(sock, "q0", lookups[0], auths[0])["op"] == "have"  # pushed out: the bound
  finally:
    del server.max_remembered_nonces
    sock.close(0)


def test_a_poll_stops_after_its_answers_bytes_budget(owner):
  """Three fetches waiting: with a budget below one fetch's blocks, each poll answers one
  (a fetch is answered whole) and leaves the rest to the next poll."""
  engine, _ = owner
  server = BlockServer(engine.cache)
  keys, fp = tuple(_keys(engine)), engine.cache.config.fingerprint().hex()
  sock = _raw(server.address, KEY)
  try:
    with serving(server):
      fetches = [remote.FetchBlocks(nonce=f"f{i}", fingerprint=fp, keys=keys, token="t",
                                    transport="inline", sealed=False, wait_ms=5000)
                 for i in range(3)]
      auths = [_auth(sock, f) for f in fetches]
    server.max_answer_bytes_per_poll = 1
    for f, a in zip(fetches, auths):
      sock.send_multipart([f.nonce.encode(), f.encode(), a])
    time.sleep(0.5)  # all three wait
    assert [server.poll(0.5) for _ in range(4)] == [1, 1, 1, 0]
    assert server.counts["answered"] == 3 + 3  # and the hellos before
  finally:
    sock.close(0)
    server.close()


def test_closed_servers_leave_no_threads(owner):
  """Each keyed server runs its handshake's handler on a thread; ``close`` ends it."""
  engine, _ = owner
  before = set(threading.enumerate())
  for _ in range(5):
    BlockServer(engine.cache).close()
  assert set(threading.enumerate()) <= before


class FakePeer:
  """A peer that says hello properly, then answers each request with the next scripted
  answer (a function of the request's nonce and message returning the frames to send)."""

  def __init__(self, script):
    self.script = list(script)
    self.sock = zmq.Context.instance().socket(zmq.ROUTER)
    self.sock.setsockopt(zmq.LINGER, 0)
    self.address = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run)
    self._thread.start()

  def _run(self):
    while not self._stop.is_set():
      if not self.sock.poll(20):
        continue
      peer, nonce, body, _ = self.sock.recv_multipart()
      request = json.loads(body)
      if request["op"] == "hello":
        frames = [nonce, remote.Welcome(nonce=nonce.decode(), challenge="c",
                                        valid_ms=60_000).encode(), b""]
      else:
        frames = self.script.pop(0)(nonce.decode(), request)
      self.sock.send_multipart([peer, *frames])

  def close(self):
    self._stop.set()
    self._thread.join()
    self.sock.close(0)


def _json(**fields):
  return json.dumps({"protocol": remote.PROTOCOL, **fields}).encode()


def test_malformed_answers_are_counted_misses_never_exceptions():
  """Answers that break the protocol — not an object, not JSON, nested past the parser,
  over the header cap, wrong frame counts, wrong types, the wrong kind, more blocks held
  than asked about, data where none belongs, frames over the client's cap — each cost a
  lookup 0 (or a fetch a RemoteError) and are counted by reason."""
  keys = [bytes([i]) * 32 for i in range(10)]
  shape, dtype = (2, 2, 4, 8), jnp.bfloat16  # 128 bytes of uint16 bits a block
  have = lambda k: lambda n, _: [n.encode(), _json(op="have", nonce=n, have=k), b""]
  lookups = {
      "[]": lambda n, _: [n.encode(), b"[]", b""],
      "not json": lambda n, _: [n.encode(), b"{not json", b""],
      "nested": lambda n, _: [n.encode(), b"[" * 50_000, b""],
      "header over the cap": lambda n, _: [n.encode(), b" " * (remote._MAX_HEADER_BYTES + 1),
                                           b""],
      "two frames": lambda n, _: [n.encode(), _json(op="have", nonce=n, have=1)],
      "five frames": lambda n, _: [n.encode(), _json(op="have", nonce=n, have=1), b"", b"x",
                                   b"y"],
      "wrong type": lambda n, _: [n.encode(), _json(op="have", nonce=n, have="ten"), b""],
      "another nonce inside": lambda n, _: [n.encode(), _json(op="have", nonce="x", have=1),
                                            b""],
      "the wrong kind": lambda n, _: [n.encode(), remote.Welcome(nonce=n, challenge="c",
                                                                 valid_ms=1).encode(), b""],
      "holds more than asked": have(1_000_000),
      "data on a have": lambda n, _: [n.encode(), _json(op="have", nonce=n, have=1), b"",
                                      b"x"],
      "frame over the cap": lambda n, _: [n.encode(), b"x" * (1 << 20), b""],
  }
  offer = lambda n, req, **kw: remote.Offer(
      nonce=n, keys=tuple(bytes.fromhex(k) for k in req["keys"]), dtype="uint16",
      shape=(2, *shape), token=req["token"], **kw).encode()
  fetches = {  # otherwise right offers (their token, keys, dtype and shape)
      "two data frames": lambda n, r: [n.encode(), offer(n, r, crc32c=0), b"", b"x", b"y"],
      "no crc": lambda n, r: [n.encode(), offer(n, r), b"", b"x" * 256],
  }
  peer = FakePeer([*lookups.values(), have(10), *fetches.values()])
  try:
    client = RemoteClient(peer.address, b"\x01" * 32, trip_after=1000)
    client.expect(shape, dtype)  # the largest frame it reads: 512 blocks of 256 bytes
    for name in lookups:
      assert client.lookup(keys) == 0, name
    assert client.lookup(keys) == 10  # the next honest answer is taken
    for name in fetches:
      with pytest.raises(RemoteError):
        client.fetch(keys[:2], shape, dtype, time.monotonic() + 5)
  finally:
    peer.close()
  # Every lookup but the frame over the cap (ZeroMQ drops that connection: a late answer)
  # and the fetch with two data frames broke the protocol; the CRC-less offer is a keyed
  # peer's kind of answer to a keyless client.
  assert client.failures_by_reason == {"malformed": len(lookups) - 1 + 1, "deadline": 1,
                                       "mode": 1}


def test_transfer_offers_send_a_client_only_to_its_peers_host():
  """A transfer offer names where to pull from: another host than the peer's is refused
  (malformed) before any connection is made; the peer's own host (or the unspecified
  address its transfer server listens on) is pulled from, and the client keeps at most
  ``_MAX_TRANSFER_CONNECTIONS`` connections however many addresses it is offered."""
  import jax
  import jax.experimental.transfer as transfer
  keys = [bytes([i]) * 32 for i in range(2)]
  shape, dtype = (2, 2, 4, 8), jnp.bfloat16
  stack = np.arange(2 * 2 * 2 * 4 * 8, dtype=np.uint16).reshape(2, *shape)
  device = jax.local_devices()[0]
  servers = [transfer.start_transfer_server(device.client, f"{host}:0", ["127.0.0.1:0"])
             for host in ["0.0.0.0"] + ["127.0.0.1"] * remote._MAX_TRANSFER_CONNECTIONS]

  def offer(address):
    def answer(n, req):
      transfer_id = int.from_bytes(n.encode()[:7], "big")
      if not address.startswith("10."):
        servers[int(address)].await_pull(transfer_id, [jax.device_put(stack, device)])
      where = address if address.startswith("10.") else servers[int(address)].address()
      return [n.encode(), remote.Offer(
          nonce=n, keys=tuple(bytes.fromhex(k) for k in req["keys"]), dtype="uint16",
          shape=stack.shape, token=req["token"], crc32c=remote._digest(stack),
          expires_ms=5000, transfer_id=transfer_id, transfer_address=where).encode(), b""]
    return answer

  peer = FakePeer([offer("10.1.2.3:5"), *(offer(str(i)) for i in range(len(servers)))])
  try:
    client = RemoteClient(peer.address, b"\x01" * 32, transport="transfer")
    with pytest.raises(RemoteError, match="not on the peer's host") as e:
      client.fetch(keys, shape, dtype, time.monotonic() + 5)
    assert e.value.reason == "malformed" and not client._connections
    for _ in servers:
      got = client.fetch(keys, shape, dtype, time.monotonic() + 10)
      assert np.array_equal(got, stack)
    assert len(client._connections) == remote._MAX_TRANSFER_CONNECTIONS
    assert all(a.startswith("127.0.0.1:") for a in client._connections)
    assert client.failures_by_reason == {"malformed": 1}
  finally:
    peer.close()


@pytest.mark.parametrize("piece_bytes", [None, 1000])
def test_sealed_blocks_cross_the_wire_as_ciphertext(mesh, owner, want, piece_bytes,
                                                    monkeypatch):
  """With encryption the blocks on the wire hold none of their plaintext (the proxy looks
  for it) and the reader opens them to the right tokens; without, the same proxy does find
  the plaintext (the control). ``piece_bytes``: sealed in many pieces, a frame each."""
  engine, server = owner
  if piece_bytes:
    monkeypatch.setattr(remote, "_CHUNK_BYTES", piece_bytes)
  fp, shape = engine.cache.config.fingerprint(), engine.cache.payload_shape
  dtype = engine.cache.config.jnp_dtype
  proxy = Proxy(server.address, key=KEY)
  try:
    plain = RemoteClient(proxy.address, fp, secret=KEY).fetch(
        _keys(engine), shape, dtype, time.monotonic() + 30).tobytes()
    assert proxy.data_frames == [plain]  # integrity only: readable, and proven by the tag
    reader = _reader(mesh, proxy.address)
    assert reader.cache.encrypt and reader.generate([PROMPT], 5) == want
    assert reader.stats()["hits"]["remote"] == 10
    sealed = proxy.data_frames[1]
    pieces = -(-len(plain) // remote._CHUNK_BYTES)
    assert len(proxy.data_frames) == 2 and (pieces > 1) == bool(piece_bytes)
    assert len(sealed) == len(plain) + pieces * security.Seal.OVERHEAD
    block = len(plain) // 10
    windows = [plain[i:i + 32] for i in range(0, len(plain), block // 4)]
    assert not any(w in sealed for w in windows)
  finally:
    proxy.close()


def test_transfer_offers_are_bounded_and_expire(owner):
  """A transfer offer holds device memory until pulled or expired: beyond the bound a
  fetch is refused (counted); once an offer's time (the client's wait) is over it no
  longer counts."""
  engine, server = owner
  client = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=KEY,
                        transport="transfer")
  ask = lambda wait_ms: client._call(remote.FetchBlocks(
      nonce=remote._nonce(), fingerprint=client.fingerprint, keys=tuple(_keys(engine)),
      token="t", transport="transfer", sealed=False, wait_ms=wait_ms), time.monotonic() + 30)
  server.max_offers = 1
  try:
    offer, _ = ask(300)
    assert offer.expires_ms == 300 and offer.data_tag is not None and offer.crc32c is None
    with pytest.raises(RemoteError, match="busy"):
      ask(300)
    assert server.counts["offers_refused"] == 1
    time.sleep(0.4)  # the first offer has expired: the transfer library dropped it
    assert ask(300)[0].transfer_id != offer.transfer_id
  finally:
    del server.max_offers


def test_keyed_transfer_pulls_are_proven_or_sealed(mesh, want):
  """Pulled blocks: with encryption they travel sealed and are opened; integrity only,
  the offer's tag proves them. Both to the right tokens."""
  proc, addr = start_owner(deployment_key=KEY)
  try:
    for encryption in ("auto", "off"):
      engine = _reader(mesh, addr, encryption=encryption, transport="transfer")
      assert engine.generate([PROMPT], 5) == want, encryption
      assert engine.stats()["hits"]["remote"] == 10, engine.stats()
  finally:
    proc.kill()
    proc.wait()


def test_a_keyless_server_is_loud_and_loopback_only(plain_owner, monkeypatch):
  engine, _ = plain_owner
  said = []
  monkeypatch.setattr(security, "warn_insecure", lambda what, fix: said.append(fix))
  with pytest.raises(InputError, match="deployment key.*allow_insecure"):
    BlockServer(engine.cache, "0.0.0.0")
  BlockServer(engine.cache, "0.0.0.0", allow_insecure=True).close()
  RemoteClient("127.0.0.1:1", engine.cache.config.fingerprint())
  assert len(said) == 2 and all("deployment key" in fix for fix in said)
  RemoteClient("127.0.0.1:1", engine.cache.config.fingerprint(), secret=KEY, encrypt=True)
  assert len(said) == 2
  with pytest.raises(InputError, match="encrypt"):
    RemoteClient("127.0.0.1:1", engine.cache.config.fingerprint(), encrypt=True)


def test_a_block_on_disk_ends_the_prefix_a_server_offers():
  """Blocks A (device), B (disk only), C (device): the server holds a prefix of 1, not 2
  (offering A and C would make the fetch that follows a refusal)."""
  from types import SimpleNamespace
  from jaxkv.index import PrefixIndex, Tier
  index = PrefixIndex(num_shards=1, pages_per_shard=4, page_size=4, fingerprint=b"f" * 32,
                      disk_slots=4)
  keys = [bytes([i]) * 32 for i in range(3)]
  for key, tier in zip(keys, (Tier.DEVICE, Tier.DISK, Tier.DEVICE)):
    slot, = index.allocate(0, 1, tier)
    index.publish(0, slot, key, tier)
    index.release(0, [slot], tier)
  server = SimpleNamespace(cache=SimpleNamespace(index=index, num_shards=1))
  assert [t for _, t, _ in BlockServer._where(server, keys)] == [Tier.DEVICE]
