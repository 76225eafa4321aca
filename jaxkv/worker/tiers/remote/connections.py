"""The REMOTE tier's connections: the block server's ZeroMQ STREAM socket and its peers.

A ``BlockServer`` reads raw bytes, not ZeroMQ messages, so that nothing a peer sends is
buffered past the bounds below before the server has looked at it. ``Connections`` owns the
socket: it reads one chunk at a time (``receive``), feeds each connection's bytes to its
``_Inbound`` (the ZMTP handshake, then requests frame by frame, each frame kept up to its
cap or dropped as it arrives), hands out the requests read in turn, a connection at a time
(``next_turn``), sends answers without waiting (a connection whose send queue is full is
closed), and closes connections that broke the protocol or stayed in their handshake past
``handshake_timeout_s`` (``tidy``). What a request means, and what it is answered, is the
server's (``jaxkv.worker.tiers.remote.server``).

What a connection costs, whatever it sends: its STREAM queue of ``RCVHWM_CHUNKS`` chunks of
at most ``IN_BATCH_BYTES`` between polls (``queued_bytes_most``), then TCP holds the sender
back; and the requests read and not yet answered, up to ``max_pending_bytes_per_peer``,
each charged ``REQUEST_OVERHEAD_BYTES`` for its objects, plus one request being read and a
chunk not parsed yet (``held_bytes_most``).
"""

from __future__ import annotations

import collections
import hmac
import time

import zmq

from jaxkv.worker.tiers.remote.auth import HANDSHAKE_USER, plain_credentials
from jaxkv.worker.tiers.remote.wire import (
    COMMAND, GREETING_BYTES, LONG, MAX_COMMAND_BYTES, MAX_REQUEST_BYTES, MORE,
    REQUEST_FRAME_BYTES, command_frame, command_parts, greeting_bytes, greeting_mechanism,
    parse_head, socket_type)

IN_BATCH_BYTES = 8192  # libzmq reads a STREAM connection in chunks of at most this
RCVHWM_CHUNKS = 64  # chunks a STREAM connection's queue holds before TCP holds the sender
# Charged, per request waiting for a poll, for its Python objects (a list, three buffers).
REQUEST_OVERHEAD_BYTES = 512


class _Hangup(Exception):
  """A connection that broke the protocol, or its handshake: the server closes it."""


class _Inbound:
  """The server's side of one connection, fed the raw bytes ZeroMQ's STREAM socket reads
  (``feed``): its handshake (ZMTP NULL without a key; PLAIN with the key's token, compared
  in constant time), then its requests, frame by frame.

  A request's frames are kept up to their caps (``REQUEST_FRAME_BYTES``), each written
  into a buffer of its size as its bytes arrive; a frame over its cap, or past the third,
  is dropped as its bytes arrive (counted in ``counts["frames_dropped"]``), and its
  message is refused once it ends; a frame over ``MAX_REQUEST_BYTES`` closes the
  connection (``counts["oversized"]``). Complete requests wait in ``ready`` for a poll, at
  most ``pending_bytes_most`` of them (each charged ``REQUEST_OVERHEAD_BYTES`` for its
  objects; more are shed, ``counts["shed"]``). So a connection holds at most that, one
  request being read, and the bytes of a chunk not parsed yet (less than a command)."""

  def __init__(self, token: bytes | None, counts: collections.Counter,
               pending_bytes_most: int, now: float):
    self.token = token
    self.counts = counts
    self.pending_bytes_most = pending_bytes_most
    self.since = now
    self.state = "greeting"  # -> "hello" -> "initiate" (PLAIN) | "ready" (NULL) -> "open"
    self.refused = False  # its PLAIN credentials did not pass (then "closed")
    self._raw = bytearray()  # bytes not parsed yet: part of a header or command, a chunk
    self._frames: list = []  # the kept frames of the request being read
    self._count = 0  # its frames so far, kept or dropped
    self._problem = ""  # why that request will be refused, if it will
    self._left = 0  # bytes of the current frame still to come ...
    self._into: bytearray | None = None  # ... into this buffer (None: dropped)
    self._more = False  # ... and whether another frame follows it
    self.ready: collections.deque = collections.deque()  # (frames, problem, charge)
    self.pending_bytes = 0

  def take(self) -> tuple[list, str]:
    frames, problem, charge = self.ready.popleft()
    self.pending_bytes -= charge
    return frames, problem

  def feed(self, data: bytes) -> list[bytes]:
    """Takes a chunk of the connection's bytes; returns what to send back (the handshake's
    steps). Raises ``_Hangup`` when the connection must be closed."""
    if self.state == "closed":
      return []
    raw = self._raw
    raw += data
    at, replies = 0, []
    try:
      while True:
        if self._left:  # the rest of a frame: written into its buffer, or dropped
          n = min(self._left, len(raw) - at)
          if self._into is not None:
            end = len(self._into) - self._left
            with memoryview(raw) as view:
              self._into[end:end + n] = view[at:at + n]
          at += n
          self._left -= n
          if self._left:
            break
          self._frame_done()
          continue
        if self.state == "greeting":
          if len(raw) - at < GREETING_BYTES:
            break
          mechanism = b"PLAIN" if self.token is not None else b"NULL"
          if greeting_mechanism(raw[at:at + GREETING_BYTES]) != mechanism:
            raise _Hangup("another mechanism")  # the client sees it too: not counted
          at += GREETING_BYTES
          self.state = "hello" if self.token is not None else "ready"
          continue
        head = parse_head(raw, at)
        if head is None:
          break
        flags, size, head_bytes = head
        if flags & ~(MORE | LONG | COMMAND):
          raise _Hangup(f"frame flags {flags:#x}")
        if flags & COMMAND or self.state != "open":
          if not flags & COMMAND or flags & MORE or self._count or size > MAX_COMMAND_BYTES:
            raise _Hangup("not a command where one belongs")
          if len(raw) - at < head_bytes + size:
            break
          replies += self.command_frame(bytes(raw[at + head_bytes:at + head_bytes + size]))
          at += head_bytes + size
          if self.state == "closed":
            return replies
          continue
        if size > MAX_REQUEST_BYTES:
          self.counts["oversized"] += 1
          raise _Hangup(f"a frame of {size} bytes")
        at += head_bytes
        self._count += 1
        self._left, self._more, self._into = size, bool(flags & MORE), None
        cap = REQUEST_FRAME_BYTES[self._count - 1] if self._count <= 3 else -1
        if size <= cap:
          self._into = bytearray(size)
        else:
          self.counts["frames_dropped"] += 1
          if cap >= 0 and not self._problem:
            self._problem = (f"frame {self._count} of a request (nonce, message, auth) holds "
                             f"at most {cap} bytes, not {size}")
        if not size:
          self._frame_done()
    finally:
      del raw[:at]
    return replies

  def _frame_done(self) -> None:
    if self._into is not None:
      self._frames.append(self._into)
      self._into = None
    if self._more:
      return
    frames, count, problem = self._frames, self._count, self._problem
    self._frames, self._count, self._problem = [], 0, ""
    if count != 3:
      problem = f"a request has 3 frames (nonce, message, auth), not {count}"
    charge = sum(map(len, frames)) + REQUEST_OVERHEAD_BYTES
    if self.pending_bytes + charge > self.pending_bytes_most:
      self.counts["shed"] += 1
      return
    self.ready.append((frames, problem, charge))
    self.pending_bytes += charge

  def command_frame(self, command: bytes) -> list[bytes]:
    """The answer to one handshake command (a command after it, a ping, needs none)."""
    name, body = command_parts(command)
    if self.state == "hello" and name == b"HELLO":
      credentials = plain_credentials(body)
      if (credentials is not None and credentials[0] == HANDSHAKE_USER
          and hmac.compare_digest(credentials[1], self.token)):
        self.state = "initiate"
        return [command_frame(b"WELCOME")]
      self.state, self.refused = "closed", True
      return [command_frame(b"ERROR", b"\x03400")]  # 400: ZAP's "not these credentials"
    if (self.state, name) in (("initiate", b"INITIATE"), ("ready", b"READY")):
      self.state = "open"
      return [command_frame(b"READY", socket_type(b"ROUTER"))]
    if self.state == "open":
      return []
    raise _Hangup(f"a {name[:20]!r} command in the handshake")


class Connections:
  """The STREAM socket bound at ``host:port`` (a free port when 0; ``address`` says which)
  and the state of each connection on it. ``token``: the handshake token every connection
  must present (PLAIN), or None (NULL: anyone); ``limits``: the server's
  ``BlockServerLimits`` (per connection: ``max_pending_bytes_per_peer``,
  ``max_messages_per_peer`` answers a poll, ``handshake_timeout_s``); ``counts``: the
  server's, which the connections add to; ``send_hwm``: sends queued per connection before
  it is closed. Used by one thread at a time (the server's poll); ``close`` it."""

  def __init__(self, host: str, port: int, *, token: bytes | None, limits,
               counts: collections.Counter, send_hwm: int):
    self.token, self.limits, self.counts = token, limits, counts
    self.handshakes_refused = 0  # connections turned away for a wrong token
    self.progressed = False  # a handshake took a step since the owner last cleared it
    self._peers: dict[bytes, _Inbound] = {}  # connection id -> its inbound side
    self._turns: collections.OrderedDict = collections.OrderedDict()  # ids with requests ready
    self._closing: set[bytes] = set()  # connections to close (their queue was full)
    self._sweep_at = 0.0  # when handshakes past their time are next closed
    self._context = zmq.Context()
    self._socket = None
    try:
      self._socket = self._context.socket(zmq.STREAM)
      self._socket.setsockopt(zmq.LINGER, 0)
      self._socket.setsockopt(zmq.RCVHWM, RCVHWM_CHUNKS)  # per connection, raw chunks
      self._socket.setsockopt(zmq.SNDHWM, send_hwm)
      if port:
        self._socket.bind(f"tcp://{host}:{port}")
      else:
        port = self._socket.bind_to_random_port(f"tcp://{host}")
    except BaseException:  # e.g. the port is taken: leave no socket behind
      self._context.destroy(linger=0)
      raise
    self.address = f"{host}:{port}"

  @property
  def queued_bytes_most(self) -> int:
    """The most bytes ZeroMQ queues for one connection between polls: its STREAM queue of
    ``RCVHWM_CHUNKS`` chunks, and the one its reader holds once the queue is full (raw
    chunks are read ``IN_BATCH_BYTES`` at most; then TCP holds the sender back)."""
    return (RCVHWM_CHUNKS + 1) * IN_BATCH_BYTES

  @property
  def held_bytes_most(self) -> int:
    """The most bytes of one connection's requests held here: those read and waiting
    (``max_pending_bytes_per_peer``), the one being read (its three frames at their caps),
    a chunk as read and as not parsed yet, and a command."""
    return (self.limits.max_pending_bytes_per_peer + sum(REQUEST_FRAME_BYTES)
            + 2 * IN_BATCH_BYTES + MAX_COMMAND_BYTES)

  def readable(self, timeout_s: float) -> bool:
    """Whether bytes (or a connection's coming or going) wait to be read, waiting up to
    ``timeout_s`` for them."""
    return bool(self._socket.poll(max(0, int(timeout_s * 1000))))

  def waiting(self) -> bool:
    """Whether a request or bytes wait to be read."""
    return bool(self._turns) or self.readable(0)

  def close(self) -> None:
    if self._socket is not None:
      self._socket.close(0)
    self._context.term()

  def receive(self) -> None:
    """Reads one chunk: a connection made or gone (ZeroMQ's empty notice), or its bytes."""
    try:
      peer, data = self._socket.recv_multipart(flags=zmq.NOBLOCK)
    except zmq.Again:
      return
    inbound = self._peers.get(peer)
    if not data:
      if inbound is not None:  # gone
        self._forget(peer)
      else:  # made (or a notice of one already closed here: its greeting finds no one)
        self._peers[peer] = _Inbound(self.token, self.counts,
                                     self.limits.max_pending_bytes_per_peer, time.monotonic())
        self.progressed |= self.send(peer, [greeting_bytes(
            b"PLAIN" if self.token is not None else b"NULL", self.token is not None)])
      return
    if inbound is None:  # bytes of a connection being closed
      return
    try:
      replies = inbound.feed(data)
    except _Hangup:
      self._hang_up(peer)
      return
    if inbound.refused:
      inbound.refused = False
      self.handshakes_refused += 1
      self._closing.add(peer)  # once its ERROR has gone: at the next poll
    if replies:
      self.progressed |= self.send(peer, replies)
    if inbound.ready and peer not in self._turns:
      self._turns[peer] = None

  def next_turn(self, per_peer) -> tuple[bytes, list, str] | None:
    """The next request to answer, ``(peer, frames, problem)``: from the first connection
    in turn below its share of the poll (``per_peer``: answers so far, by connection)."""
    for peer in self._turns:
      if per_peer[peer] < self.limits.max_messages_per_peer:
        inbound = self._peers[peer]
        frames, problem = inbound.take()
        if inbound.ready:
          self._turns.move_to_end(peer)
        else:
          del self._turns[peer]
        return peer, frames, problem
    return None

  def send(self, peer: bytes, pieces: list) -> bool:
    """Sends ``pieces`` (one message's bytes) to ``peer`` without waiting; a connection whose
    queue is full is closed (a partly sent message cannot be taken back)."""
    try:
      for piece in pieces:
        self._socket.send_multipart([peer, piece], flags=zmq.NOBLOCK, copy=False)
      return True
    except zmq.Again:
      self.counts["send_queue_full"] += 1
      self._hang_up(peer)
    except zmq.ZMQError:  # the connection is gone
      self._forget(peer)
    return False

  def tidy(self, now: float) -> None:
    """Closes the connections waiting to be closed, and once a second those whose
    handshake is past ``handshake_timeout_s``."""
    for peer in list(self._closing):
      self._hang_up(peer)
    if now >= self._sweep_at:
      self._sweep_at = now + 1.0
      for peer, inbound in list(self._peers.items()):
        if inbound.state != "open" and now - inbound.since > self.limits.handshake_timeout_s:
          self._hang_up(peer)

  def _hang_up(self, peer: bytes) -> None:
    """Closes a connection (an empty send does), or tries again next poll."""
    self._forget(peer)
    try:
      self._socket.send_multipart([peer, b""], flags=zmq.NOBLOCK)
    except zmq.Again:  # its queue is full: the close waits there too
      self._closing.add(peer)
    except zmq.ZMQError:
      pass  # gone already

  def _forget(self, peer: bytes) -> None:
    self._peers.pop(peer, None)
    self._turns.pop(peer, None)
    self._closing.discard(peer)
