"""REMOTE tier under attack: floods, forgers on the path, wrong keys and lying answers cost
a counted miss or a bounded poll, never a wrong token, a stuck engine or an exception.

The serving job here runs in this process (its ``BlockServer`` polled on a thread, as a
server's engine thread would between steps) on real loopback sockets; only the transfer
pull, which needs two processes, uses the session's owner job (conftest's ``remote_owners``).

A keyed server takes only connections that pass its handshake (a token derived from the
key). The attackers here that test the second line (challenges, MACs, the poll's budget)
hold that token, as one on the path would: it crosses in clear.
"""

import collections
import contextlib
import dataclasses
import json
import socket
import threading
import time
import tracemalloc

import numpy as np

import google_crc32c
import jax.numpy as jnp
import pytest
import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

import jaxkv
from jaxkv import security
from jaxkv.errors import InputError
from jaxkv.worker import pages as pages_lib
from jaxkv.worker.tiers import remote
from jaxkv.worker.tiers.remote import BlockServer, BlockServerLimits, RemoteClient, RemoteError
from jaxkv.worker.tiers.remote import wire as remote_wire

import helpers
from test_remote import KEY, PREFIX

OTHER_KEY = bytes(range(100, 132))
PROMPT = PREFIX + [50, 51, 52]


serving = helpers.serving_blocks  # ``server`` answering on a thread


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
    sock.plain_username = remote.HANDSHAKE_USER
    sock.plain_password = remote.handshake_token(key)
  sock.connect(f"tcp://{address}")
  return sock


class _Handshakes:
  """The handshake events of a socket's monitor, read as they come: called, whether a
  handshake of its failed (or the peer hung up on it); ``succeeded``, whether one passed."""

  FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_DISCONNECTED)

  def __init__(self, sock):
    self._monitor = sock.get_monitor_socket(self.FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    self.failed = self.succeeded = False

  def __call__(self) -> bool:
    while self._monitor.poll(0):
      event = recv_monitor_message(self._monitor)["event"]
      self.failed |= bool(event & self.FAILED)
      self.succeeded |= event == zmq.EVENT_HANDSHAKE_SUCCEEDED
    return self.failed

  def close(self):
    self._monitor.close(0)


def _watched(address, key=None):
  """``_raw``'s connection, its handshakes watched from before it connects: (socket,
  ``_Handshakes``)."""
  sock = zmq.Context.instance().socket(zmq.DEALER)
  sock.setsockopt(zmq.LINGER, 0)
  if key is not None:
    sock.plain_username = remote.HANDSHAKE_USER
    sock.plain_password = remote.handshake_token(key)
  handshakes = _Handshakes(sock)
  sock.connect(f"tcp://{address}")
  return sock, handshakes


def _signed(challenge: str, number: int, message, key=KEY) -> bytes:
  """The auth frame of ``message`` numbered ``number`` under ``challenge``, MACed with ``key``."""
  signed = f"{challenge} {number}"
  return f"{signed} {security.challenge_mac(key, signed, message.encode())}".encode()


def _auth(sock, message, key=KEY, number=1) -> bytes:
  """The auth frame of ``message`` on ``sock``: a hello's challenge, the request's
  ``number`` and their MAC with ``key``."""
  return _signed(_ask(sock, "hi", remote.Hello(nonce="hi"))["challenge"], number, message, key)


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
    self._authenticator = None
    if key is not None:  # ZeroMQ's own handler of the front's PLAIN handshake (a test's)
      token = remote.handshake_token(key)
      self._authenticator = ThreadAuthenticator(self._ctx)
      self._authenticator.start()
      self._authenticator.configure_plain(domain="*", passwords={
          remote.HANDSHAKE_USER.decode(): token.decode()})
      self.front.plain_server = True
      self.back.plain_username, self.back.plain_password = remote.HANDSHAKE_USER, token
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
    if self._authenticator is not None:
      self._authenticator.stop()
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
  watched = [_watched(server.address), _watched(server.address, OTHER_KEY)]
  socks = [sock for sock, _ in watched]
  try:
    for sock in socks:  # as much as ZeroMQ takes (it stops taking once a handshake failed)
      with contextlib.suppress(zmq.Again):
        sock.send_multipart([b"big", *[bytes(1 << 20)] * 200], flags=zmq.NOBLOCK)
        for i in range(1000):
          sock.send_multipart([b"h%d" % i, remote.Hello(nonce=f"h{i}").encode(), b""],
                              flags=zmq.NOBLOCK)
    # Until each connection's handshake has failed (ZeroMQ sends no message before its
    # handshake succeeds: nothing of theirs can reach the server after), and the other
    # key's was counted.
    helpers.wait_for(lambda: all(failed() for _, failed in watched)
                     and server.handshakes_refused > refused, 60,
                     "both handshakes failed and the other key's was counted")
    assert not any(failed.succeeded for _, failed in watched)
    assert +server.counts == before
    assert not any(sock.poll(0) for sock in socks)  # and nothing came back
  finally:
    for sock, handshakes in watched:
      sock.disable_monitor()
      handshakes.close()
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
    helpers.wait_for(lambda: server.counts["hello"] - hellos >= 5000, 60,
                     "the flood was answered")  # (each poll answers 64 at most)
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
        sock.poll(10, zmq.POLLOUT)  # until ZeroMQ takes more
    sock.close(0)

  thread = threading.Thread(target=flood)
  thread.start()
  try:
    helpers.wait_for(server.waiting, 10, "the junk reached the server")
    polls = []
    while thread.is_alive():  # the whole flood
      answered = server.poll(0.01)
      polls.append((answered, server.waiting()))
    assert polls and all(n <= server.limits.max_messages_per_peer
                         <= server.limits.max_messages_per_poll
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
    monkeypatch.setattr(remote_wire, "CHUNK_BYTES", piece_bytes)
  proxy = Proxy(server.address, forge=True, key=KEY)
  try:
    engine = _reader(mesh, proxy.address, encryption=encryption)
    assert engine.generate([PROMPT], 5) == want
    s = engine.stats()
    assert proxy.forged == 1 and s["hits"]["remote"] == 0
    assert s["verify_failures_by_reason"] == {"mac": 10}
    assert engine.cache.worker.remotes[0].failures_by_reason == {"mac": 1}
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
    answer = _ask(sock, "q1", lookup, _signed(welcome["challenge"], 1, lookup, key))
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
  """An attacker on the path re-sends a recorded transfer fetch (and lookups), frames
  unchanged: each is answered once; the replays, and a request numbered below one already
  answered on its connection, are refused ("replay", counted) before any blocks are
  gathered, so they make no transfer offers."""
  engine, server = owner
  keys, fp = tuple(_keys(engine)), engine.cache.config.fingerprint().hex()
  sock = _raw(server.address, KEY)
  fetch = remote.FetchBlocks(nonce="f1", fingerprint=fp, keys=keys, token="t",
                             transport="transfer", sealed=False, wait_ms=300)
  lookups = [remote.Lookup(nonce=f"q{i}", fingerprint=fp, keys=keys) for i in range(3)]
  replays, busy = server.counts["replay"], server.counts["offers_refused"]
  try:
    auth = _auth(sock, fetch, number=1)
    assert _ask(sock, "f1", fetch, auth)["op"] == "offer"
    for _ in range(3):
      answer = _ask(sock, "f1", fetch, auth)
      assert answer["op"] == "refusal" and answer["error"].startswith("replay"), answer
    assert server.counts["replay"] == replays + 3
    assert server.counts["offers_refused"] == busy  # no offer was even attempted
    challenge = auth.decode().split()[0]
    auths = [_signed(challenge, n, q) for n, q in zip((2, 3, 4), lookups)]
    assert all(_ask(sock, q.nonce, q, a)["op"] == "have" for q, a in zip(lookups, auths))
    assert _ask(sock, "q2", lookups[2], auths[2])["op"] == "refusal"  # the last one again
    assert _ask(sock, "q0", lookups[0], auths[0])["op"] == "refusal"  # an earlier one
    assert server.counts["replay"] == replays + 5
  finally:
    sock.close(0)


def test_what_refuses_replays_is_bounded_and_forgets_nothing(owner):
  """The server remembers one number per challenge in use (a hello's, for its epochs):
  with room for one, a second connection's requests are refused ("busy", counted) rather
  than the first's number forgotten, and the first connection is served on; its replay is
  still refused."""
  engine, _ = owner
  server = BlockServer(engine.cache, limits=BlockServerLimits(max_replay_windows=1))
  keys, fp = tuple(_keys(engine)), engine.cache.config.fingerprint().hex()
  lookup = remote.Lookup(nonce="q", fingerprint=fp, keys=keys)
  socks = [_raw(server.address, KEY) for _ in range(2)]
  try:
    with serving(server):
      first, second = (_auth(sock, lookup) for sock in socks)
      assert _ask(socks[0], "q", lookup, first)["op"] == "have"
      answer = _ask(socks[1], "q", lookup, second)
      assert answer["op"] == "refusal" and answer["error"].startswith("busy"), answer
      challenge = first.decode().split()[0]
      assert _ask(socks[0], "q", lookup, _signed(challenge, 2, lookup))["op"] == "have"
      assert _ask(socks[0], "q", lookup, first)["op"] == "refusal"
    assert server.counts["replay_windows_full"] == 1 and server.counts["replay"] == 1
  finally:
    for sock in socks:
      sock.close(0)
    server.close()


def test_a_poll_stops_after_its_answers_bytes_budget(owner):
  """Three fetches waiting: with a budget below one fetch's blocks, each poll answers one
  (a fetch is answered whole) and leaves the rest to the next poll."""
  engine, _ = owner
  server = BlockServer(engine.cache, limits=BlockServerLimits(max_answer_bytes_per_poll=1))
  keys, fp = tuple(_keys(engine)), engine.cache.config.fingerprint().hex()
  sock = _raw(server.address, KEY)
  try:
    with serving(server):  # the hellos: no blocks, within the budget
      fetches = [remote.FetchBlocks(nonce=f"f{i}", fingerprint=fp, keys=keys, token="t",
                                    transport="inline", sealed=False, wait_ms=5000)
                 for i in range(3)]
      auths = [_auth(sock, f, number=i + 1) for i, f in enumerate(fetches)]
    for f, a in zip(fetches, auths):
      sock.send_multipart([f.nonce.encode(), f.encode(), a])
    helpers.wait_for(server.waiting, 10, "the fetches reached the server")
    # Each poll reads on until a fetch is whole, answers it and stops: its blocks are over
    # the budget. Then nothing is left.
    assert [server.poll(10) for _ in range(3)] == [1, 1, 1]
    assert not server.waiting() and server.poll(0) == 0
    assert server.counts["answered"] == 3 + 3  # and the hellos before
  finally:
    sock.close(0)
    server.close()


def test_closed_servers_leave_no_threads(owner):
  """A keyed server reads its handshakes in ``poll``, on the serving thread: it starts no
  thread, and ``close`` leaves none behind."""
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
  lookup 0 (or a fetch a RemoteError) and are counted by reason, each as soon as its frame
  is seen (not at the deadline)."""
  keys = [bytes([i]) * 32 for i in range(10)]
  shape, dtype = (2, 2, 4, 8), jnp.bfloat16  # 128 bytes of uint16 bits a block
  have = lambda k: lambda n, _: [n.encode(), _json(op="have", nonce=n, have=k), b""]
  lookups = {
      "[]": lambda n, _: [n.encode(), b"[]", b""],
      "not json": lambda n, _: [n.encode(), b"{not json", b""],
      "nested": lambda n, _: [n.encode(), b"[" * 50_000, b""],
      "header over the cap": lambda n, _: [n.encode(), b" " * (remote.MAX_HEADER_BYTES + 1),
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
  fetches = {  # otherwise right offers (their token, keys, dtype, shape and blocks' size)
      "two data frames": lambda n, r: [n.encode(), offer(n, r, crc32c=0), b"", b"x" * 512,
                                       b"y"],
      "no crc": lambda n, r: [n.encode(), offer(n, r), b"", b"x" * 512],
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
  # Every lookup and the fetch with two data frames broke the protocol; the CRC-less offer
  # is a keyed peer's kind of answer to a keyless client.
  assert client.failures_by_reason == {"malformed": len(lookups) + 1, "mode": 1}


def test_transfer_offers_send_a_client_only_to_its_peers_host():
  """A transfer offer names where to pull from: another host than the peer's is refused
  (malformed) before any connection is made; the peer's own host (or the unspecified
  address its transfer server listens on) is pulled from, and the client keeps at most
  ``MAX_TRANSFER_CONNECTIONS`` connections however many addresses it is offered."""
  import jax
  import jax.experimental.transfer as transfer
  keys = [bytes([i]) * 32 for i in range(2)]
  shape, dtype = (2, 2, 4, 8), jnp.bfloat16
  stack = np.arange(2 * 2 * 2 * 4 * 8, dtype=np.uint16).reshape(2, *shape)
  device = jax.local_devices()[0]
  servers = [transfer.start_transfer_server(device.client, f"{host}:0", ["127.0.0.1:0"])
             for host in ["0.0.0.0"] + ["127.0.0.1"] * remote.MAX_TRANSFER_CONNECTIONS]

  def offer(address):
    def answer(n, req):
      transfer_id = int.from_bytes(n.encode()[:7], "big")
      if not address.startswith("10."):
        servers[int(address)].await_pull(transfer_id, [jax.device_put(stack, device)])
      where = address if address.startswith("10.") else servers[int(address)].address()
      return [n.encode(), remote.Offer(
          nonce=n, keys=tuple(bytes.fromhex(k) for k in req["keys"]), dtype="uint16",
          shape=stack.shape, token=req["token"], crc32c=remote.stack_digest(stack),
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
    assert len(client._connections) == remote.MAX_TRANSFER_CONNECTIONS
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
    monkeypatch.setattr(remote_wire, "CHUNK_BYTES", piece_bytes)
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
    pieces = -(-len(plain) // remote_wire.CHUNK_BYTES)
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
      nonce=remote.new_nonce(), fingerprint=client.fingerprint, keys=tuple(_keys(engine)),
      token="t", transport="transfer", sealed=False, wait_ms=wait_ms), time.monotonic() + 30)
  limits = server.limits  # the shared server's: put back after
  server.limits = dataclasses.replace(limits, max_offers=1)
  try:
    # The shared server may still hold an earlier test's offer (a pull's wait is seconds).
    helpers.wait_for(lambda: all(t <= time.monotonic() for t, _ in server._offers), 60,
                     "the earlier tests' offers' time is over")
    offer, _ = ask(300)
    assert offer.expires_ms == 300 and offer.data_tag is not None and offer.crc32c is None
    with pytest.raises(RemoteError, match="busy"):
      ask(300)
    assert server.counts["offers_refused"] == 1
    helpers.wait_for(lambda: all(t <= time.monotonic() for t, _ in server._offers), 10,
                     "the first offer's time is over")  # the transfer library dropped it
    assert ask(300)[0].transfer_id != offer.transfer_id
  finally:
    server.limits = limits


def test_keyed_transfer_pulls_are_proven_or_sealed(mesh, want, remote_owners):
  """Pulled blocks: with encryption they travel sealed and are opened; integrity only,
  the offer's tag proves them. Both to the right tokens."""
  for encryption in ("auto", "off"):
    engine = _reader(mesh, remote_owners.address["keyed"], encryption=encryption,
                     transport="transfer")
    assert engine.generate([PROMPT], 5) == want, encryption
    assert engine.stats()["hits"]["remote"] == 10, engine.stats()


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
  from jaxkv.manager.index import PrefixIndex, Tier
  index = PrefixIndex(num_shards=1, pages_per_shard=4, page_size=4, fingerprint=b"f" * 32,
                      disk_slots=4)
  keys = [bytes([i]) * 32 for i in range(3)]
  for key, tier in zip(keys, (Tier.DEVICE, Tier.DISK, Tier.DEVICE)):
    slot, = index.allocate(0, 1, tier)
    index.publish(0, slot, key, tier)
    index.release(0, [slot], tier)
  server = SimpleNamespace(cache=SimpleNamespace(index=index, num_shards=1))
  assert [t for _, t, _ in BlockServer._where(server, keys)] == [Tier.DEVICE]


# ---- ZMTP by hand: what no ZeroMQ socket sends (a message that never ends), and what the other
# side took of it. Written from RFC 23 (ZMTP 3.1) and RFC 24 (PLAIN), independently of jaxkv's
# own framing, so a test and the code it tests do not share a mistake.
def _frame(data=b"", *, more=False, command=False, size=None) -> bytes:
  """One frame's header, then ``data`` (``size``: the length the header claims, when the
  bytes are sent separately)."""
  size = len(data) if size is None else size
  flags = (1 if more else 0) | (4 if command else 0)
  head = bytes([flags | 2]) + size.to_bytes(8, "big") if size > 255 else bytes([flags, size])
  return head + bytes(data)


def command_frame(name: bytes, body: bytes = b"") -> bytes:
  return _frame(bytes([len(name)]) + name + body, command=True)


def socket_type(kind: bytes) -> bytes:
  return bytes([11]) + b"Socket-Type" + len(kind).to_bytes(4, "big") + kind


def greeting_bytes(mechanism: bytes) -> bytes:
  return b"\xff" + bytes(7) + b"\x01\x7f\x03\x01" + mechanism.ljust(20, b"\0") + bytes(32)


class Wire:
  """One TCP connection read and written byte by byte; every wait has ``timeout_s``."""

  def __init__(self, sock, timeout_s: float = 10.0):
    self.sock = sock
    self._unsent = memoryview(b"")
    sock.settimeout(timeout_s)

  def read(self, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
      got = self.sock.recv(n - len(out))
      if not got:
        raise ConnectionError(f"closed after {len(out)} of {n} bytes")
      out += got
    return bytes(out)

  def frame(self) -> tuple[int, bytes]:
    flags, size = self.read(2)
    if flags & 2:
      size = int.from_bytes(bytes([size]) + self.read(7), "big")
    return flags, self.read(size)

  def message(self) -> list[bytes]:
    """The next message's frames (commands, such as a ping, skipped)."""
    frames = []
    while True:
      flags, data = self.frame()
      if flags & 4:
        continue
      frames.append(data)
      if not flags & 1:
        return frames

  def push(self, chunks, stall_s: float) -> int:
    """Sends from the iterator ``chunks`` until it ends, the other side hangs up, or a send
    waits ``stall_s`` (it takes no more: what was not sent of the chunk is sent first by the
    next push); returns the bytes it took."""
    self.sock.settimeout(stall_s)
    sent = 0
    try:
      while True:
        if not self._unsent:
          self._unsent = memoryview(next(chunks, b"")).cast("B")
          if not self._unsent:
            return sent
        n = self.sock.send(self._unsent)
        sent += n
        self._unsent = self._unsent[n:]
    except (TimeoutError, BrokenPipeError, ConnectionResetError):
      return sent

  def close(self):
    self.sock.close()


def _handshake(wire: Wire, *, server: bool, key=None) -> None:
  """NULL, or PLAIN with ``key``'s token (as a server: any user and password pass)."""
  wire.sock.sendall(greeting_bytes(b"PLAIN" if key is not None else b"NULL"))
  theirs = wire.read(64)
  assert theirs[0] == 0xFF and theirs[10] == 3, theirs
  kind = b"ROUTER" if server else b"DEALER"
  if key is None:
    wire.sock.sendall(command_frame(b"READY", socket_type(kind)))
    assert wire.frame()[1].startswith(b"\x05READY")
  elif server:
    assert wire.frame()[1].startswith(b"\x05HELLO")
    wire.sock.sendall(command_frame(b"WELCOME"))
    assert wire.frame()[1].startswith(b"\x08INITIATE")
    wire.sock.sendall(command_frame(b"READY", socket_type(kind)))
  else:
    user, token = remote.HANDSHAKE_USER, remote.handshake_token(key)
    wire.sock.sendall(command_frame(b"HELLO", bytes([len(user)]) + user + bytes([len(token)]) + token))
    assert wire.frame()[1] == b"\x07WELCOME"
    wire.sock.sendall(command_frame(b"INITIATE", socket_type(kind)))
    assert wire.frame()[1].startswith(b"\x05READY")


def _dial(address: str, key=None, sndbuf: int = 64 << 10) -> Wire:
  """A client connection made by hand (an attacker's: it holds the handshake token, which
  crosses in clear, not the key). ``sndbuf``: its kernel send buffer, kept small so that
  what the other side took is what was pushed, less little."""
  host, _, port = address.rpartition(":")
  sock = socket.create_connection((host, int(port)), timeout=10)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
  wire = Wire(sock)
  _handshake(wire, server=False, key=key)
  return wire


def _kernel_buffers_most() -> int:
  """The most a loopback connection's kernel buffers hold: the receiver's socket buffer at
  its autotuned most, and the sender's (``_dial``'s 64 KiB, doubled by the kernel)."""
  with open("/proc/sys/net/ipv4/tcp_rmem") as f:
    return int(f.read().split()[2]) + 2 * (64 << 10)


_ZEROS = memoryview(bytes(1 << 20))  # made once: a flood's sender allocates nothing


def _frames_of(size: int, count: int, more_after: bool = True):
  """``count`` frames of ``size`` zero bytes (at most 1 MiB), all but (unless
  ``more_after``) the last saying more follow; one buffer sent again and again."""
  blob = _ZEROS[:size]
  for i in range(count):
    yield _frame(more=more_after or i < count - 1, size=size)
    yield blob


def test_a_message_of_endless_frames_costs_a_keyed_server_its_bound(owner):
  """ZeroMQ delivers a message only whole, and bounds its frames' size, not their number: a
  ZeroMQ socket queues a message of any number of frames before anyone sees its first. A
  client with the handshake token (it crosses in clear) sends a request's three frames,
  then 1 MiB frames, 320 MiB of them: while the server is not polled (its engine mid-step)
  it takes at most its bound off the network (the rest waits in the kernel's buffers, then
  in the sender: TCP flow control), not all of it as a ZeroMQ socket would; polled, it
  reads the rest and drops each frame as it comes, never keeping one (counted), holding at
  most its bound (tracemalloc); the message is refused once it ends, and a keyed client is
  served on."""
  engine, _ = owner
  server = BlockServer(engine.cache)
  wire = None
  try:
    with serving(server):  # the handshake is answered by polls
      wire = _dial(server.address, KEY)
      wire.sock.sendall(_frame(b"n1", more=True) + _frame(b"{" * 1_000_000, more=True)
                        + _frame(b"0-x 1 y", more=True))
    flood = _frames_of(1 << 20, 320)
    taken = wire.push(flood, stall_s=1.0)  # not polled
    assert taken <= server.queued_bytes_most + _kernel_buffers_most(), (taken >> 20, "MiB")
    tracemalloc.start()
    try:
      base = tracemalloc.get_traced_memory()[0]
      with serving(server):
        rest = wire.push(flood, stall_s=10.0)
        wire.sock.sendall(_frame(b"last"))
        answer = wire.message()
      peak = tracemalloc.get_traced_memory()[1] - base
    finally:
      tracemalloc.stop()
    assert taken + rest == 320 * ((1 << 20) + 9)  # all read once polled ...
    assert server.counts["frames_dropped"] == 320 + 1  # ... and dropped, every one
    assert peak <= server.held_bytes_most, (peak, server.held_bytes_most)
    header = json.loads(answer[1])
    assert answer[0] == b"n1" and header["op"] == "refusal", header
    assert "3 frames" in header["error"] and "324" in header["error"]
    with serving(server):
      client = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=KEY)
      assert client.lookup(_keys(engine)) == 10 and not client.failures_by_reason
  finally:
    if wire is not None:
      wire.close()
    server.close()


class FakeWirePeer:
  """A peer written byte by byte, taking one connection (NULL, or PLAIN with any
  password): it answers hellos and lookups as a peer with ``key`` would (a man in the
  middle forwards those), and each fetch with the frames ``flood(nonce, request)`` yields,
  pushed until the client hangs up or stops reading; ``taken`` sums what the client took
  of them."""

  def __init__(self, flood, key=None):
    self.flood, self.key, self.taken, self.fetches = flood, key, 0, 0
    self._wire = None  # the connection being served
    self._seal = security.Seal(key, "remote-answer") if key is not None else None
    self._listener = socket.create_server(("127.0.0.1", 0))
    self._listener.settimeout(0.05)
    self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run)
    self._thread.start()

  def answer(self, nonce: str, message) -> bytes:
    """An answer's frames, tagged as a peer with the key would."""
    header = message.encode()
    tag = self._seal.tag(remote.head_aad(nonce, header)) if self._seal is not None else b""
    return _frame(nonce.encode(), more=True) + _frame(header, more=True) + _frame(tag)

  def _run(self):
    while not self._stop.is_set():
      try:
        sock, _ = self._listener.accept()
      except TimeoutError:
        continue
      wire = self._wire = Wire(sock, timeout_s=10.0)
      wire.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
      try:
        _handshake(wire, server=True, key=self.key)
        while not self._stop.is_set():
          nonce, body, _ = wire.message()
          request, n = json.loads(body), nonce.decode()
          if request["op"] == "hello":
            wire.sock.sendall(self.answer(n, remote.Welcome(nonce=n, challenge="0-c",
                                                            valid_ms=60_000)))
          elif request["op"] == "lookup":
            wire.sock.sendall(self.answer(n, remote.Have(nonce=n, have=len(request["keys"]))))
          else:
            self.fetches += 1
            self.taken += wire.push(self.flood(n, request), stall_s=2.0)
      except (ConnectionError, TimeoutError, OSError, ValueError):
        pass  # the client hung up (or sent what this peer does not read)
      finally:
        wire.close()

  def close(self):
    self._stop.set()
    wire = self._wire
    if wire is not None:  # its read of a next request ends now, not at its timeout
      with contextlib.suppress(OSError):
        wire.sock.shutdown(socket.SHUT_RDWR)
    self._thread.join()
    self._listener.close()


def _flood(shape, dtype, how: str, sealed: bool, seal=None):
  """A fetch's answer that does not end: ``how`` is "oversized" (its first blocks frame
  larger than asked) or "too_many" (the blocks as asked, each frame the size it should be,
  then more frames), 256 MiB of 64 KiB frames after the offer (each under the largest
  frame a client reads: a ZeroMQ socket takes them all)."""
  bits = np.dtype(pages_lib.bits_dtype(dtype))

  def answer(n, request):
    keys = tuple(bytes.fromhex(k) for k in request["keys"])
    want = len(keys) * int(np.prod(shape)) * bits.itemsize
    offer = remote.Offer(nonce=n, keys=keys, dtype=bits.name, shape=(len(keys), *shape),
                         token=request["token"], sealed=sealed).encode()
    tag = seal.tag(remote.head_aad(n, offer)) if seal is not None else bytes(28)
    yield _frame(n.encode(), more=True) + _frame(offer, more=True) + _frame(tag, more=True)
    if how == "too_many":
      pieces = -(-want // remote_wire.CHUNK_BYTES) if sealed else 1
      for i in range(pieces):
        size = (min(remote_wire.CHUNK_BYTES, want - i * remote_wire.CHUNK_BYTES)
                + security.Seal.OVERHEAD if sealed else want)
        yield _frame(bytes(size), more=True)
    yield from _frames_of(64 << 10, 4096, more_after=False)
  return answer


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("how", ["oversized", "too_many"])
def test_an_answer_that_does_not_end_costs_a_client_only_what_it_asked(how, sealed):
  """A fake peer (or a man in the middle, who forwards the hello and can send anything
  after it) answers a keyed client's fetch with the offer and then frames that never end.
  ZeroMQ would queue all of them before the client saw one, tags unchecked. The client
  reads frame by frame and checks each frame's size against what it asked before keeping a
  byte: it stops at the first frame that cannot belong to the answer, hangs up, and counts
  a miss; it took at most its bound of the 256 MiB sent (plus what kernel buffers held),
  and held no more than an answer to what it asked (tracemalloc)."""
  keys = [bytes([i]) * 32 for i in range(2)]
  shape, dtype = (2, 2, 4, 8), jnp.bfloat16  # 256 bytes a block
  peer = FakeWirePeer(_flood(shape, dtype, how, sealed, security.Seal(KEY, "remote-answer")),
                      key=KEY)
  try:
    client = RemoteClient(peer.address, b"\x01" * 32, secret=KEY, encrypt=sealed,
                          trip_after=1000)
    client.expect(shape, dtype)
    tracemalloc.start()
    try:
      base = tracemalloc.get_traced_memory()[0]
      with pytest.raises(RemoteError) as e:
        client.fetch(keys, shape, dtype, time.monotonic() + 10)
      peak = tracemalloc.get_traced_memory()[1] - base
    finally:
      tracemalloc.stop()
    reason = "shape" if how == "oversized" else "malformed"
    assert e.value.reason == reason and client.failures_by_reason == {reason: 1}
    assert peak <= client.answer_bytes_most(len(keys)), (peak, client.answer_bytes_most(2))
    assert client.lookup(keys) == 2  # a fresh connection: the peer is asked again
  finally:
    peer.close()
  assert peer.fetches == 1
  assert peer.taken <= client.answer_bytes_most(len(keys)) + _kernel_buffers_most(), (
      peer.taken >> 20, "MiB")


def test_a_fetch_answered_without_end_is_a_miss_and_the_request_recomputes(mesh, want):
  """The same fake peer, behind a keyed reader's remote tier: its lookup says it holds the
  prefix, its fetch never ends. The reader counts one miss, recomputes, and its tokens are
  a fresh recompute's."""
  peer = FakeWirePeer(None, key=KEY)
  try:
    engine = _reader(mesh, peer.address)
    peer.flood = _flood(engine.cache.payload_shape, engine.cache.config.jnp_dtype, "too_many",
                        True, security.Seal(KEY, "remote-answer"))
    assert engine.cache.encrypt and engine.generate([PROMPT], 5) == want
    assert engine.stats()["hits"]["remote"] == 0
    assert engine.cache.worker.remotes[0].failures_by_reason == {"malformed": 1}
  finally:
    peer.close()
  assert peer.fetches == 1 and peer.taken < (64 << 20)


def test_a_request_replayed_after_thousands_of_newer_ones_is_refused(owner):
  """A request recorded on the path and re-sent on its connection after 4,100 newer ones
  (more than any window of remembered requests) is refused as a replay, counted, while
  every request of the client's own is answered, before and after."""
  engine, _ = owner
  limits = BlockServerLimits(max_messages_per_peer=BlockServerLimits().max_messages_per_poll)
  server = BlockServer(engine.cache, limits=limits)  # its requests never wait
  keys = _keys(engine)[:1]
  try:
    with serving(server):
      client = RemoteClient(server.address, engine.cache.config.fingerprint(), secret=KEY)
      assert client.lookup(keys) == 1  # connected, with its challenge
      sent, send = [], client._sock.send_multipart
      client._sock.send_multipart = lambda frames, *a, **kw: (
          sent.append([bytes(f) for f in frames]), send(frames, *a, **kw))[1]
      for _ in range(4101):
        assert client.lookup(keys) == 1
      replays = server.counts["replay"]
      send(sent[0])  # the first recorded request, 4,100 requests later
      assert client.lookup(keys) == 1  # (the replay's answer comes first: dropped unread)
      assert client.stale_answers == 1 and not client.failures_by_reason
    assert server.counts["replay"] == replays + 1
  finally:
    server.close()
