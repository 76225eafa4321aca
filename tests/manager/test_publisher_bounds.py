"""What a peer of the KV event sockets can make the publisher hold, measured.

Each test starts a real ``EventPublisher`` in a child process (so its memory is its own:
``VmRSS``/``VmHWM`` from ``/proc/PID/status``), attacks it over real ZeroMQ sockets on
loopback as an outsider with no key would, and checks the publisher's peak memory against
the bound ``jaxkv.manager.publisher`` states, and that an honest reader still reads.
"""

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

import msgspec
import pytest
import zmq

import helpers
import jaxkv
from jaxkv.manager import publisher as publisher_lib
from jaxkv.worker.tiers.pool.master import free_port

MiB = 2**20
# The bounds the publisher's module docstring states (its default PublisherLimits, checked
# below), written out so that a publisher without them fails on the numbers.
ANSWER_BYTES = 1 * MiB  # one replay answer
BUFFER_BYTES = 32 * MiB  # the replay buffer
PER_SUBSCRIBER_BYTES = 32 * 128 * 1024  # what one subscriber that does not read holds
PER_REPLAY_PEER_BYTES = 32 * 128 * 1024  # what one replay peer that does not read holds

# The child: a publisher at argv[1] (replay at argv[2]) that obeys one command a line on
# stdin and answers one JSON line: its memory, its counters, or "ok".
CHILD = r"""
import json, sys
from jaxkv.manager import publisher as P
from jaxkv.manager.events import BlockStored

pub = P.EventPublisher(sys.argv[1], replay=sys.argv[2])
COUNTERS = ("sent", "snapshots", "replays", "replays_refused", "replays_malformed",
            "subscriptions_foreign", "rebinds", "peers_disconnected")

def stored(i, tokens=16):
  return BlockStored(block_hashes=[i], parent_block_hash=i - 1 if i else None,
                     token_ids=list(range(i, i + tokens)), block_size=tokens, lora_id=None,
                     medium="GPU", lora_name=None)

for line in sys.stdin:
  cmd, *args = line.split()
  if cmd == "mem":  # now, and the peak since the last "mem" (then the peak starts again)
    status = dict(l.split(":", 1) for l in open("/proc/self/status"))
    out = {k: int(status[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
  elif cmd == "stats":
    out = {k: getattr(pub, k, None) for k in COUNTERS}
    out["queued"] = pub._queue.qsize()
  elif cmd == "store":  # blocks 0..n-1, each its own event
    for i in range(int(args[0])):
      pub.put(stored(i))
    out = "ok"
  elif cmd == "flood":  # n events of one block with many tokens: the stream's bytes
    ev = stored(0, tokens=int(args[1]))
    for _ in range(int(args[0])):
      pub.put(ev)
    out = "ok"
  else:
    break
  print(json.dumps(out), flush=True)
pub.close()
"""


class Child:
  """The publisher's process; killed with its process group on every exit."""

  def __init__(self):
    self.endpoint = f"tcp://127.0.0.1:{free_port()}"
    self.replay = f"tcp://127.0.0.1:{free_port()}"
    self.proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, self.endpoint, self.replay], cwd=helpers.ROOT,
        env=helpers.child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        start_new_session=True)

  def ask(self, cmd: str, timeout_s: float = 30.0):
    self.proc.stdin.write(cmd + "\n")
    self.proc.stdin.flush()
    ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
    if not ready:
      pytest.fail(f"the publisher's process did not answer {cmd!r} in {timeout_s} s")
    line = self.proc.stdout.readline()
    if not line:
      pytest.fail(f"the publisher's process exited (status {self.proc.wait(5)}) on {cmd!r}")
    return json.loads(line)

  def settle(self, what, timeout_s: float = 20.0):
    """Waits until the publisher has sent everything it was given; its counters."""
    deadline = time.monotonic() + timeout_s
    while True:
      stats = self.ask("stats")
      if what(stats):
        return stats
      if time.monotonic() > deadline:
        pytest.fail(f"the publisher did not get there in {timeout_s} s: {stats}")
      time.sleep(0.05)

  def close(self):
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self.proc.wait(10)


@pytest.fixture
def child():
  c = Child()
  try:
    c.ask("stats", timeout_s=60)  # imported and bound
    yield c
  finally:
    c.close()


class RawPeer:
  """A peer that speaks ZMTP 3.0 by hand over a TCP socket, as an attacker may: it can
  announce a frame of any size and stream it without holding it."""

  def __init__(self, endpoint: str, socket_type: bytes):
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    self.sock = socket.create_connection((host, int(port)), timeout=10)
    # greeting: signature, version 3.0, mechanism NULL, as-server 0, filler
    self.sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0")
                      + bytes(32))
    body = (b"\x05READY\x0bSocket-Type" + struct.pack(">I", len(socket_type))
            + socket_type)
    self.sock.sendall(b"\x04" + bytes([len(body)]) + body)  # a short command frame
    got = b""
    while len(got) < 64 + 2:  # the server's greeting, then its READY
      chunk = self.sock.recv(4096)
      if not chunk:
        raise ConnectionResetError("the publisher closed the handshake")
      got += chunk

  def frame(self, first: bytes, size: int, more: bool = False) -> int:
    """Sends one frame of ``size`` bytes (``first``, then zeros), streamed; the bytes the
    peer took before it hung up."""
    flags = (0x02 if size > 255 else 0) | (0x01 if more else 0)
    head = bytes([flags]) + (struct.pack(">Q", size) if size > 255 else bytes([size]))
    sent, chunk = 0, bytes(MiB)
    try:
      self.sock.sendall(head + first)
      sent = len(first)
      while sent < size:
        n = min(MiB, size - sent)
        self.sock.sendall(chunk[:n])
        sent += n
    except OSError:  # reset: the publisher dropped us
      pass
    return sent

  def close(self):
    self.sock.close()


def subscriber(endpoint: str, topic: bytes = b"", **opts):
  sock = zmq.Context.instance().socket(zmq.SUB)
  sock.setsockopt(zmq.LINGER, 0)
  for k, v in opts.items():
    sock.setsockopt(getattr(zmq, k), v)
  sock.setsockopt(zmq.SUBSCRIBE, topic)
  sock.connect(endpoint)
  return sock


def read_all(sock, quiet_s: float = 0.3):
  """Every message until ``quiet_s`` passes with none: [(seq, [event types])]."""
  out = []
  while sock.poll(int(quiet_s * 1000)):
    _, seq, payload = sock.recv_multipart()
    batch = msgspec.msgpack.decode(payload)
    out.append((int.from_bytes(seq, "big", signed=True), [ev["type"] for ev in batch[1]]))
  return out


def joined(sock, child, timeout_s: float = 10.0):
  """Waits until ``sock`` reads the stream (the snapshot a new reader gets)."""
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if sock.poll(100):
      return read_all(sock)
  pytest.fail(f"a subscriber read nothing in {timeout_s} s: {child.ask('stats')}")


def grew(child, before) -> int:
  """The child's peak resident memory since ``before`` (a ``mem`` answer) above what it
  held then, in bytes."""
  return child.ask("mem")["VmHWM"] - before["VmRSS"]


def test_a_big_subscription_frame_is_refused_before_it_costs_memory(child):
  honest = subscriber(child.endpoint)
  hostile = None
  try:
    child.ask("store 100")
    joined(honest, child)
    before = child.ask("mem")
    hostile = RawPeer(child.endpoint, b"SUB")
    taken = hostile.frame(b"\x01" + os.urandom(64), 8 * MiB)  # old: 8M trie nodes
    time.sleep(1.0)
    child.ask("store 200")
    got = read_all(honest)
    assert sum(len(types) for _, types in got) >= 200, "the honest reader stopped hearing"
    growth = grew(child, before)
    print(f"an 8 MiB subscription ({taken / MiB:.1f} MiB taken): publisher grew "
          f"{growth / MiB:.1f} MiB")
    assert growth < 16 * MiB, f"an 8 MiB subscription frame cost {growth / MiB:.0f} MiB"
  finally:
    honest.close(0)
    if hostile is not None:
      hostile.close()


def test_resent_one_byte_subscriptions_make_no_snapshots(child):
  honest = subscriber(child.endpoint)
  hostile = zmq.Context.instance().socket(zmq.XSUB)  # sends subscription frames as they are
  hostile.setsockopt(zmq.LINGER, 0)
  try:
    child.ask("store 2000")
    joined(honest, child)
    hostile.connect(child.endpoint)
    before = child.ask("mem")
    start = child.ask("stats")["snapshots"]
    for _ in range(20000):  # 20,000 one-byte subscriptions to everything, on one connection
      hostile.send(b"\x01")
    time.sleep(1.5)
    got = read_all(honest)
    stats = child.ask("stats")
    cleared = sum(types.count("AllBlocksCleared") for _, types in got)
    growth = grew(child, before)
    print(f"snapshots {stats['snapshots'] - start}, AllBlocksCleared read {cleared}, "
          f"publisher growth {growth / MiB:.1f} MiB")
    assert stats["snapshots"] - start <= 1, stats  # the hostile connection's first only
    assert cleared <= 1, f"the honest reader's view was reset {cleared} times"
    assert growth < 16 * MiB, f"re-sent subscriptions cost {growth / MiB:.0f} MiB"
  finally:
    honest.close(0)
    hostile.close(0)


def test_subscriptions_to_what_is_never_sent_cannot_fill_the_trie(child):
  honest = subscriber(child.endpoint)
  peers = []
  try:
    child.ask("store 100")
    joined(honest, child)
    before = child.ask("mem")
    # 3 MiB of distinct 250-byte subscriptions (each ~250 trie nodes), as fast as the
    # publisher takes them; a peer that is dropped connects again.
    sent, deadline = 0, time.monotonic() + 10
    while sent < 3 * MiB and time.monotonic() < deadline:
      try:
        peers.append(RawPeer(child.endpoint, b"SUB"))
        while sent < 3 * MiB:
          batch = b"".join(b"\x00\xfa\x01" + os.urandom(249) for _ in range(1000))
          peers[-1].sock.sendall(batch)
          sent += len(batch)
      except OSError:  # the publisher dropped us (or is binding again): connect again
        time.sleep(0.02)
    time.sleep(0.5)
    growth = grew(child, before)
    stats = child.ask("stats")
    print(f"{sent / MiB:.1f} MiB of foreign subscriptions on {len(peers)} connections: "
          f"publisher grew {growth / MiB:.1f} MiB, {stats['rebinds']} re-binds, "
          f"{stats['subscriptions_foreign']} bytes of them read")
    # What libzmq takes in between two reads of ours is not counted; 4.6-15.6 MiB measured.
    assert growth < 32 * MiB, f"foreign subscriptions cost {growth / MiB:.0f} MiB"
    child.ask("store 200")  # the honest reader (reconnected by itself) still hears
    deadline = time.monotonic() + 10
    heard = 0
    while heard < 200 and time.monotonic() < deadline:
      if honest.poll(100):
        batch = msgspec.msgpack.decode(honest.recv_multipart()[2])
        heard += sum(ev["type"] == "BlockStored" for ev in batch[1])
    assert heard >= 200, f"the honest reader heard {heard} blocks after the attack"
  finally:
    honest.close(0)
    for peer in peers:
      peer.close()


def replay(dealer, start: int):
  """One replay answer: ([(seq, payload bytes)], its payload bytes)."""
  dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
  got = []
  while dealer.poll(5000):
    _, seq, payload = dealer.recv_multipart()
    seq = int.from_bytes(seq, "big", signed=True)
    if seq == -1:
      return got, sum(len(p) for _, p in got)
    got.append((seq, payload))
  pytest.fail("a replay answer did not end with seq -1 in 5 s")


def test_a_replay_of_everything_comes_in_bounded_answers_that_resume(child):
  child.ask("flood 1000 1024")  # ~3 MiB of events: more than one answer holds
  child.settle(lambda s: s["queued"] == 0)
  time.sleep(0.2)  # the last ones taken off the queue go out
  stats = child.ask("stats")
  dealer = zmq.Context.instance().socket(zmq.DEALER)
  dealer.setsockopt(zmq.LINGER, 0)
  dealer.connect(child.replay)
  try:
    seqs, answers, start = [], [], 0
    while True:
      got, size = replay(dealer, start)
      if not got:
        break
      answers.append(size)
      seqs += [s for s, _ in got]
      start = got[-1][0] + 1  # asks again from the seq after the last it got
      assert len(answers) < 100, "the answers never ended"
    print(f"replay answers: {len(answers)}, largest {max(answers) / MiB:.2f} MiB")
    assert max(answers) <= ANSWER_BYTES, f"one answer was {max(answers) / MiB:.1f} MiB"
    assert len(seqs) == stats["sent"] and seqs == list(range(seqs[0], seqs[0] + len(seqs)))
  finally:
    dealer.close(0)


def test_a_peer_that_asks_for_replays_and_never_reads_holds_a_bounded_queue(child):
  child.ask("flood 1000 1024")  # ~3 MiB kept
  child.settle(lambda s: s["queued"] == 0)
  before = child.ask("mem")
  greedy = zmq.Context.instance().socket(zmq.DEALER)  # takes one message, then nothing
  for opt, value in ((zmq.LINGER, 0), (zmq.RCVHWM, 1), (zmq.RCVBUF, 4096)):
    greedy.setsockopt(opt, value)
  greedy.connect(child.replay)
  try:
    for _ in range(100):  # everything, 100 times (old: 100 full answers queued)
      greedy.send_multipart([b"", (0).to_bytes(8, "big")])
      time.sleep(0.01)
    time.sleep(0.5)
    growth = grew(child, before)
    stats = child.ask("stats")
    print(f"100 replays of everything, never read: publisher grew {growth / MiB:.1f} MiB, "
          f"{stats['replays']} answered, {stats['replays_refused']} refused")
    assert growth < PER_REPLAY_PEER_BYTES + 4 * MiB, (
        f"a peer that never reads its replays cost {growth / MiB:.0f} MiB")
    assert stats["replays_refused"] > 0, stats
  finally:
    greedy.close(0)


def test_big_frames_to_the_replay_socket_cost_nothing(child):
  before = child.ask("mem")
  peers, taken = [], 0
  honest = zmq.Context.instance().socket(zmq.DEALER)
  honest.setsockopt(zmq.LINGER, 0)
  try:
    for _ in range(2):  # (b"", 256 MiB) as a DEALER sends a request
      peers.append(RawPeer(child.replay, b"DEALER"))
      peers[-1].frame(b"", 0, more=True)
      taken += peers[-1].frame(b"", 256 * MiB)
    time.sleep(0.5)  # (old: both frames read whole into the publisher, then refused)
    growth = grew(child, before)
    print(f"two 256 MiB frames to the replay socket ({taken / MiB:.0f} MiB taken): "
          f"publisher grew {growth / MiB:.1f} MiB")
    assert growth < 16 * MiB, f"two 256 MiB frames cost {growth / MiB:.0f} MiB"
    honest.connect(child.replay)  # an honest request is still answered
    got, _ = replay(honest, 0)
    assert got, "the replay socket stopped answering"
  finally:
    honest.close(0)
    for peer in peers:
      peer.close()


def test_a_subscriber_that_never_reads_holds_a_bounded_queue(child):
  honest = subscriber(child.endpoint)
  # Reads nothing: its socket takes one message, its kernel buffer a few KiB, then the
  # publisher's queue for it fills.
  stalled = subscriber(child.endpoint, RCVHWM=1, RCVBUF=4096)
  try:
    joined(honest, child)
    before = child.ask("mem")
    child.ask("flood 100000 512")  # ~270 MiB of events
    deadline = time.monotonic() + 30
    count = 0
    while time.monotonic() < deadline:  # the honest reader keeps up
      if honest.poll(200):
        honest.recv_multipart()
        count += 1
      elif child.ask("stats")["queued"] == 0:
        break
    stats = child.ask("stats")
    growth = grew(child, before)
    # The replay buffer, a full queue for each of the two readers (the honest one may fall
    # behind too; a message both queues hold is shared), and the encoder's and allocator's
    # working space while 270 MiB flow (17 MiB measured with no stalled reader: 49 MiB).
    bound = BUFFER_BYTES + 2 * PER_SUBSCRIBER_BYTES + 24 * MiB
    print(f"a stalled subscriber under {stats['sent']} messages: publisher grew "
          f"{growth / MiB:.1f} MiB (bound {bound / MiB:.0f} MiB)")
    assert stats["queued"] == 0, stats
    assert count >= stats["sent"] // 2, "the honest reader stopped hearing"
    assert growth < bound, f"a subscriber that never reads cost {growth / MiB:.0f} MiB"
  finally:
    honest.close(0)
    stalled.close(0)


def test_a_malformed_replay_request_is_counted_and_warned_once_a_minute(caplog):
  with caplog.at_level("WARNING"):
    pub = publisher_lib.EventPublisher(f"tcp://127.0.0.1:{free_port()}",
                                       replay=f"tcp://127.0.0.1:{free_port()}")
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
      dealer.connect(pub.bound_replay)
      for _ in range(50):
        dealer.send_multipart([b"", b"nine byte"])
      replay(dealer, 0)  # answered (its end marker came) after the 50 before it were read
    finally:
      dealer.close(0)
      pub.close()
  lines = [r.getMessage() for r in caplog.records if "replay request" in r.getMessage()]
  assert len(lines) == 1, lines  # the first, then one a minute with the count since
  assert pub.replays_malformed == 50


def test_a_non_loopback_endpoint_says_insecure_and_limits_are_checked(mesh, caplog):
  with caplog.at_level("WARNING"):
    e = helpers.make_engine(mesh, tiers=jaxkv.TierConfig(
        kv_events=f"tcp://0.0.0.0:{free_port()}",
        kv_events_replay=f"tcp://127.0.0.1:{free_port()}"))
  e.cache.close()
  lines = [r.getMessage() for r in caplog.records if "INSECURE" in r.getMessage()]
  assert len(lines) == 1 and "--kv_events=tcp://0.0.0.0:" in lines[0], lines
  assert "127.0.0.1" in lines[0]  # the fix
  limits = publisher_lib.PublisherLimits()
  assert (limits.replay_answer_bytes, limits.buffer_bytes, limits.per_subscriber_bytes,
          limits.per_replay_peer_bytes) == (
              ANSWER_BYTES, BUFFER_BYTES, PER_SUBSCRIBER_BYTES, PER_REPLAY_PEER_BYTES)
  with pytest.raises(jaxkv.InputError, match=r"frame_bytes=8 must be >= 64"):
    publisher_lib.PublisherLimits(frame_bytes=8)
  with pytest.raises(jaxkv.InputError, match=r"sndhwm=0 must be a positive int"):
    publisher_lib.PublisherLimits(sndhwm=0)
