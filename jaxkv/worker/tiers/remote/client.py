"""The REMOTE tier's reading side: ``RemoteClient``, one peer's blocks over one connection.

``RemoteClient`` runs in the job that wants the blocks (``TierConfig.remote_peers``). It
asks how long a prefix of block keys the peer holds (``lookup``), then for the blocks
(``fetch``): one round trip, the blocks travelling in the answer itself as one zero-copy
frame after the header. ``transport="transfer"`` instead has the answer carry a
``jax.experimental.transfer`` offer that the client pulls (device to device where that
library has a direct path; on CPU it is slower than the inline frame).

It reads its one TCP connection itself (``_Link``): before reading a frame of an answer it
compares the frame's size with what the answer to its request can hold (a nonce of 64 B,
a header of ``MAX_HEADER_BYTES``, its tags, then exactly the blocks it asked for: one
frame of ``blocks x block bytes``, or when sealed one frame per sealed piece), and stops
at the first frame that cannot belong (a miss, the connection closed): it holds at most
``RemoteClient.answer_bytes_most(blocks)``, before any tag is checked.

What the reader never trusts: every answer names its block keys, dtype and shape; the
reader checks keys, dtype, shape and frame sizes before looking at the bytes and the tag
or CRC, and rejects the whole fetch on any mismatch. Any answer that breaks the protocol
is a counted miss (``RemoteClient.failures_by_reason``), never an exception. Answers to an
earlier request are told apart by their nonce and read past without being kept. Every
wait has the reader's deadline; a late, refused or broken fetch is a miss and the request
recomputes. A peer that keeps failing trips a circuit breaker and is not asked again until
its cool-down has passed.

What the client never owes: a transfer offer only ever makes it connect to the peer's own
host (the offer names the port; another host is refused as malformed), it keeps at most
``MAX_TRANSFER_CONNECTIONS`` of those connections, and a pull not done by the deadline
is abandoned and its connection broken, so the thread that waited on it ends.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import socket
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import zmq

from jaxkv.worker import pages as pages_lib
from jaxkv import security
from jaxkv.config import REMOTE_TRANSPORTS as TRANSPORTS
from jaxkv.worker.tiers.base import Breaker, Failure
from jaxkv.errors import InputError, InvariantError
from jaxkv.worker.tiers.remote.auth import (HANDSHAKE_FIX, HANDSHAKE_USER, KEYLESS_FIX,
                                            UNAUTHENTICATED, Unauthenticated, handshake_token)
from jaxkv.worker.tiers.remote.wire import (
    ANSWER_TO, CHUNK_BYTES, COMMAND, GREETING_BYTES, LONG, MAX_COMMAND_BYTES,
    MAX_FETCH_BLOCKS, MAX_HEADER_BYTES, MAX_KEYS, MAX_NONCE_BYTES, MORE, ANSWERS,
    FetchBlocks, Hello, Lookup, Offer, Refusal, RemoteError, WireError, bytes_of, chunk_aads,
    split_chunks, command_frame, command_parts, stack_digest, greeting_bytes, greeting_mechanism, frame_head,
    head_aad, new_nonce, piece_sizes, pull_aad, socket_type, decode)

MAX_TRANSFER_CONNECTIONS = 4  # a client's transfer connections (to its one peer's host)


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What an answer to one request may hold, frame by frame: a nonce (``MAX_NONCE_BYTES``),
  a header (``MAX_HEADER_BYTES``), tags (``tag_bytes``), then exactly the blocks frames
  ``data`` (their sizes), or none. An answer to another request is read past, if its
  frames stay within ``other_frames`` frames of ``other_frame_bytes`` each."""

  tag_bytes: int
  data: tuple[int, ...]
  other_frame_bytes: int
  other_frames: int


class _Link:
  """The client's connection to a peer: a TCP socket speaking ZMTP 3.1 as a ZeroMQ DEALER
  does (NULL, or PLAIN with the key's token), read by hand so that each frame's size is
  checked before a byte of it is kept (``answer``). Every wait has the caller's deadline.
  An answer left half read (late, or with a frame that cannot belong) closes the link:
  what follows on the stream can no longer be told apart."""

  READ_AHEAD_BYTES = 64 << 10  # small frames are read from a buffer this size

  def __init__(self, address: str, host: str, port: int, token: bytes | None,
               deadline: float):
    self.address = address
    self.closed = False
    self._buf = bytearray()  # bytes read ahead, not yet taken
    self._ahead = bytearray(self.READ_AHEAD_BYTES)
    try:
      self._sock = socket.create_connection((host.strip("[]"), port),
                                            timeout=max(1e-3, deadline - time.monotonic()))
    except TimeoutError:
      raise RemoteError("deadline", f"peer {address} did not take a connection in time") from None
    except OSError as e:
      raise RemoteError("io", f"cannot connect to peer {address}: {e}") from None
    try:
      self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      self._handshake(token, deadline)
    except BaseException:
      self.close()
      raise

  def close(self) -> None:
    self.closed = True
    self._sock.close()

  # ---- bytes, with the deadline -----------------------------------------------------------
  def _wait(self, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
      raise RemoteError("deadline", f"peer {self.address} did not answer in time")
    self._sock.settimeout(left)

  def _io(self, call, *args):
    try:
      return call(*args)
    except TimeoutError:
      raise RemoteError("deadline", f"peer {self.address} did not answer in time") from None
    except OSError as e:
      raise RemoteError("io", f"the connection to peer {self.address} failed: {e}") from None

  def _write(self, data, deadline: float) -> None:
    self._wait(deadline)
    self._io(self._sock.sendall, data)

  def _fill(self, deadline: float) -> None:
    """Reads what has come (a byte at least, ``READ_AHEAD_BYTES`` at most)."""
    self._wait(deadline)
    n = self._io(self._sock.recv_into, self._ahead)
    if not n:
      raise RemoteError("closed", f"peer {self.address} closed the connection")
    with memoryview(self._ahead) as view:
      self._buf += view[:n]

  def _read(self, n: int, deadline: float) -> bytes:
    """``n`` bytes (a small frame: at most ``MAX_HEADER_BYTES``)."""
    while len(self._buf) < n:
      self._fill(deadline)
    out = bytes(self._buf[:n])
    del self._buf[:n]
    return out

  def _read_into(self, out: memoryview, deadline: float) -> None:
    """Fills ``out`` (a blocks frame, read straight into its own buffer)."""
    taken = min(len(self._buf), len(out))
    out[:taken] = self._buf[:taken]
    del self._buf[:taken]
    out = out[taken:]
    while out:
      self._wait(deadline)
      n = self._io(self._sock.recv_into, out)
      if not n:
        raise RemoteError("closed", f"peer {self.address} closed the connection")
      out = out[n:]

  def _skip(self, n: int, deadline: float) -> None:
    """Reads past ``n`` bytes, keeping none."""
    while n:
      if not self._buf:
        self._fill(deadline)
      taken = min(n, len(self._buf))
      del self._buf[:taken]
      n -= taken

  def _frame_head(self, deadline: float) -> tuple[int, int]:
    flags, size = self._read(2, deadline)
    if flags & ~(MORE | LONG | COMMAND):
      raise RemoteError("malformed", f"a frame with flags {flags:#x}")
    if flags & LONG:
      size = int.from_bytes(bytes([size]) + self._read(7, deadline), "big")
    return flags, size

  # ---- the handshake ------------------------------------------------------------------------
  def _handshake(self, token: bytes | None, deadline: float) -> None:
    mine = b"PLAIN" if token is not None else b"NULL"
    self._write(greeting_bytes(mine, as_server=False), deadline)
    try:
      theirs = greeting_mechanism(self._read(GREETING_BYTES, deadline))
      if theirs != mine:
        raise RemoteError("refused", f"peer {self.address} refused this connection's "
                          f"handshake (it speaks {theirs or b'no ZMTP 3'!r}, this client "
                          f"{mine!r}): {HANDSHAKE_FIX}")
      if token is not None:
        self._write(command_frame(b"HELLO", bytes([len(HANDSHAKE_USER)]) + HANDSHAKE_USER
                             + bytes([len(token)]) + token), deadline)
        self._expect(b"WELCOME", deadline)
        self._write(command_frame(b"INITIATE", socket_type(b"DEALER")), deadline)
      else:
        self._write(command_frame(b"READY", socket_type(b"DEALER")), deadline)
      self._expect(b"READY", deadline)
    except RemoteError as e:
      if e.reason not in (Failure.CLOSED, Failure.IO):
        raise
      raise RemoteError("refused", f"peer {self.address} closed the connection in this "
                        f"connection's handshake ({e}): {HANDSHAKE_FIX}") from None

  def _expect(self, name: bytes, deadline: float) -> None:
    flags, size = self._frame_head(deadline)
    if not flags & COMMAND or size > MAX_COMMAND_BYTES:
      raise RemoteError("malformed", f"a frame of {size} bytes in the handshake, where a "
                        f"{name.decode()} command belongs")
    got, body = command_parts(self._read(size, deadline))
    if got == b"ERROR":
      reason = body[1:1 + body[0]].decode("ascii", "replace") if body else ""
      raise RemoteError("refused", f"peer {self.address} refused this connection's "
                        f"handshake ({reason or 'no reason'}): {HANDSHAKE_FIX}")
    if got != name:
      raise RemoteError("malformed", f"a {got[:20]!r} command in the handshake, where "
                        f"{name.decode()} belongs")

  # ---- messages ------------------------------------------------------------------------------
  def send_multipart(self, frames, deadline: float | None = None) -> None:
    """Sends one message (by ``deadline``; by default within 5 s)."""
    data = b"".join(frame_head(len(f), MORE if i < len(frames) - 1 else 0) + bytes(f)
                    for i, f in enumerate(frames))
    self._write(data, time.monotonic() + 5.0 if deadline is None else deadline)

  def answer(self, nonce: bytes, layout: _Layout, deadline: float) -> list | None:
    """The next message's frames if it answers ``nonce`` (the blocks frames each in a buffer
    of its own, the others bytes), each frame's size checked against ``layout`` before it
    is read; None for an answer to another request, read past without being kept. Raises
    ``RemoteError`` at the first frame that cannot belong (a blocks frame of another size
    than asked: "shape"; anything else: "malformed"), the link closed."""
    try:
      return self._answer(nonce, layout, deadline)
    except BaseException:
      self.close()
      raise

  def _answer(self, nonce: bytes, layout: _Layout, deadline: float) -> list | None:
    frames: list = []
    most = 3 + len(layout.data)
    while True:
      flags, size = self._frame_head(deadline)
      if flags & COMMAND:  # a ping, between messages
        if frames or size > MAX_COMMAND_BYTES:
          raise RemoteError("malformed", f"a command of {size} bytes in an answer")
        self._skip(size, deadline)
        continue
      more = bool(flags & MORE)
      i = len(frames)
      if i == 0:
        if size > MAX_NONCE_BYTES:
          raise RemoteError("malformed", f"an answer's nonce of {size} bytes (at most "
                            f"{MAX_NONCE_BYTES})")
        if self._read(size, deadline) != nonce:  # to an earlier request: read past it
          self._read_past(more, layout, deadline)
          return None
        frames.append(nonce)
      elif i < 3:
        cap = MAX_HEADER_BYTES if i == 1 else layout.tag_bytes
        if size > cap:
          raise RemoteError("malformed", f"an answer {('header', 'tags')[i - 1]} of {size} "
                            f"bytes (at most {cap})")
        self._no_more(more, i, most)
        frames.append(self._read(size, deadline))
      else:
        want = layout.data[i - 3]
        if size != want:
          raise RemoteError("shape", f"a blocks frame of {size} bytes, expected {want}")
        self._no_more(more, i, most)
        buf = np.empty(size, np.uint8)
        self._read_into(memoryview(buf), deadline)
        frames.append(memoryview(buf))
      if not more:
        break
    if len(frames) < 3:
      raise RemoteError("malformed", f"an answer of {len(frames)} frames, not 3 or more")
    return frames

  @staticmethod
  def _no_more(more: bool, i: int, most: int) -> None:
    """Refuses frame ``i`` (from 0) when it says more follow and the answer holds ``most``."""
    if more and i + 1 >= most:
      raise RemoteError("malformed", f"an answer of more than {most} frames (frame {i + 1} "
                        "says more follow)")

  def _read_past(self, more: bool, layout: _Layout, deadline: float) -> None:
    """Reads past the rest of a message that answers another request, keeping nothing."""
    count = 1
    while more:
      flags, size = self._frame_head(deadline)
      count += 1
      if flags & COMMAND or size > layout.other_frame_bytes or count > layout.other_frames:
        raise RemoteError("malformed", f"an answer to another request, past {count} frames "
                          f"or {layout.other_frame_bytes} bytes a frame")
      self._skip(size, deadline)
      more = bool(flags & MORE)


# The process's transfer server (one per device client), kept for the process's life: a
# pull given up at its deadline can still be running on its thread (its connection
# poisoned, the pull not yet returned), and a server freed under it (its client's last
# reference dropped, whenever the garbage collector gets to it) would be a use after free.
_TRANSFER_SERVERS: dict = {}
_TRANSFER_LOCK = threading.Lock()


def _transfer_server(device):
  import jax.experimental.transfer as transfer
  with _TRANSFER_LOCK:
    client = device.client
    if id(client) not in _TRANSFER_SERVERS:  # (the client is kept: its id stays its own)
      _TRANSFER_SERVERS[id(client)] = (client, transfer.start_transfer_server(
          client, "127.0.0.1:0", ["127.0.0.1:0"]))
    return _TRANSFER_SERVERS[id(client)][1]


def _inline(data: list, shape, bits) -> np.ndarray:
  """The blocks carried in an answer's data frame, viewed without a copy."""
  want = int(np.prod(shape)) * bits.itemsize
  if len(data) != 1 or len(data[0]) != want:
    raise RemoteError("shape", f"{[len(d) for d in data]} bytes of data, expected [{want}]")
  return np.frombuffer(data[0], dtype=bits).reshape(shape)


def _transfer_address(offered: str, peer_host: str) -> str:
  """Where to pull an offer from: the peer's own host, at the port the offer names. An
  offer naming another host is malformed (a peer never sends a client elsewhere); an
  unspecified one (``0.0.0.0``, ``::``: the peer's transfer server listens on every
  interface) means the peer's host."""
  host, _, port = offered.rpartition(":")
  host = host.strip("[]")
  if not port.isdigit() or host not in (peer_host.strip("[]"), "0.0.0.0", "::"):
    raise RemoteError("malformed", f"the offer's transfer address {offered[:80]!r} is not "
                      f"on the peer's host {peer_host}")
  return f"{peer_host}:{int(port)}"


class RemoteClient:
  """Fetches blocks from one peer, with deadlines and a circuit breaker.

  ``secret``: the deployment key (the peer must have the same); ``encrypt``: ask for
  sealed blocks and refuse plaintext ones (needs the key). With a key, each connection
  opens with the handshake's token (``handshake_token``); a peer that refuses the
  handshake (another key, or none) is a "refused" miss as soon as it says so. Its one
  connection (``_Link``) reads answers frame by frame, each checked against what the
  request can get (``_layout``), so an answer costs it at most ``answer_bytes_most``. Whatever
  goes wrong with a lookup or a fetch is counted in ``failures_by_reason`` (``base.Failure``
  values) and costs a miss: ``lookup`` returns 0, ``fetch`` raises ``RemoteError`` and
  nothing else."""

  def __init__(self, address: str, fingerprint: bytes, *, deadline_s: float = 5.0,
               trip_after: int = 3, cool_down_s: float = 10.0, secret: bytes | None = None,
               encrypt: bool = False, transport: str = "inline"):
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise InputError(f"remote peer {address!r} must be 'host:port'.")
    if transport not in TRANSPORTS:
      raise InputError(f"remote transport {transport!r} must be one of {TRANSPORTS}.")
    self.address, self.host, self.port = address, host, int(port)
    self.fingerprint = fingerprint.hex()
    self.deadline_s = deadline_s
    self.transport = transport
    self.breaker = Breaker(trip_after, cool_down_s)
    self._secret = security.check_key(secret)
    if encrypt and self._secret is None:
      raise InputError(f"RemoteClient({address!r}, encrypt=True) needs a deployment key "
                       "(secret=...): blocks are sealed under it.")
    if self._secret is None:
      security.warn_insecure("remote peers are asked without a deployment key: their "
                             "answers are not authenticated (a CRC-32C catches damage, not "
                             "forgery) and blocks cross the network in plaintext",
                             KEYLESS_FIX)
    self.encrypt = encrypt
    self._seal = (security.Seal(self._secret, "remote-answer")
                  if self._secret is not None else None)
    self.failures_by_reason: collections.Counter = collections.Counter()
    self.hellos = 0  # challenges asked for (one per connection and challenge epoch)
    self.stale_answers = 0  # answers dropped unread: to an earlier request, or to none
    self._challenge = ""
    self._challenge_until = 0.0
    self._number = 0  # of the last request sent: a request's number only grows
    self._block_bytes = 0  # one block's bits, as ``expect`` sized them
    self._window_bytes = 0  # one block's window KV (a model with a window group), likewise
    self._window_shape = None
    self._max_frame_bytes = MAX_HEADER_BYTES  # until ``expect`` sizes the blocks frame
    self._token = handshake_token(self._secret) if self._secret is not None else None
    self._sock: _Link | None = None
    # transfer address -> connection, least recently used first (``MAX_TRANSFER_CONNECTIONS``)
    self._connections: collections.OrderedDict = collections.OrderedDict()
    self._busy = threading.Lock()  # a lookup or a fetch uses the connection
    self._round_trips: collections.deque = collections.deque(maxlen=5)  # lookups', seconds

  @property
  def available(self) -> bool:
    return self.breaker.available

  @property
  def round_trip_s(self) -> float | None:
    """The median of the last answered lookups' round trips (a few dozen bytes each way:
    the link's latency and the peer's answer), or None before one."""
    trips = sorted(self._round_trips)
    return trips[len(trips) // 2] if trips else None

  def expect(self, payload_shape, dtype, window_shape=None) -> None:
    """Sizes the blocks frames this client reads: a fetch's answer holds exactly its blocks
    (``_layout``; with ``window_shape``, a fetch of the window group's holds exactly their
    window KV), and the largest frame it reads past (an answer to an earlier request) is
    one fetch's blocks inline, else an answer header. Set before the first fetch
    (``RemoteTier`` does); a change re-makes the connection."""
    itemsize = np.dtype(pages_lib.bits_dtype(dtype)).itemsize
    block = int(np.prod(payload_shape)) * itemsize
    window = int(np.prod(window_shape)) * itemsize if window_shape is not None else 0
    most = MAX_HEADER_BYTES
    if self.transport == "inline":
      most = max(most, MAX_FETCH_BLOCKS * max(block, window) + security.Seal.OVERHEAD)
    if (most, block, window) != (self._max_frame_bytes, self._block_bytes, self._window_bytes):
      self._max_frame_bytes, self._block_bytes, self._window_bytes = most, block, window
      self._window_shape = None if window_shape is None else tuple(window_shape)
      self._close()

  def _layout(self, request) -> _Layout:
    """What an answer to ``request`` may hold: inline blocks as one frame of exactly the
    blocks asked for (its tags one a ``CHUNK_BYTES`` piece, and the header's), or sealed
    as one frame a piece, each exactly its piece and its seal; no blocks frame otherwise."""
    tag, data = security.Seal.TAG_BYTES, ()
    if isinstance(request, FetchBlocks) and request.transport == "inline":
      block = self._window_bytes if request.group else self._block_bytes
      pieces = piece_sizes(len(request.keys) * block)
      if request.sealed:
        data = tuple(p + security.Seal.OVERHEAD for p in pieces)
      else:
        data, tag = (sum(pieces),), tag * (1 + len(pieces))
    most_pieces = len(piece_sizes(MAX_FETCH_BLOCKS * max(self._block_bytes,
                                                         self._window_bytes)))
    return _Layout(tag_bytes=tag, data=data, other_frame_bytes=self._max_frame_bytes,
                   other_frames=3 + most_pieces)

  def answer_bytes_most(self, blocks: int, group: int = 0) -> int:
    """The most bytes an answer to a fetch of ``blocks`` blocks (``group`` 1: their window
    KV) makes this client hold, as ``expect`` sized them: its frames at their caps (a
    nonce, a header, tags, the blocks as asked, sealed ones with their seals), what its
    connection reads ahead, and the blocks opened from their seal."""
    layout = self._layout(FetchBlocks(
        nonce="n", fingerprint="", keys=(bytes(32),) * blocks, token="t",
        transport=self.transport, sealed=self.encrypt, wait_ms=0, group=group))
    opened = blocks * (self._window_bytes if group else self._block_bytes) if self.encrypt else 0
    return (MAX_NONCE_BYTES + MAX_HEADER_BYTES + layout.tag_bytes + sum(layout.data)
            + 2 * _Link.READ_AHEAD_BYTES + opened)

  def _failed(self, reason: Failure, close: bool = True) -> Failure:
    self.failures_by_reason[reason.value] += 1
    if close:
      self.breaker.record(False)
      self._close()
    return reason

  def _close(self) -> None:
    if self._sock is not None:
      self._sock.close()
    self._sock = None
    self._challenge = ""

  def _exchange(self, request, deadline: float) -> tuple[Any, list]:
    """Sends one request and waits (until ``deadline``) for the answer to it: the answer
    its kind expects (``Refusal`` raises ``RemoteError``), and its data frames (opened,
    when sealed). Each frame is checked against what the answer may hold before it is read
    (``_Link.answer``); with a key, the answer's tag is checked before anything of it is
    parsed; an answer that breaks the protocol raises ``RemoteError("malformed")``."""
    body = request.encode()
    auth = b""
    if self._secret is not None and not isinstance(request, Hello):
      self._number += 1
      signed = f"{self._challenge} {self._number}"
      auth = f"{signed} {security.challenge_mac(self._secret, signed, body)}".encode("ascii")
    nonce = request.nonce.encode()
    link = self._sock
    link.send_multipart([nonce, body, auth], deadline=deadline)
    sealed = isinstance(request, FetchBlocks) and request.sealed
    layout = self._layout(request)
    while True:
      frames = link.answer(nonce, layout, deadline)
      if frames is None:  # to an earlier request, or junk: read past, unkept
        self.stale_answers += 1
        continue
      header, tag, data = frames[1], frames[2], frames[3:]
      if self._seal is not None:
        data = self._verified(request.nonce, header, tag, data, sealed)
      try:
        answer = decode(header, ANSWERS)
      except WireError as e:
        raise RemoteError("malformed", f"the peer's answer breaks the protocol: {e}") from None
      if answer.nonce != request.nonce:
        raise RemoteError("malformed", "the answer's nonce is not its frame's")
      if isinstance(answer, Refusal):
        kind = Unauthenticated if answer.error.startswith(UNAUTHENTICATED) else RemoteError
        raise kind("refused", answer.error[:200])
      if not isinstance(answer, ANSWER_TO[type(request)]):
        raise RemoteError("malformed", f"a {type(answer).__name__} answering a "
                          f"{type(request).__name__}")
      if data and not (isinstance(answer, Offer) and request.transport == "inline"):
        raise RemoteError("malformed", f"a {type(answer).__name__} with a data frame")
      return answer, data

  def _verified(self, nonce: str, header: bytes, tag: bytes, data: list, sealed: bool) -> list:
    """``data`` as one frame once the answer's tags prove header and data (sealed pieces:
    opened into one buffer), from the peer with this key, for this request."""
    if not tag:
      raise RemoteError("mode", "the peer's answer is not signed: it has no deployment key")
    size = security.Seal.TAG_BYTES
    try:
      self._seal.check(head_aad(nonce, header), b"", tag[:size])
      if not data:
        if len(tag) != size:
          raise security.SealError("tags of blocks that are not there")
        return []
      if sealed:
        if any(len(d) < security.Seal.OVERHEAD for d in data):
          raise security.SealError("a sealed piece shorter than its nonce and tag")
        aads = chunk_aads(nonce, header, len(data))
        out = np.empty(sum(len(d) for d in data) - len(data) * security.Seal.OVERHEAD, np.uint8)
        at = 0
        for aad, piece in zip(aads, data):
          plain = self._seal.open(aad, piece)
          out[at:at + len(plain)] = np.frombuffer(plain, np.uint8)
          at += len(plain)
        return [memoryview(out)]
      chunks = split_chunks(data[0]) if len(data) == 1 else []
      if not chunks or len(tag) != size * (1 + len(chunks)):
        raise RemoteError("malformed", f"{len(data)} data frames and {len(tag)} bytes of "
                          f"tags: expected 1 frame and {size} bytes a {CHUNK_BYTES}-byte piece")
      for i, (aad, chunk) in enumerate(zip(chunk_aads(nonce, header, len(chunks)), chunks)):
        self._seal.check(aad, chunk, tag[size * (i + 1):size * (i + 2)])
      return data
    except security.SealError as e:
      raise RemoteError("mac", f"the peer's answer is not signed with this deployment key, "
                        f"or was changed on the way ({e})") from None

  def _connect(self, deadline: float) -> None:
    if self._sock is None or self._sock.closed:
      self._sock = _Link(self.address, self.host, self.port, self._token, deadline)
    welcome, _ = self._exchange(Hello(nonce=new_nonce()), deadline)
    self.hellos += 1
    self._challenge = welcome.challenge
    self._challenge_until = time.monotonic() + welcome.valid_ms / 1000

  def _call(self, request: Lookup | FetchBlocks, deadline: float) -> tuple[Any, list]:
    """``request``'s answer; a connection gets its challenge first, again once it expires,
    and once more when the peer no longer takes it (a re-made connection)."""
    for attempt in range(2):
      if (self._sock is None or self._sock.closed or not self._challenge
          or time.monotonic() >= self._challenge_until):
        self._connect(deadline)
      try:
        return self._exchange(request, deadline)
      except Unauthenticated:
        if attempt or self._secret is None:
          raise
        self._challenge = ""
    raise AssertionError("unreachable")

  def lookup(self, keys: list[bytes]) -> int:
    """How many leading ``keys`` the peer holds, at most ``len(keys)`` (0 when it cannot
    be asked, or its answer is wrong: counted in ``failures_by_reason``). Safe beside a
    ``fetch`` on another thread (the manager asks on its lookup thread): one at a time
    uses the connection."""
    return self.lookup_windows(keys, windows=False)[0]

  def lookup_windows(self, keys: list[bytes], windows: bool = True) -> tuple[int, tuple]:
    """``lookup``, and (with ``windows``) the indices of the blocks among the last two
    windows' of the prefix held whose window KV the peer holds too (``Have.windows``;
    ``window`` blocks a window, from the model's ``sliding_window``)."""
    wait_s = min(self.deadline_s, 1.0)
    if not self._busy.acquire(timeout=wait_s):
      self._failed(Failure.DEADLINE, close=False)  # a fetch held the connection throughout
      return 0, ()
    try:
      return self._lookup(keys, time.monotonic() + wait_s, windows)
    finally:
      self._busy.release()

  def _lookup(self, keys: list[bytes], deadline: float, windows: bool) -> tuple[int, tuple]:
    keys = list(keys[:MAX_KEYS])  # a prefix of a prefix: still the question asked
    if not keys:
      return 0, ()
    if not self.available:
      self._failed(Failure.BREAKER, close=False)
      return 0, ()
    try:
      t0 = time.perf_counter()
      have, _ = self._call(Lookup(nonce=new_nonce(), fingerprint=self.fingerprint,
                                  keys=tuple(keys), windows=windows), deadline)
      self._round_trips.append(time.perf_counter() - t0)  # (a connect's first: the median)
      if have.have > len(keys):
        raise RemoteError("malformed", f"holds {have.have} of the {len(keys)} keys asked about")
      if have.windows and (not windows or have.windows[-1] >= have.have):
        raise RemoteError("malformed", f"window blocks {list(have.windows[:8])} of a prefix of "
                          f"{have.have} blocks{'' if windows else ', not asked for'}")
      self.breaker.record(True)
      return have.have, have.windows
    except InvariantError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (a peer never breaks admission)
      self._failed(_reason(e))
      return 0, ()

  def fetch(self, keys: list[bytes], payload_shape, dtype, deadline: float,
            group: int = 0) -> np.ndarray:
    """The blocks' raw bits ``[blocks, *payload_shape]`` (at most ``MAX_FETCH_BLOCKS``;
    ``group`` 1: their window KV, of the ``window_shape`` that ``expect`` was given),
    verified; raises ``RemoteError`` (counted in ``failures_by_reason``), nothing else."""
    if not self._busy.acquire(timeout=max(0.0, deadline - time.monotonic())):
      self._failed(Failure.DEADLINE, close=False)  # a lookup held the connection past it
      raise RemoteError("deadline", f"peer {self.address}'s connection stayed busy")
    try:
      return self._fetch(keys, payload_shape, dtype, deadline, group)
    finally:
      self._busy.release()

  def _fetch(self, keys: list[bytes], payload_shape, dtype, deadline: float,
             group: int = 0) -> np.ndarray:
    if len(keys) > MAX_FETCH_BLOCKS:
      raise InputError(f"fetch of {len(keys)} blocks: at most {MAX_FETCH_BLOCKS} a fetch; "
                       "split them (RemoteTier does).")
    if not self.available:
      self._failed(Failure.BREAKER, close=False)
      raise RemoteError("breaker", f"peer {self.address} is cooling down")
    if group and tuple(payload_shape) != self._window_shape:
      raise InputError(f"a window fetch of shape {tuple(payload_shape)}: this client expects "
                       f"{self._window_shape} (expect(..., window_shape=) first).")
    try:
      if not group:
        self.expect(payload_shape, dtype, self._window_shape)
      bits = np.dtype(pages_lib.bits_dtype(dtype))
      request = FetchBlocks(nonce=new_nonce(), fingerprint=self.fingerprint, keys=tuple(keys),
                            token=new_nonce(), transport=self.transport, sealed=self.encrypt,
                            wait_ms=max(0, int((deadline - time.monotonic()) * 1000)),
                            group=group)
      offer, data = self._call(request, deadline)
      want_shape = (len(keys), *payload_shape)
      if offer.token != request.token:
        raise RemoteError("token", "the answer is to another request")
      if offer.keys != request.keys:
        raise RemoteError("key", "the answer names other blocks")
      if offer.dtype != bits.name or offer.shape != want_shape:
        raise RemoteError("shape", f"offered {offer.dtype}{list(offer.shape)}, expected "
                          f"{bits.name}{list(want_shape)}")
      if offer.sealed != self.encrypt:
        raise RemoteError("mode", f"the blocks are {'' if offer.sealed else 'not '}sealed; "
                          f"this client asked for {'' if self.encrypt else 'un'}sealed ones")
      if self._seal is None and offer.crc32c is None:
        raise RemoteError("mode", "the offer carries no CRC-32C (a keyed peer's answer)")
      if self.transport == "inline":
        stack = _inline(data, want_shape, bits)
      else:
        stack = self._pull(offer, want_shape, bits, deadline)
      if self._seal is None and stack_digest(stack) != offer.crc32c:
        raise RemoteError("checksum", "the blocks do not match their CRC-32C")
      self.breaker.record(True)
      return stack
    except InvariantError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (a RemoteError, and only that)
      reason = _reason(e)
      self._failed(reason, close=reason in _CLOSING)
      if isinstance(e, RemoteError):
        raise
      raise RemoteError(reason.value, f"{type(e).__name__}: {e}") from None

  def _pull(self, offer, shape, bits, deadline: float) -> np.ndarray:
    """The blocks the offer names, pulled with ``jax.experimental.transfer``; with a key,
    proven by the offer's ``data_tag`` or opened from their seal.

    The pull waits on a thread, joined until the deadline. The library takes the deadline
    too, but does not always keep it (a pull never served waits on, on CPU): a late pull's
    connection is broken, which ends the pull and so the thread, and forgotten."""
    if offer.transfer_id is None or offer.transfer_address is None:
      raise RemoteError("malformed", "the offer names no transfer to pull")
    if self._seal is not None and not offer.sealed and offer.data_tag is None:
      raise RemoteError("mode", "the offer carries no tag over the blocks it offers")
    addr = _transfer_address(offer.transfer_address, self.host)
    device = jax.local_devices()[0]
    nbytes = int(np.prod(shape)) * bits.itemsize
    pulled_shape, pulled_dtype = ((nbytes + security.Seal.OVERHEAD,), np.dtype(np.uint8)) if (
        offer.sealed) else (tuple(shape), bits)
    conn = self._connections.pop(addr, None)
    if conn is None:
      conn = _transfer_server(device).connect(addr)  # lazy: no wait on the network
    self._connections[addr] = conn
    while len(self._connections) > MAX_TRANSFER_CONNECTIONS:
      self._connections.popitem(last=False)
    wait_s = max(0.0, deadline - time.monotonic())
    expires = datetime.datetime.now() + datetime.timedelta(seconds=wait_s)
    result: dict = {}

    def pull():
      try:
        out = conn.pull(offer.transfer_id, [jax.ShapeDtypeStruct(
            pulled_shape, jnp.dtype(pulled_dtype),
            sharding=jax.sharding.SingleDeviceSharding(device))], timeout=expires)
        result["value"] = np.asarray(out[0])
      except Exception as e:  # pylint: disable=broad-except  (reported below)
        result["error"] = e

    worker = threading.Thread(target=pull, daemon=True, name="jaxkv-pull")
    worker.start()
    worker.join(wait_s)
    if worker.is_alive():
      self._connections.pop(addr, None)
      poison = getattr(conn, "_poison_connection", None)  # fails the pull: the thread ends
      if poison is not None:
        poison()
      raise RemoteError("deadline", "the pull did not finish in time")
    if "error" in result:
      raise RemoteError("pull", str(result["error"]))
    value = result["value"]
    if value.dtype != pulled_dtype or list(value.shape) != list(pulled_shape):
      raise RemoteError("shape", f"pulled {value.dtype}{list(value.shape)}")
    if self._seal is None:
      return value
    try:
      if offer.sealed:
        plain = self._seal.open(pull_aad(offer.nonce), bytes_of(value))
        return np.frombuffer(plain, dtype=bits).reshape(shape)
      self._seal.check(pull_aad(offer.nonce), bytes_of(value), bytes.fromhex(offer.data_tag))
      return value
    except security.SealError as e:
      raise RemoteError("mac", f"the pulled blocks do not verify ({e})") from None



# Failures after which the connection is re-made and the breaker told: the peer, or the
# path to it, is not answering as it should. A wrong block (key, shape, checksum) is the
# peer's copy's problem, not the connection's.
_CLOSING = frozenset({Failure.DEADLINE, Failure.CLOSED, Failure.REFUSED, Failure.PULL,
                      Failure.MAC, Failure.MODE, Failure.MALFORMED, Failure.IO,
                      Failure.REMOTE})


def _reason(e: BaseException) -> Failure:
  """The ``Failure`` an exception from a lookup or fetch stands for."""
  if isinstance(e, zmq.ZMQError):
    return Failure.IO
  if isinstance(e, WireError):
    return Failure.MALFORMED
  return Failure.of(e, Failure.REMOTE)
