"""REMOTE tier: blocks held by another job, asked for and carried over TCP in ZeroMQ's framing.

Two parts, in two processes:
- ``BlockServer`` runs in the job that holds the blocks (a serving peer with spare memory).
  It listens on a ZeroMQ STREAM socket and answers on the serving job's own thread, in
  ``serve``/``poll``: a request is only read when that thread is between steps, so
  gathering blocks never races the engine's donated pools, and the server needs no thread.
- ``RemoteClient`` runs in the job that wants them (``TierConfig.remote_peers``). It asks
  how long a prefix of block keys the peer holds (``lookup``), then for the blocks
  (``fetch``): one round trip, the blocks travelling in the answer itself as one zero-copy
  frame after the header. ``transport="transfer"`` instead has the answer carry a
  ``jax.experimental.transfer`` offer that the client pulls (device to device where that
  library has a direct path; on CPU it is slower than the inline frame).

The wire: every message either side sends is one frozen dataclass of this module
(``Hello``, ``Lookup``, ``FetchBlocks``; ``Welcome``, ``Have``, ``Offer``, ``Refusal``), built
and checked in one place ("the wire" below). Each field has a rule, enforced whether the
message was built here or decoded off the socket (``decode``), so neither side handles a
dict, and a peer's malformed message is a ``WireError`` naming the field and the rule.

Frames, read by hand (ZMTP, below): messages travel as ZeroMQ's wire protocol frames them
(ZMTP 3.1, so a ZeroMQ DEALER or ROUTER can talk to either side), but neither side reads
them through a ZeroMQ socket. ZeroMQ delivers a message only whole and caps the size of a
frame, never the number of frames of a message: its receive high-water mark counts whole
messages, so a socket queues a message of any number of frames, however large, before its
reader sees the first. Instead each side reads a frame's header before its bytes and
keeps only frames that can belong to what it waits for:
- the server reads raw bytes off its STREAM socket, which queues at most ``_RCVHWM_CHUNKS``
  chunks of ``_IN_BATCH_BYTES`` a connection between polls (``BlockServer.queued_bytes_most``,
  (64 + 1) x 8 KiB = 520 KiB), then TCP holds the sender back. A request is three frames,
  each capped (``_REQUEST_FRAME_BYTES``: 64 B, ``_MAX_REQUEST_BYTES`` = 1.07 MiB, 160 B); a
  frame over its cap or past the third is dropped as its bytes arrive (counted,
  ``counts["frames_dropped"]``; its message is refused once it ends), one over
  ``_MAX_REQUEST_BYTES`` closes the connection. Requests read but not yet answered are
  held up to ``max_pending_bytes_per_peer`` (2.13 MiB) a connection, more are shed. So a
  connection costs the server at most ``queued_bytes_most`` + ``held_bytes_most`` (pending
  + the caps of one request being read + two chunks and a command: 3.2 MiB), whatever it
  sends, plus what the kernel buffers for its socket (``tcp_rmem``).
- the client reads its one TCP connection itself: before reading a frame of an answer it
  compares the frame's size with what the answer to its request can hold (a nonce of 64 B,
  a header of ``_MAX_HEADER_BYTES``, its tags, then exactly the blocks it asked for: one
  frame of ``blocks x block bytes``, or when sealed one frame per sealed piece), and stops
  at the first frame that cannot belong (a miss, the connection closed): it holds at most
  ``RemoteClient.answer_bytes_most(blocks)``, before any tag is checked.

Authentication (``jaxkv.security``), when the serving cache has a deployment key:
- **Connections.** The server takes a connection only after a ZMTP PLAIN handshake whose
  password is a token derived from the key (``_handshake_token``), compared in constant
  time; until it passes, it reads nothing of the connection but the handshake (a greeting
  of 64 bytes, commands of ``_MAX_COMMAND_BYTES`` at most; one not done in
  ``handshake_timeout_s`` is closed). What it stops: a client off the path without the key
  can no longer open a connection whose requests are read (a wrong token is refused in the
  handshake and counted, ``BlockServer.handshakes_refused``; the client sees the refusal
  at once: a counted "refused" miss, not a wait for its deadline). What it does not: PLAIN
  is not encrypted, so whoever reads the traffic learns the token and can connect and send
  requests: an attacker on the path, who can cut the traffic anyway. Against them the
  checks below and the bounds above stay the second line. (CURVE would hide the token, but
  encrypts every byte of the data path too.) A keyless server has no handshake but ZMTP's
  NULL: anyone who reaches it connects; it is loopback-only unless ``allow_insecure``.
- **Requests.** A client asks once per connection for a challenge (``Hello``: the only
  request answered without the key) and sends ``HMAC(key, challenge, number, request)``
  with each request, numbered by a counter that only grows; the server answers only those.
  Others get an "unauthenticated" refusal (counted in ``BlockServer.refused``) and no
  answer to what they asked: not which blocks the server holds, nor anything of them.
  (They do learn that it holds a key: the handshake asks for a token, a ``Welcome``
  carries a tag, and the refusal says why.) The challenge is *stateless*:
  ``<epoch>-<salt>-HMAC(server secret, connection id, epoch, salt)``, a server-local random
  secret and a random salt per hello, so the server keeps nothing per connection before a
  request is authenticated and no flood of hellos can push a peer's challenge out. A
  challenge holds for the epoch it was made in and the next (``challenge_epoch_s``, 60 s:
  one more hello round trip per connection a minute). Replays: for each challenge the
  server remembers the highest number it answered and refuses a request numbered at or
  below it ("replay", counted), so a request recorded on the path is answered once, never
  again, however many requests came after it (on another connection, or once its
  challenge expired, it is unauthenticated). Each hello's challenge is its own (the salt),
  so clients sharing a connection (through a proxy) number their requests apart. That is
  one number per challenge in use, at most ``max_replay_windows`` of them (a challenge
  expires with its two epochs); beyond, a request under a new challenge is refused
  ("busy", counted) rather than an old challenge's number forgotten.
- **Answers.** Every answer carries a ``Seal("remote-answer")`` tag over its header *and*
  its data frame, bound to the request's nonce (the purpose names the direction: requests
  are HMACs under the raw key, answers GCM tags under a key derived for answers, so
  neither verifies as the other). A client that asked for sealed blocks
  (``FetchBlocks.sealed``, ``TierConfig.encryption``) gets them encrypted (AES-256-GCM,
  its associated data the header) and refuses plaintext ones. A client with the key
  checks the tag *before* it parses a byte, so a forger on the path, or a peer without
  the key, costs a counted miss (``Failure.MAC``/``MODE``), never a parse.
Without a key the server answers anyone (it refuses to start on a non-loopback address
unless told ``allow_insecure``, and says so once either way), and answers carry a CRC-32C of
the blocks: it catches damage, not forgery (CRC-32C is linear: whoever can change the
bytes can fix it up).

What the reader never trusts: every answer names its block keys, dtype and shape; the
reader checks keys, dtype, shape and frame sizes before looking at the bytes and the tag
or CRC, and rejects the whole fetch on any mismatch. Any answer that breaks the protocol
is a counted miss (``RemoteClient.failures_by_reason``), never an exception. Answers to an
earlier request are told apart by their nonce and read past without being kept. Every
wait has the reader's deadline; a late, refused or broken fetch is a miss and the request
recomputes. A peer that keeps failing trips a circuit breaker and is not asked again until
its cool-down has passed.

What the server never owes: a ``poll`` answers at most ``max_messages_per_poll``
requests, no connection more than ``max_messages_per_peer`` of them (its others wait for
the next poll), stops reading ``poll_overrun_s`` after its timeout, and stops once the
blocks it answered with pass ``max_answer_bytes_per_poll`` (a fetch is answered whole, so
a poll overruns that by at most one fetch: up to ``_MAX_FETCH_BLOCKS`` blocks); answers
queue for a connection up to its send high-water mark (``4 x max_messages_per_peer``
largest answers), beyond which the connection is closed; transfer offers are bounded in
number and bytes and expire (``offer_ttl_s``, or the client's own wait, whichever is
shorter).

What the client never owes: a transfer offer only ever makes it connect to the peer's own
host (the offer names the port; another host is refused as malformed), it keeps at most
``_MAX_TRANSFER_CONNECTIONS`` of those connections, and a pull not done by the deadline
is abandoned and its connection broken, so the thread that waited on it ends.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import hmac
import json
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import zmq

from jaxkv import buckets
from jaxkv.worker import pages as pages_lib
from jaxkv import security
from jaxkv.config import REMOTE_TRANSPORTS as TRANSPORTS
from jaxkv.distributed import to_host
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.base import Breaker, Failure, Fetch, FetchOutcome
from jaxkv.errors import InputError, InvariantError

PROTOCOL = 6  # 6: requests numbered (replays refused by number); frames read by hand
_MAX_KEYS = 16384  # block keys one lookup asks about (256k tokens at 16 a page)
_MAX_FETCH_BLOCKS = 512  # blocks one fetch brings (``RemoteTier`` splits longer runs)
# A request is block keys only: 64 hex digits, quotes and a comma each, and a few fields.
_MAX_REQUEST_BYTES = _MAX_KEYS * 68 + 4096
_MAX_HELLO_BYTES = 1024  # the one request read without the key is small
_MAX_NONCE_BYTES = 64  # a nonce frame (``_NONCE``'s rule)
# "<epoch>-<8 hex>-<32 hex> <number> <64 hex>": a challenge, a request's number, its MAC.
_MAX_AUTH_BYTES = 160
_REQUEST_FRAME_BYTES = (_MAX_NONCE_BYTES, _MAX_REQUEST_BYTES, _MAX_AUTH_BYTES)
# An answer's header names at most one fetch's keys (an offer repeats them).
_MAX_HEADER_BYTES = 64 << 10
_KEYLESS_FIX = ("set a deployment key on every job (--deployment_key_file or "
                "$JAXKV_DEPLOYMENT_KEY_FILE)")
_MAX_TRANSFER_CONNECTIONS = 4  # a client's transfer connections (to its one peer's host)
_HANDSHAKE_USER = b"jaxkv"  # the PLAIN user name of a keyed connection; the token is its password
_HANDSHAKE_FIX = ("the two jobs do not hold the same deployment key, or only one of them "
                  "has one")


class RemoteError(RuntimeError):
  """A remote fetch that cannot be used; ``reason`` says how (a ``base.Failure``)."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = Failure(reason)


class _Unauthenticated(RemoteError):
  """The peer did not accept this connection's challenge (expired, or the connection was
  re-made under another routing id): a fresh hello may fix it."""


def _digest(stack) -> int:
  return google_crc32c.value(np.ascontiguousarray(stack).reshape(-1).view(np.uint8))


def _bytes_of(stack: np.ndarray) -> memoryview:
  return memoryview(np.ascontiguousarray(stack)).cast("B")


def _nonce() -> str:
  return secrets.token_hex(16)


# What an answer's tags and seals are bound to: each starts with its role and carries the
# request's nonce. The blocks frame is tagged (or sealed) in ``_CHUNK_BYTES`` pieces, each
# bound to the header (its digest), its index and the count: ``Seal`` joins what it proves
# into one buffer, and a whole answer's join is a fresh multi-MiB buffer (page faults) on
# every fetch, while a piece's stays in cache.
_CHUNK_BYTES = 256 << 10


def _head_aad(nonce: str, header: bytes) -> bytes:
  return b"head\x00" + nonce.encode() + b"\x00" + header


def _chunk_aads(nonce: str, header: bytes, count: int) -> list[bytes]:
  base = b"data\x00" + nonce.encode() + b"\x00" + hashlib.sha256(header).digest()
  return [base + i.to_bytes(4, "big") + count.to_bytes(4, "big") for i in range(count)]


def _chunks(data) -> list[memoryview]:
  data = memoryview(data).cast("B")
  return [data[i:i + _CHUNK_BYTES] for i in range(0, len(data), _CHUNK_BYTES)] or [data]


def _piece_sizes(nbytes: int) -> list[int]:
  """The sizes of the ``_CHUNK_BYTES`` pieces ``nbytes`` of blocks are tagged or sealed in
  (``_chunks``'s)."""
  return [min(_CHUNK_BYTES, nbytes - at) for at in range(0, nbytes, _CHUNK_BYTES)] or [0]


def _pull_aad(nonce: str) -> bytes:
  return b"pull\x00" + nonce.encode()


def _handshake_token(key: bytes) -> bytes:
  """The PLAIN password of a keyed connection. It crosses the network in clear, so it is a
  derivation of the key made for this use alone: knowing it proves nothing else."""
  return hmac.new(key, b"jaxkv-zmq-handshake", hashlib.sha256).hexdigest().encode()


# ---- ZMTP: the framing under the wire, read by hand ---------------------------------------------
# ZMTP 3.1 (ZeroMQ RFC 23) with its NULL and PLAIN mechanisms (RFC 23, RFC 24): a greeting
# of 64 bytes each way (signature, version, mechanism, role), handshake commands, then
# frames: a flags byte (``_MORE``: another frame of the message follows; ``_LONG``: an
# 8-byte size follows, else a 1-byte one; ``_COMMAND``), the size, the bytes.
#
#   client (DEALER)                              server (ROUTER)
#   greeting("PLAIN")                       <->  greeting("PLAIN", as server)
#   HELLO(user, token)                      ->   WELCOME, or ERROR("400") and closed
#   INITIATE(Socket-Type)                   ->   READY(Socket-Type)
#   (NULL, without a key: READY each way)
#   [nonce, message, auth]                  ->   [nonce, message, tags, *blocks]
_MORE, _LONG, _COMMAND = 1, 2, 4
_GREETING_BYTES = 64
_MAX_COMMAND_BYTES = 4096  # a handshake's command (or a peer's ping) is small
_ZERO_COPY_BYTES = 64 << 10  # frames this large are sent from their own buffer, not copied
_IN_BATCH_BYTES = 8192  # libzmq reads a STREAM connection in chunks of at most this
_RCVHWM_CHUNKS = 64  # chunks a STREAM connection's queue holds before TCP holds the sender


def _greeting(mechanism: bytes, as_server: bool) -> bytes:
  """This side's greeting: signature, version 3.1, mechanism, role, filler."""
  return (b"\xff" + (1).to_bytes(8, "big") + b"\x7f\x03\x01" + mechanism.ljust(20, b"\x00")
          + bytes([as_server]) + bytes(31))


def _greeting_mechanism(greeting) -> bytes | None:
  """The mechanism a peer's greeting names; None when it is no ZMTP 3 greeting."""
  if greeting[0] != 0xFF or not greeting[9] & 1 or greeting[10] < 3:
    return None
  return bytes(greeting[12:32]).rstrip(b"\x00")


def _head(size: int, flags: int = 0) -> bytes:
  """A frame's header: its flags and its size (one byte, or eight for a long frame)."""
  if size > 255:
    return bytes([flags | _LONG]) + size.to_bytes(8, "big")
  return bytes([flags, size])


def _parse_head(buf, at: int) -> tuple[int, int, int] | None:
  """``(flags, size, header bytes)`` of the frame that starts at ``buf[at]``; None until
  all of its header is there."""
  if len(buf) - at < 2:
    return None
  flags = buf[at]
  if not flags & _LONG:
    return flags, buf[at + 1], 2
  if len(buf) - at < 9:
    return None
  return flags, int.from_bytes(buf[at + 1:at + 9], "big"), 9


def _command(name: bytes, body: bytes = b"") -> bytes:
  """A command frame, header and all."""
  data = bytes([len(name)]) + name + body
  return _head(len(data), _COMMAND) + data


def _command_parts(command) -> tuple[bytes, bytes]:
  """``(name, body)`` of a command frame's bytes."""
  n = command[0] if command else 0
  return bytes(command[1:1 + n]), bytes(command[1 + n:])


def _socket_type(kind: bytes) -> bytes:
  """The metadata of a READY or INITIATE: the socket type this side plays."""
  return bytes([11]) + b"Socket-Type" + len(kind).to_bytes(4, "big") + kind


def _plain_credentials(body: bytes) -> tuple[bytes, bytes] | None:
  """``(user, password)`` of a PLAIN HELLO's body; None when it is not one."""
  if not body or len(body) < 1 + body[0] + 1:
    return None
  user, rest = body[1:1 + body[0]], body[1 + body[0]:]
  if len(rest) != 1 + rest[0]:
    return None
  return user, rest[1:]


def _encoded(frames) -> list:
  """``frames``, one message, as ZMTP bytes in as few pieces as a zero-copy send allows:
  the headers and small frames joined, each large frame a piece of its own (not copied).
  No piece is empty (an empty send closes a STREAM connection)."""
  out, small = [], bytearray()
  for i, frame in enumerate(frames):
    frame = memoryview(frame).cast("B")
    small += _head(len(frame), _MORE if i < len(frames) - 1 else 0)
    if len(frame) < _ZERO_COPY_BYTES:
      small += frame
    else:
      out.append(bytes(small))
      small = bytearray()
      out.append(frame)
  if small:
    out.append(bytes(small))
  return out


# ---- the wire: every message, its fields and their rules, in one place --------------------------
# A request travels as three frames: its nonce, the message (one JSON object,
# ``{"op": <kind>, "protocol": PROTOCOL, <fields>}``) and its authentication
# (``"<challenge> <number> <HMAC hex>"``, empty for a hello or without a key). An answer travels as
# its nonce, the message, its tags (``Seal`` tags: the header's, then one per
# ``_CHUNK_BYTES`` piece of the blocks; empty without a key) and, for an inline ``Offer``,
# the block bits: one frame, or when sealed one frame per sealed piece. The nonce frames
# let either side refuse or drop a message without parsing it. Client and server build and
# read messages only through these classes: a value that breaks a field's rule raises
# ``WireError`` on either side, whether it was built here or came off the wire.
#
#   client                                   server
#   Hello(nonce)                        ->   Welcome(nonce, challenge, valid_ms)
#   Lookup(nonce, fingerprint, keys)    ->   Have(nonce, have)
#   FetchBlocks(nonce, fingerprint,     ->   Offer(nonce, keys, dtype, shape, token, sealed,
#       keys, token, transport,                    crc32c | data_tag, [expires_ms,
#       sealed, wait_ms)                           transfer_id, transfer_address])
#   (any request)                       ->   Refusal(nonce, error)
#
# An answer repeats its request's ``nonce``: a client drops answers to its earlier requests.


class WireError(ValueError):
  """A message that breaks the protocol; ``nonce`` is the sender's, when it could be read
  (so that even a malformed request gets a refusal its sender recognises)."""

  def __init__(self, detail: str, nonce: str = ""):
    super().__init__(detail)
    self.nonce = nonce


@dataclasses.dataclass(frozen=True)
class _Rule:
  """What a field's value must be (``what``, for errors), and its JSON form."""

  what: str
  holds: Callable[[Any], bool]
  to_json: Callable[[Any], Any] = lambda v: v
  from_json: Callable[[Any], Any] = lambda v: v

  def optional(self) -> "_Rule":
    return _Rule(f"{self.what}, or null", lambda v: v is None or self.holds(v),
                 lambda v: None if v is None else self.to_json(v),
                 lambda v: None if v is None else self.from_json(v))


def _is_int(v) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _keys_rule(most: int) -> _Rule:
  return _Rule(f"a list of at most {most} 32-byte block keys (hex on the wire)",
               lambda v: isinstance(v, tuple) and len(v) <= most and all(
                   isinstance(k, bytes) and len(k) == 32 for k in v),
               to_json=lambda v: [k.hex() for k in v],
               from_json=lambda v: tuple(bytes.fromhex(k) for k in v))


# A nonce is empty only in a refusal of a request whose own nonce could not be read.
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{0,64}")
_NONCE = _Rule("at most 64 ASCII letters, digits, '-' or '_'",
               lambda v: isinstance(v, str) and _TOKEN_RE.fullmatch(v) is not None)
_TEXT = _Rule("a string", lambda v: isinstance(v, str))
_COUNT = _Rule("an integer >= 0", lambda v: _is_int(v) and v >= 0)
_BOOL = _Rule("true or false", lambda v: isinstance(v, bool))
_TAG = _Rule(f"{2 * security.Seal.TAG_BYTES} hex digits",
             lambda v: isinstance(v, str) and len(v) == 2 * security.Seal.TAG_BYTES
             and re.fullmatch(r"[0-9a-f]*", v) is not None)
_SHAPE = _Rule("a list of integers >= 0",
               lambda v: isinstance(v, tuple) and all(_is_int(d) and d >= 0 for d in v),
               from_json=tuple)
_TRANSPORT = _Rule(f"one of {TRANSPORTS}", lambda v: v in TRANSPORTS)


def _field(rule: _Rule, default=dataclasses.MISSING):
  return dataclasses.field(default=default, metadata={"rule": rule})


class _Message:
  """What every message has: a kind (``OP``), a ``nonce``, a schema and its checks."""

  OP: ClassVar[str]

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if not f.metadata["rule"].holds(value):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise WireError(f"{type(self).__name__}.{f.name}={shown} must be "
                        f"{f.metadata['rule'].what}.", nonce=_readable_nonce(self.nonce))

  def encode(self) -> bytes:
    """The message as it travels (JSON, UTF-8)."""
    body = {f.name: f.metadata["rule"].to_json(getattr(self, f.name))
            for f in dataclasses.fields(self)}
    return json.dumps({"op": self.OP, "protocol": PROTOCOL, **body}).encode()


def _readable_nonce(nonce) -> str:
  return nonce if _NONCE.holds(nonce) else ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hello(_Message):
  """Client: asks for the challenge its requests' MACs cover (once per connection)."""

  OP: ClassVar[str] = "hello"
  nonce: str = _field(_NONCE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lookup(_Message):
  """Client: how long a prefix of ``keys`` does the peer hold (on one data shard)?"""

  OP: ClassVar[str] = "lookup"
  nonce: str = _field(_NONCE)
  fingerprint: str = _field(_TEXT)  # hex of the cache's model/layout fingerprint
  keys: tuple[bytes, ...] = _field(_keys_rule(_MAX_KEYS))


@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchBlocks(_Message):
  """Client: send these blocks (all of them, or a refusal), ``transport`` as asked,
  ``sealed`` (encrypted) when asked; the client waits ``wait_ms`` at most (a transfer
  offer expires then)."""

  OP: ClassVar[str] = "fetch"
  nonce: str = _field(_NONCE)
  fingerprint: str = _field(_TEXT)
  keys: tuple[bytes, ...] = _field(_keys_rule(_MAX_FETCH_BLOCKS))
  token: str = _field(_NONCE)  # repeated in the offer: binds it to this request
  transport: str = _field(_TRANSPORT)
  sealed: bool = _field(_BOOL)
  wait_ms: int = _field(_COUNT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Welcome(_Message):
  """Server, to ``Hello``: the challenge that this connection's request MACs cover, good
  for ``valid_ms`` at least."""

  OP: ClassVar[str] = "welcome"
  nonce: str = _field(_NONCE)
  challenge: str = _field(_NONCE)
  valid_ms: int = _field(_COUNT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Have(_Message):
  """Server, to ``Lookup``: how many leading keys it holds."""

  OP: ClassVar[str] = "have"
  nonce: str = _field(_NONCE)
  have: int = _field(_COUNT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offer(_Message):
  """Server, to ``FetchBlocks``: what it sends — ``keys``' raw bits ``dtype[shape]``
  (``[blocks, 2 * layers, kv_heads, page_size, head_dim]``). Inline, the bits follow as one
  frame; with the transfer transport, the client pulls ``transfer_id`` from
  ``transfer_address`` within ``expires_ms``. ``sealed``: the bits are encrypted. Proof of
  the bits without a key: ``crc32c`` (damage only); with one, the answer's tag (inline) or
  ``data_tag`` (a pull, unless sealed)."""

  OP: ClassVar[str] = "offer"
  nonce: str = _field(_NONCE)
  keys: tuple[bytes, ...] = _field(_keys_rule(_MAX_FETCH_BLOCKS))
  dtype: str = _field(_TEXT)
  shape: tuple[int, ...] = _field(_SHAPE)
  token: str = _field(_NONCE)
  sealed: bool = _field(_BOOL, False)
  crc32c: int | None = _field(_COUNT.optional(), None)
  data_tag: str | None = _field(_TAG.optional(), None)
  expires_ms: int | None = _field(_COUNT.optional(), None)
  transfer_id: int | None = _field(_COUNT.optional(), None)
  transfer_address: str | None = _field(_TEXT.optional(), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Refusal(_Message):
  """Server, to any request it will not or cannot answer: why."""

  OP: ClassVar[str] = "refusal"
  nonce: str = _field(_NONCE)
  error: str = _field(_TEXT)


REQUESTS = (Hello, Lookup, FetchBlocks)
ANSWERS = (Welcome, Have, Offer, Refusal)
_ANSWER_TO = {Hello: Welcome, Lookup: Have, FetchBlocks: Offer}
_UNAUTHENTICATED = "unauthenticated"


def decode(data: bytes, kinds: tuple[type, ...]):
  """The message ``data`` holds, one of ``kinds`` (``REQUESTS`` on the server, ``ANSWERS``
  on the client). Raises ``WireError`` naming what breaks the schema."""
  try:
    msg = json.loads(data)
  except (ValueError, UnicodeDecodeError, RecursionError) as e:
    raise WireError(f"a message must be a JSON object, this is not JSON "
                    f"({type(e).__name__}: {str(e)[:80]})") from None
  if not isinstance(msg, dict):
    raise WireError(f"a message must be a JSON object, not {type(msg).__name__}")
  nonce = _readable_nonce(msg.get("nonce"))
  if msg.get("protocol") != PROTOCOL:
    raise WireError(f"protocol {str(msg.get('protocol'))[:20]!r} is not {PROTOCOL} (this "
                    "side's); run the same jaxkv version on both", nonce)
  by_op = {k.OP: k for k in kinds}
  op = msg.get("op")
  kind = by_op.get(op) if isinstance(op, str) else None
  if kind is None:
    raise WireError(f"unknown op {str(op)[:40]!r}: expected one of {sorted(by_op)}", nonce)
  fields = {f.name: f for f in dataclasses.fields(kind)}
  extra = sorted(set(msg) - set(fields) - {"op", "protocol"})
  if extra:
    raise WireError(f"{kind.__name__} has no fields {extra[:8]}; its fields are "
                    f"{sorted(fields)}", nonce)
  values = {}
  for name, f in fields.items():
    if name not in msg:
      if f.default is dataclasses.MISSING:
        raise WireError(f"{kind.__name__} needs field {name!r}", nonce)
      continue
    try:
      values[name] = f.metadata["rule"].from_json(msg[name])
    except (TypeError, ValueError, AttributeError):
      raise WireError(f"{kind.__name__}.{name} must be {f.metadata['rule'].what}",
                      nonce) from None
  return kind(**values)


# ---- the serving side ---------------------------------------------------------------------------
class _Hangup(Exception):
  """A connection that broke the protocol, or its handshake: the server closes it."""


class _Inbound:
  """The server's side of one connection, fed the raw bytes ZeroMQ's STREAM socket reads
  (``feed``): its handshake (ZMTP NULL without a key; PLAIN with the key's token, compared
  in constant time), then its requests, frame by frame.

  A request's frames are kept up to their caps (``_REQUEST_FRAME_BYTES``), each written
  into a buffer of its size as its bytes arrive; a frame over its cap, or past the third,
  is dropped as its bytes arrive (counted in ``counts["frames_dropped"]``), and its
  message is refused once it ends; a frame over ``_MAX_REQUEST_BYTES`` closes the
  connection (``counts["oversized"]``). Complete requests wait in ``ready`` for a poll, at
  most ``pending_bytes_most`` of them (each charged ``_REQUEST_OVERHEAD_BYTES`` for its
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
          if len(raw) - at < _GREETING_BYTES:
            break
          mechanism = b"PLAIN" if self.token is not None else b"NULL"
          if _greeting_mechanism(raw[at:at + _GREETING_BYTES]) != mechanism:
            raise _Hangup("another mechanism")  # the client sees it too: not counted
          at += _GREETING_BYTES
          self.state = "hello" if self.token is not None else "ready"
          continue
        head = _parse_head(raw, at)
        if head is None:
          break
        flags, size, head_bytes = head
        if flags & ~(_MORE | _LONG | _COMMAND):
          raise _Hangup(f"frame flags {flags:#x}")
        if flags & _COMMAND or self.state != "open":
          if not flags & _COMMAND or flags & _MORE or self._count or size > _MAX_COMMAND_BYTES:
            raise _Hangup("not a command where one belongs")
          if len(raw) - at < head_bytes + size:
            break
          replies += self._command(bytes(raw[at + head_bytes:at + head_bytes + size]))
          at += head_bytes + size
          if self.state == "closed":
            return replies
          continue
        if size > _MAX_REQUEST_BYTES:
          self.counts["oversized"] += 1
          raise _Hangup(f"a frame of {size} bytes")
        at += head_bytes
        self._count += 1
        self._left, self._more, self._into = size, bool(flags & _MORE), None
        cap = _REQUEST_FRAME_BYTES[self._count - 1] if self._count <= 3 else -1
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
    charge = sum(map(len, frames)) + _REQUEST_OVERHEAD_BYTES
    if self.pending_bytes + charge > self.pending_bytes_most:
      self.counts["shed"] += 1
      return
    self.ready.append((frames, problem, charge))
    self.pending_bytes += charge

  def _command(self, command: bytes) -> list[bytes]:
    """The answer to one handshake command (a command after it, a ping, needs none)."""
    name, body = _command_parts(command)
    if self.state == "hello" and name == b"HELLO":
      credentials = _plain_credentials(body)
      if (credentials is not None and credentials[0] == _HANDSHAKE_USER
          and hmac.compare_digest(credentials[1], self.token)):
        self.state = "initiate"
        return [_command(b"WELCOME")]
      self.state, self.refused = "closed", True
      return [_command(b"ERROR", b"\x03400")]  # 400: ZAP's "not these credentials"
    if (self.state, name) in (("initiate", b"INITIATE"), ("ready", b"READY")):
      self.state = "open"
      return [_command(b"READY", _socket_type(b"ROUTER"))]
    if self.state == "open":
      return []
    raise _Hangup(f"a {name[:20]!r} command in the handshake")


# Charged, per request waiting for a poll, for its Python objects (a list, three buffers).
_REQUEST_OVERHEAD_BYTES = 512


def _answer_frames(seal: security.Seal | None, answer, data: list, sealed: bool) -> list:
  """An answer's frames ``[nonce, header, tag(s), *data]``: without a key a CRC-32C in the
  header only; with one a tag over the header and each piece of the blocks, or (``sealed``)
  a sealed frame per piece, so that no buffer of the whole answer is made."""
  header = answer.encode()
  nonce = answer.nonce.encode()  # an answer is about the request it names
  if seal is None:
    return [nonce, header, b"", *data]
  tag = seal.tag(_head_aad(answer.nonce, header))
  if not data:
    return [nonce, header, tag]
  chunks = _chunks(data[0])
  aads = _chunk_aads(answer.nonce, header, len(chunks))
  if sealed:
    return [nonce, header, tag, *map(seal.seal, aads, chunks)]
  return [nonce, header, b"".join([tag, *map(seal.tag, aads, chunks)]), data[0]]


class _Challenges:
  """A ``BlockServer``'s challenges, recomputed from a secret of this process (no state per
  connection), and the highest request number answered under each challenge in use (what
  refuses replays). Its settings are the server's (``challenge_epoch_s``,
  ``max_replay_windows``), read when used."""

  def __init__(self, server: "BlockServer", key: bytes):
    self.server, self._key = server, key
    self._secret = secrets.token_bytes(32)
    # challenge -> the highest request number answered under it, oldest challenge first.
    self._answered: collections.OrderedDict = collections.OrderedDict()

  def epoch(self) -> int:
    return int(time.monotonic() // self.server.challenge_epoch_s)

  def make(self, peer: bytes, epoch: int, salt: str) -> str:
    """The challenge of ``peer`` for ``epoch`` and ``salt``: recomputed, never stored."""
    mac = hmac.new(self._secret, b"%d\x00%s\x00" % (epoch, salt.encode()) + peer,
                   hashlib.sha256)
    return f"{epoch}-{salt}-{mac.hexdigest()[:32]}"

  def authentic(self, peer: bytes, body, auth) -> tuple[str, int] | None:
    """``(challenge, number)`` of ``auth`` (``"<challenge> <number> <MAC>"``) when it holds a
    challenge this server made for ``peer`` (this epoch or the last) and the key's MAC over
    it, the number and ``body``; else None."""
    parts = bytes(auth).decode("ascii", "replace").split(" ")
    if len(parts) != 3:
      return None
    challenge, number, mac = parts
    epoch, _, rest = challenge.partition("-")
    salt = rest.partition("-")[0]
    if not (epoch.isdigit() and len(epoch) <= 15 and re.fullmatch(r"[0-9a-f]{8}", salt)
            and number.isdigit() and len(number) <= 18 and str(int(number)) == number):
      return None
    now = self.epoch()
    if (int(epoch) in (now, now - 1)
        and hmac.compare_digest(self.make(peer, int(epoch), salt), challenge)
        and security.mac_ok(self._key, f"{challenge} {number}", body, mac)):
      return challenge, int(number)
    return None

  def first_time(self, challenge: str, number: int) -> bool | None:
    """Whether an authenticated request numbered ``number`` under ``challenge`` is new:
    numbered above every one answered under it (a client's numbers only grow, and one
    connection's requests arrive in order); from now on it is the highest. Remembers a
    number per challenge until the challenge expires (a request under an expired one is
    unauthenticated), ``max_replay_windows`` of them at most: None (refuse, "busy") for a
    new challenge beyond that, rather than forget one still in use."""
    last = self._answered.get(challenge)
    if last is not None:
      if number <= last:
        return False
      self._answered[challenge] = number
      return True
    oldest = self.epoch() - 1
    epoch_of = lambda c: int(c.partition("-")[0])
    while self._answered and epoch_of(next(iter(self._answered))) < oldest:
      self._answered.popitem(last=False)
    if len(self._answered) >= self.server.max_replay_windows:
      for c in [c for c in self._answered if epoch_of(c) < oldest]:
        del self._answered[c]
      if len(self._answered) >= self.server.max_replay_windows:
        return None
    self._answered[challenge] = number
    return True


class BlockServer:
  """Serves the device and host blocks of ``cache`` (a ``jaxkv.KVCache``) to other jobs.

  Requests are read and answered only inside ``poll``/``serve``, on the calling thread (one
  thread at a time), within a budget per poll (the attributes below; a test or an operator
  may set them on an instance). Each connection's bytes go through its ``_Inbound`` (the
  handshake, then requests frame by frame, within their bounds: the module's docstring).
  Each request is checked (frames, nonce, authentication) before it is parsed
  (``decode``), then answered by ``reply``; a fetch's blocks are gathered once and handed
  to ``ship``, which sends them the way the client asked. Every failure on the way is a
  ``Refusal``, never a crash.

  With a deployment key only connections that pass the PLAIN handshake get a request
  read. Without one the server answers anyone who reaches it: bound to a non-loopback
  ``host`` it refuses to start unless ``allow_insecure``, and it logs that it is insecure
  in any case. ``counts`` tells what it did (answered, unauthenticated, replay, shed,
  malformed, frames dropped, oversized frames, offers refused for the bound);
  ``handshakes_refused``, how many connections it turned away before reading a request of
  theirs. ``close`` it: it owns a ZeroMQ context.
  """

  max_messages_per_poll = 64  # requests one ``poll`` answers
  max_messages_per_peer = 16  # of them for one connection; its others wait for the next poll
  max_pending_bytes_per_peer = 2 * _MAX_REQUEST_BYTES  # requests read, not yet answered
  poll_overrun_s = 0.005  # reading stops this long after ``poll``'s timeout
  max_answer_bytes_per_poll = 64 << 20  # ... or once its answers' blocks pass this
  challenge_epoch_s = 60.0  # a challenge holds for its epoch and the next one
  handshake_timeout_s = 30.0  # a connection still in its handshake after this is closed
  max_offers = 256  # transfer offers outstanding (not yet expired) ...
  max_offer_bytes = 1 << 30  # ... and their device bytes
  offer_ttl_s = 30.0  # the longest a transfer offer stands (the client's wait, if shorter)
  max_replay_windows = 4096  # challenges whose highest answered number is remembered

  def __init__(self, cache, host: str = "127.0.0.1", port: int = 0, *,
               allow_insecure: bool = False):
    self.cache = cache
    self._key = cache.deployment_key
    if self._key is None:
      if not security.is_loopback(host) and not allow_insecure:
        raise InputError(f"BlockServer on {host}:{port} has no deployment key: anyone who "
                         "reaches it could test which prompts were served and pull their KV. "
                         f"Fix: {_KEYLESS_FIX}; or pass allow_insecure=True "
                         "(--allow_insecure) on an isolated network.")
      security.warn_insecure("the block server answers anyone, without a deployment key "
                             "(its answers carry a CRC-32C only)", _KEYLESS_FIX)
    self._seal = security.Seal(self._key, "remote-answer") if self._key is not None else None
    self._token = _handshake_token(self._key) if self._key is not None else None
    self.counts: collections.Counter = collections.Counter()
    self._handshakes_refused = 0
    self._offers: list[tuple[float, int]] = []  # (expiry, bytes) of outstanding offers
    self._challenges = _Challenges(self, self._key)
    self._peers: dict[bytes, _Inbound] = {}  # connection id -> its inbound side
    self._turns: collections.OrderedDict = collections.OrderedDict()  # ids with requests ready
    self._closing: set[bytes] = set()  # connections to close (their queue was full)
    self._sweep_at = 0.0  # when handshakes past their time are next closed
    self._progressed = False  # a handshake took a step in this poll
    self._transfer = None
    self._context = zmq.Context()
    self._socket = None
    try:
      self._socket = self._context.socket(zmq.STREAM)
      self._socket.setsockopt(zmq.LINGER, 0)
      self._socket.setsockopt(zmq.RCVHWM, _RCVHWM_CHUNKS)  # per connection, raw chunks
      # Per connection, in sends: a largest answer is a header piece and, sealed, two sends
      # a piece; beyond, the connection is closed (it does not read).
      block = int(np.prod(cache.payload_shape)) * np.dtype(
          pages_lib.bits_dtype(cache.config.jnp_dtype)).itemsize
      sends = 1 + 2 * len(_piece_sizes(_MAX_FETCH_BLOCKS * block))
      self._socket.setsockopt(zmq.SNDHWM, 4 * self.max_messages_per_peer * sends)
      if port:
        self._socket.bind(f"tcp://{host}:{port}")
      else:
        port = self._socket.bind_to_random_port(f"tcp://{host}")
    except BaseException:  # e.g. the port is taken: leave no socket behind
      self._context.destroy(linger=0)
      raise
    self.address = f"{host}:{port}"

  @property
  def refused(self) -> int:
    """Requests refused for a missing or wrong MAC (or an unknown challenge)."""
    return self.counts["unauthenticated"]

  @property
  def handshakes_refused(self) -> int:
    """Connections turned away in the handshake (a wrong token), before a request of
    theirs was read. A client without any credentials fails earlier still (its greeting
    names another mechanism) and is not counted here."""
    return self._handshakes_refused

  @property
  def queued_bytes_most(self) -> int:
    """The most bytes ZeroMQ queues for one connection between polls: its STREAM queue of
    ``_RCVHWM_CHUNKS`` chunks, and the one its reader holds once the queue is full (raw
    chunks are read ``_IN_BATCH_BYTES`` at most; then TCP holds the sender back)."""
    return (_RCVHWM_CHUNKS + 1) * _IN_BATCH_BYTES

  @property
  def held_bytes_most(self) -> int:
    """The most bytes of one connection's requests this server holds: those read and
    waiting (``max_pending_bytes_per_peer``), the one being read (its three frames at their
    caps), a chunk as read and as not parsed yet, and a command."""
    return (self.max_pending_bytes_per_peer + sum(_REQUEST_FRAME_BYTES) + 2 * _IN_BATCH_BYTES
            + _MAX_COMMAND_BYTES)

  def poll(self, timeout_s: float = 0.0) -> int:
    """Reads what arrives within ``timeout_s`` and answers requests, at most
    ``max_messages_per_poll`` of them and ``max_messages_per_peer`` a connection (the
    connections in turn; a connection's others wait for the next poll), and none once its
    answers' blocks pass ``max_answer_bytes_per_poll``. While a handshake is under way it
    may read on until ``poll_overrun_s`` past the timeout (a handshake is three round
    trips). Returns how many requests it answered."""
    answered = answered_bytes = 0
    per_peer: collections.Counter = collections.Counter()
    now = time.monotonic()
    deadline = now + timeout_s
    stop = deadline + self.poll_overrun_s
    self._tidy(now)
    self._progressed = False
    while (answered < self.max_messages_per_poll
           and answered_bytes <= self.max_answer_bytes_per_poll):
      turn = self._next_turn(per_peer)
      if turn is not None:
        peer, frames, problem = turn
        per_peer[peer] += 1
        reply, blocks_bytes = self._handle(peer, frames, problem)
        self._send(peer, _encoded(reply))
        answered += 1
        answered_bytes += blocks_bytes
        continue
      now = time.monotonic()
      until = stop if self._progressed else deadline
      if now >= stop or not self._socket.poll(max(0, int((until - now) * 1000))):
        break
      self._receive()
    self.counts["answered"] += answered
    return answered

  def waiting(self) -> bool:
    """Whether a request or bytes wait to be read (a ``poll`` left work for the next one)."""
    return bool(self._turns) or bool(self._socket.poll(0))

  def serve(self, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
      self.poll(min(0.1, max(0.0, end - time.monotonic())))

  def close(self) -> None:
    if self._socket is not None:
      self._socket.close(0)
    self._context.term()

  # ---- connections: bytes in, answers out -----------------------------------------------------
  def _receive(self) -> None:
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
        self._peers[peer] = _Inbound(self._token, self.counts,
                                     self.max_pending_bytes_per_peer, time.monotonic())
        self._progressed |= self._send(peer, [_greeting(
            b"PLAIN" if self._token is not None else b"NULL", self._token is not None)])
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
      self._handshakes_refused += 1
      self._closing.add(peer)  # once its ERROR has gone: at the next poll
    if replies:
      self._progressed |= self._send(peer, replies)
    if inbound.ready and peer not in self._turns:
      self._turns[peer] = None

  def _next_turn(self, per_peer) -> tuple[bytes, list, str] | None:
    """The next request to answer: from the first connection in turn below its share."""
    for peer in self._turns:
      if per_peer[peer] < self.max_messages_per_peer:
        inbound = self._peers[peer]
        frames, problem = inbound.take()
        if inbound.ready:
          self._turns.move_to_end(peer)
        else:
          del self._turns[peer]
        return peer, frames, problem
    return None

  def _send(self, peer: bytes, pieces: list) -> bool:
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

  def _tidy(self, now: float) -> None:
    """Closes the connections waiting to be closed, and once a second those whose
    handshake is past ``handshake_timeout_s``."""
    for peer in list(self._closing):
      self._hang_up(peer)
    if now >= self._sweep_at:
      self._sweep_at = now + 1.0
      for peer, inbound in list(self._peers.items()):
        if inbound.state != "open" and now - inbound.since > self.handshake_timeout_s:
          self._hang_up(peer)

  # ---- one request --------------------------------------------------------------------------
  def _handle(self, peer: bytes, frames: list, problem: str) -> tuple[list, int]:
    """The reply frames ``[nonce, answer, tag, *data]`` to one request
    ``[nonce, message, auth]`` (``problem``: why its frames already break the protocol),
    and the bytes of the blocks it answers with (for the poll's budget): checked from the
    cheapest test on, parsed only once authenticated (a hello excepted)."""
    nonce = ""
    sealed = False
    try:
      nonce = _readable_nonce(bytes(frames[0][:65]).decode("ascii", "replace") if frames else "")
      if problem:
        raise WireError(problem)
      body, auth = frames[1], frames[2]
      signed = (self._challenges.authentic(peer, body, auth) if self._key is not None and auth
                else None)
      if self._key is not None and (auth or len(body) > _MAX_HELLO_BYTES) and signed is None:
        answer, data = self._refuse_unauthenticated(nonce), []
      else:
        request = decode(body, REQUESTS)
        if request.nonce != nonce:
          raise WireError(f"the message's nonce {request.nonce!r} is not its frame's", nonce)
        if isinstance(request, Hello):
          self.counts["hello"] += 1
          challenge = self._challenges.make(peer, self._challenges.epoch(),
                                            secrets.token_hex(4))
          answer, data = Welcome(nonce=nonce, challenge=challenge,
                                 valid_ms=int(self.challenge_epoch_s * 1000)), []
        elif self._key is not None and signed is None:
          answer, data = self._refuse_unauthenticated(nonce), []
        elif self._key is not None and (new := self._challenges.first_time(*signed)) is not True:
          if new is None:
            self.counts["replay_windows_full"] += 1
            answer = Refusal(nonce=nonce, error=f"busy: requests under {self.max_replay_windows} "
                             "challenges are numbered here already (say hello again later)")
          else:
            self.counts["replay"] += 1
            answer = Refusal(nonce=nonce, error="replay: numbered at or below a request this "
                             "server has answered under the same challenge")
          data = []
        else:
          answer, data = self.reply(request)
          sealed = isinstance(answer, Offer) and answer.sealed
    except InvariantError:  # our own bookkeeping broke: a bug, not the peer's problem
      raise
    except Exception as e:  # pylint: disable=broad-except  (answer, never crash)
      self.counts["malformed"] += 1
      answer, data = Refusal(nonce=getattr(e, "nonce", nonce) or nonce,
                             error=f"{type(e).__name__}: {str(e)[:200]}"), []
    blocks_bytes = (int(np.prod(answer.shape)) * np.dtype(answer.dtype).itemsize
                    if isinstance(answer, Offer) else 0)
    return _answer_frames(self._seal, answer, data, sealed), blocks_bytes

  def _refuse_unauthenticated(self, nonce: str) -> Refusal:
    self.counts["unauthenticated"] += 1
    return Refusal(nonce=nonce, error=f"{_UNAUTHENTICATED}: a wrong or missing deployment "
                   "key, or a challenge this server did not make for this connection or that "
                   "expired (say hello again)")

  def reply(self, request: Lookup | FetchBlocks) -> tuple[Have | Offer | Refusal, list]:
    """The answer to an authenticated request, and the data frames that follow it."""
    if request.fingerprint != self.cache.config.fingerprint().hex():
      return Refusal(nonce=request.nonce, error="fingerprint: another model or layout"), []
    if isinstance(request, FetchBlocks) and request.sealed and self._key is None:
      return Refusal(nonce=request.nonce, error="sealed: this peer has no deployment key, "
                     "it cannot seal blocks"), []
    where = self._where(list(request.keys))
    if isinstance(request, Lookup):
      return Have(nonce=request.nonce, have=len(where)), []
    if len(where) < len(request.keys):
      return Refusal(nonce=request.nonce, error=f"missing: holds {len(where)} of "
                     f"{len(request.keys)} blocks"), []
    stack = self._gather(where)  # [blocks, arrays, kv_heads, page_size, head_dim] bits
    transfer = request.transport == "transfer"
    offer = Offer(nonce=request.nonce, keys=request.keys, dtype=np.dtype(stack.dtype).name,
                  shape=tuple(stack.shape), token=request.token, sealed=request.sealed,
                  crc32c=_digest(stack) if self._key is None else None,
                  expires_ms=(min(request.wait_ms, int(self.offer_ttl_s * 1000))
                              if transfer else None))
    return self.ship(offer, stack, request.transport)

  def ship(self, offer: Offer, stack: np.ndarray, transport: str) -> tuple[Offer | Refusal, list]:
    """Sends the blocks ``offer`` describes: inline, as one zero-copy frame after it (tagged
    or sealed with the header); or as a ``jax.experimental.transfer`` pull the offer names.

    A transfer offer holds a device copy of the blocks (sealed: of their ciphertext) until
    it is pulled or ``offer.expires_ms`` has passed (``await_pull``'s timeout: the transfer
    library then drops it). Offers not yet expired are bounded by ``max_offers`` and
    ``max_offer_bytes``, counting pulled ones until they expire (the library does not say
    when a pull happened); beyond the bound a fetch is refused (counted,
    ``counts["offers_refused"]``) and the client recomputes."""
    if transport == "inline":
      return offer, [_bytes_of(stack)]
    payload = stack
    if self._seal is not None and offer.sealed:
      payload = np.frombuffer(self._seal.seal(_pull_aad(offer.nonce), _bytes_of(stack)),
                              np.uint8)
    elif self._seal is not None:
      offer = dataclasses.replace(
          offer, data_tag=self._seal.tag(_pull_aad(offer.nonce), _bytes_of(stack)).hex())
    now = time.monotonic()
    self._offers = [(t, n) for t, n in self._offers if t > now]
    held = sum(n for _, n in self._offers)
    if (len(self._offers) >= self.max_offers
        or held + payload.nbytes > self.max_offer_bytes):
      self.counts["offers_refused"] += 1
      return Refusal(nonce=offer.nonce, error=f"busy: {len(self._offers)} transfer offers "
                     f"({held} bytes) outstanding, the most this peer holds"), []
    if self._transfer is None:
      import jax.experimental.transfer as transfer
      self._transfer = transfer.start_transfer_server(jax.local_devices()[0].client,
                                                      f"{self.address.rpartition(':')[0]}:0",
                                                      ["127.0.0.1:0"])
    ttl_s = (offer.expires_ms if offer.expires_ms is not None
             else self.offer_ttl_s * 1000) / 1000
    transfer_id = secrets.randbits(63)
    self._transfer.await_pull(transfer_id, [jax.device_put(payload, jax.local_devices()[0])],
                              timeout=datetime.datetime.now() + datetime.timedelta(seconds=ttl_s))
    self._offers.append((now + ttl_s, payload.nbytes))
    return dataclasses.replace(offer, transfer_id=transfer_id,
                               transfer_address=self._transfer.address()), []

  def _where(self, keys: list[bytes]) -> list[tuple[int, Tier, int]]:
    """(shard, tier, slot) of the longest prefix of ``keys`` in device or host memory on
    any one shard (a block on disk ends the prefix: what follows it is not a prefix)."""
    index = self.cache.index
    best: list = []
    for s in range(self.cache.num_shards):
      found = [(s, t, slot) for t, slot in index.locate(s, keys, (Tier.DEVICE, Tier.HOST))]
      if len(found) > len(best):
        best = found
    return best

  def _gather(self, where) -> np.ndarray:
    """The blocks' raw bits ``[blocks, arrays, kv_heads, page_size, head_dim]``: one
    gather per tier for all of them; only the rows of the shards holding them come to
    the host, then one numpy copy puts each block in place."""
    cache = self.cache
    out = None
    for tier in (Tier.DEVICE, Tier.HOST):
      picks = [(i, s, slot) for i, (s, t, slot) in enumerate(where) if t == tier]
      if not picks:
        continue
      ids, per = buckets.shard_ids(picks, cache.num_shards, 0, lambda p: p[2],
                                   shard_of=lambda p: p[1])
      n = ids.shape[1]
      if tier == Tier.DEVICE:
        stack = pages_lib.gather_stacked(cache.pools, cache.put_rows(ids), mesh=cache.mesh,
                                         config=cache.config)
      else:
        stack = cache.host.read_numpy(ids)
      for s, items in enumerate(per):
        if not items:
          continue
        got = _host_blocks(stack, s * n, s * n + len(items))
        dst = [i for i, _, _ in items]
        if out is None and dst == list(range(len(where))):
          return got  # one tier, one shard: already in place
        if out is None:
          out = np.empty((len(where), *got.shape[1:]), got.dtype)
        out[dst] = got
    return out


def _host_blocks(x, start: int, stop: int) -> np.ndarray:
  """``x[:, :, start:stop]`` as numpy with the rows first (``[rows, arrays, kv_heads, ...]``,
  a block per row), copying to the host only the device shards that hold those rows (a
  device gather spans every data shard; a peer wants one): one copy per shard."""
  if not isinstance(x, jax.Array) or not x.is_fully_addressable:
    return np.ascontiguousarray(np.moveaxis(to_host(x)[:, :, start:stop], 2, 0))
  parts = []
  for shard in x.addressable_shards:
    lo, hi, _ = shard.index[2].indices(x.shape[2])
    if shard.replica_id == 0 and lo < stop and start < hi:
      shard.data.copy_to_host_async()
      parts.append((shard, lo, max(lo, start), min(hi, stop)))
  out = np.empty((stop - start, *x.shape[:2], *x.shape[3:]), x.dtype)
  for shard, lo, a, b in parts:
    out[a - start:b - start, shard.index[0], shard.index[1]] = np.moveaxis(
        np.asarray(shard.data)[:, :, a - lo:b - lo], 2, 0)
  return out


# ---- the reading side ----------------------------------------------------------------------------
class RemoteTier:
  """The peers of ``TierConfig.remote_peers`` as one ``FetchSource``: each request's
  blocks from one peer come in one ``fetch`` per ``_MAX_FETCH_BLOCKS`` blocks."""

  tier = Tier.REMOTE

  def __init__(self, clients: list["RemoteClient"], payload_shape: tuple, dtype):
    self.clients, self.payload_shape, self.dtype = clients, tuple(payload_shape), dtype
    for client in clients:  # before any connection: sizes the largest answer it reads
      client.expect(self.payload_shape, dtype)

  def longest_prefix(self, keys: list[bytes], local: int) -> tuple[int, int] | None:
    """``(peer, blocks)`` of the peer holding the longest prefix of ``keys``, when it is
    longer than the ``local`` blocks this job holds."""
    best = None
    if len(keys) > local:
      for i, client in enumerate(self.clients):
        n = min(client.lookup(keys), len(keys))
        if n > local and (best is None or n > best[1]):
          best = (i, n)
    return best

  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, tuple[Fetch, ...]]:
    return None, tuple(fetches)  # a fetch waits: it runs in finish_fetch, after the recompute

  def finish_fetch(self, fetches: tuple[Fetch, ...], t_end: float, stage) -> FetchOutcome:
    """Per request and peer, its blocks in chain order, ``_MAX_FETCH_BLOCKS`` a ``fetch``;
    a fetch that fails fails every block of it and of the request's later fetches (the
    request recomputes from its first failed block anyway)."""
    groups: dict = {}
    for i, f in enumerate(fetches):
      groups.setdefault((f.request, f.slot), []).append(i)
    staged, failures = [], [None] * len(fetches)
    for (_, peer), positions in groups.items():
      positions.sort(key=lambda i: fetches[i].block)
      failure = None
      for lo in range(0, len(positions), _MAX_FETCH_BLOCKS):
        part = positions[lo:lo + _MAX_FETCH_BLOCKS]
        if failure is None:
          try:
            stack = self.clients[peer].fetch([fetches[i].key for i in part],
                                             self.payload_shape, self.dtype, t_end)
          except Exception as e:  # pylint: disable=broad-except  (any failed pull is a miss)
            failure = Failure.of(e, Failure.REMOTE)
        if failure is not None:
          for i in part:
            failures[i] = failure
          continue
        for j, i in enumerate(part):
          staged.append((fetches[i].shard, fetches[i].page, stack[j]))
    return FetchOutcome(stage(staged) if staged else None, tuple(failures))


@dataclasses.dataclass(frozen=True)
class _Layout:
  """What an answer to one request may hold, frame by frame: a nonce (``_MAX_NONCE_BYTES``),
  a header (``_MAX_HEADER_BYTES``), tags (``tag_bytes``), then exactly the blocks frames
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
    """``n`` bytes (a small frame: at most ``_MAX_HEADER_BYTES``)."""
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
    if flags & ~(_MORE | _LONG | _COMMAND):
      raise RemoteError("malformed", f"a frame with flags {flags:#x}")
    if flags & _LONG:
      size = int.from_bytes(bytes([size]) + self._read(7, deadline), "big")
    return flags, size

  # ---- the handshake ------------------------------------------------------------------------
  def _handshake(self, token: bytes | None, deadline: float) -> None:
    mine = b"PLAIN" if token is not None else b"NULL"
    self._write(_greeting(mine, as_server=False), deadline)
    try:
      theirs = _greeting_mechanism(self._read(_GREETING_BYTES, deadline))
      if theirs != mine:
        raise RemoteError("refused", f"peer {self.address} refused this connection's "
                          f"handshake (it speaks {theirs or b'no ZMTP 3'!r}, this client "
                          f"{mine!r}): {_HANDSHAKE_FIX}")
      if token is not None:
        self._write(_command(b"HELLO", bytes([len(_HANDSHAKE_USER)]) + _HANDSHAKE_USER
                             + bytes([len(token)]) + token), deadline)
        self._expect(b"WELCOME", deadline)
        self._write(_command(b"INITIATE", _socket_type(b"DEALER")), deadline)
      else:
        self._write(_command(b"READY", _socket_type(b"DEALER")), deadline)
      self._expect(b"READY", deadline)
    except RemoteError as e:
      if e.reason not in (Failure.CLOSED, Failure.IO):
        raise
      raise RemoteError("refused", f"peer {self.address} closed the connection in this "
                        f"connection's handshake ({e}): {_HANDSHAKE_FIX}") from None

  def _expect(self, name: bytes, deadline: float) -> None:
    flags, size = self._frame_head(deadline)
    if not flags & _COMMAND or size > _MAX_COMMAND_BYTES:
      raise RemoteError("malformed", f"a frame of {size} bytes in the handshake, where a "
                        f"{name.decode()} command belongs")
    got, body = _command_parts(self._read(size, deadline))
    if got == b"ERROR":
      reason = body[1:1 + body[0]].decode("ascii", "replace") if body else ""
      raise RemoteError("refused", f"peer {self.address} refused this connection's "
                        f"handshake ({reason or 'no reason'}): {_HANDSHAKE_FIX}")
    if got != name:
      raise RemoteError("malformed", f"a {got[:20]!r} command in the handshake, where "
                        f"{name.decode()} belongs")

  # ---- messages ------------------------------------------------------------------------------
  def send_multipart(self, frames, deadline: float | None = None) -> None:
    """Sends one message (by ``deadline``; by default within 5 s)."""
    data = b"".join(_head(len(f), _MORE if i < len(frames) - 1 else 0) + bytes(f)
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
      if flags & _COMMAND:  # a ping, between messages
        if frames or size > _MAX_COMMAND_BYTES:
          raise RemoteError("malformed", f"a command of {size} bytes in an answer")
        self._skip(size, deadline)
        continue
      more = bool(flags & _MORE)
      i = len(frames)
      if i == 0:
        if size > _MAX_NONCE_BYTES:
          raise RemoteError("malformed", f"an answer's nonce of {size} bytes (at most "
                            f"{_MAX_NONCE_BYTES})")
        if self._read(size, deadline) != nonce:  # to an earlier request: read past it
          self._read_past(more, layout, deadline)
          return None
        frames.append(nonce)
      elif i < 3:
        cap = _MAX_HEADER_BYTES if i == 1 else layout.tag_bytes
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
      if flags & _COMMAND or size > layout.other_frame_bytes or count > layout.other_frames:
        raise RemoteError("malformed", f"an answer to another request, past {count} frames "
                          f"or {layout.other_frame_bytes} bytes a frame")
      self._skip(size, deadline)
      more = bool(flags & _MORE)


class RemoteClient:
  """Fetches blocks from one peer, with deadlines and a circuit breaker.

  ``secret``: the deployment key (the peer must have the same); ``encrypt``: ask for
  sealed blocks and refuse plaintext ones (needs the key). With a key, each connection
  opens with the handshake's token (``_handshake_token``); a peer that refuses the
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
                             _KEYLESS_FIX)
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
    self._max_frame_bytes = _MAX_HEADER_BYTES  # until ``expect`` sizes the blocks frame
    self._token = _handshake_token(self._secret) if self._secret is not None else None
    self._sock: _Link | None = None
    self._transfer_server = None
    # transfer address -> connection, least recently used first (``_MAX_TRANSFER_CONNECTIONS``)
    self._connections: collections.OrderedDict = collections.OrderedDict()

  @property
  def available(self) -> bool:
    return self.breaker.available

  def expect(self, payload_shape, dtype) -> None:
    """Sizes the blocks frames this client reads: a fetch's answer holds exactly its blocks
    (``_layout``), and the largest frame it reads past (an answer to an earlier request) is
    one fetch's blocks inline, else an answer header. Set before the first fetch
    (``RemoteTier`` does); a change re-makes the connection."""
    block = int(np.prod(payload_shape)) * np.dtype(pages_lib.bits_dtype(dtype)).itemsize
    most = _MAX_HEADER_BYTES
    if self.transport == "inline":
      most = max(most, _MAX_FETCH_BLOCKS * block + security.Seal.OVERHEAD)
    if (most, block) != (self._max_frame_bytes, self._block_bytes):
      self._max_frame_bytes, self._block_bytes = most, block
      self._close()

  def _layout(self, request) -> _Layout:
    """What an answer to ``request`` may hold: inline blocks as one frame of exactly the
    blocks asked for (its tags one a ``_CHUNK_BYTES`` piece, and the header's), or sealed
    as one frame a piece, each exactly its piece and its seal; no blocks frame otherwise."""
    tag, data = security.Seal.TAG_BYTES, ()
    if isinstance(request, FetchBlocks) and request.transport == "inline":
      pieces = _piece_sizes(len(request.keys) * self._block_bytes)
      if request.sealed:
        data = tuple(p + security.Seal.OVERHEAD for p in pieces)
      else:
        data, tag = (sum(pieces),), tag * (1 + len(pieces))
    most_pieces = len(_piece_sizes(_MAX_FETCH_BLOCKS * self._block_bytes))
    return _Layout(tag_bytes=tag, data=data, other_frame_bytes=self._max_frame_bytes,
                   other_frames=3 + most_pieces)

  def answer_bytes_most(self, blocks: int) -> int:
    """The most bytes an answer to a fetch of ``blocks`` blocks makes this client hold, as
    ``expect`` sized them: its frames at their caps (a nonce, a header, tags, the blocks as
    asked, sealed ones with their seals), what its connection reads ahead, and the blocks
    opened from their seal."""
    layout = self._layout(FetchBlocks(
        nonce="n", fingerprint="", keys=(bytes(32),) * blocks, token="t",
        transport=self.transport, sealed=self.encrypt, wait_ms=0))
    opened = blocks * self._block_bytes if self.encrypt else 0
    return (_MAX_NONCE_BYTES + _MAX_HEADER_BYTES + layout.tag_bytes + sum(layout.data)
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
        kind = _Unauthenticated if answer.error.startswith(_UNAUTHENTICATED) else RemoteError
        raise kind("refused", answer.error[:200])
      if not isinstance(answer, _ANSWER_TO[type(request)]):
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
      self._seal.check(_head_aad(nonce, header), b"", tag[:size])
      if not data:
        if len(tag) != size:
          raise security.SealError("tags of blocks that are not there")
        return []
      if sealed:
        if any(len(d) < security.Seal.OVERHEAD for d in data):
          raise security.SealError("a sealed piece shorter than its nonce and tag")
        aads = _chunk_aads(nonce, header, len(data))
        out = np.empty(sum(len(d) for d in data) - len(data) * security.Seal.OVERHEAD, np.uint8)
        at = 0
        for aad, piece in zip(aads, data):
          plain = self._seal.open(aad, piece)
          out[at:at + len(plain)] = np.frombuffer(plain, np.uint8)
          at += len(plain)
        return [memoryview(out)]
      chunks = _chunks(data[0]) if len(data) == 1 else []
      if not chunks or len(tag) != size * (1 + len(chunks)):
        raise RemoteError("malformed", f"{len(data)} data frames and {len(tag)} bytes of "
                          f"tags: expected 1 frame and {size} bytes a {_CHUNK_BYTES}-byte piece")
      for i, (aad, chunk) in enumerate(zip(_chunk_aads(nonce, header, len(chunks)), chunks)):
        self._seal.check(aad, chunk, tag[size * (i + 1):size * (i + 2)])
      return data
    except security.SealError as e:
      raise RemoteError("mac", f"the peer's answer is not signed with this deployment key, "
                        f"or was changed on the way ({e})") from None

  def _connect(self, deadline: float) -> None:
    if self._sock is None or self._sock.closed:
      self._sock = _Link(self.address, self.host, self.port, self._token, deadline)
    welcome, _ = self._exchange(Hello(nonce=_nonce()), deadline)
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
      except _Unauthenticated:
        if attempt or self._secret is None:
          raise
        self._challenge = ""
    raise AssertionError("unreachable")

  def lookup(self, keys: list[bytes]) -> int:
    """How many leading ``keys`` the peer holds, at most ``len(keys)`` (0 when it cannot
    be asked, or its answer is wrong: counted in ``failures_by_reason``)."""
    keys = list(keys[:_MAX_KEYS])  # a prefix of a prefix: still the question asked
    if not keys:
      return 0
    if not self.available:
      self._failed(Failure.BREAKER, close=False)
      return 0
    try:
      have, _ = self._call(Lookup(nonce=_nonce(), fingerprint=self.fingerprint,
                                  keys=tuple(keys)), time.monotonic() + min(self.deadline_s, 1.0))
      if have.have > len(keys):
        raise RemoteError("malformed", f"holds {have.have} of the {len(keys)} keys asked about")
      self.breaker.record(True)
      return have.have
    except InvariantError:
      raise
    except Exception as e:  # pylint: disable=broad-except  (a peer never breaks admission)
      self._failed(_reason(e))
      return 0

  def fetch(self, keys: list[bytes], payload_shape, dtype, deadline: float) -> np.ndarray:
    """The blocks' raw bits ``[blocks, *payload_shape]`` (at most ``_MAX_FETCH_BLOCKS``),
    verified; raises ``RemoteError`` (counted in ``failures_by_reason``), nothing else."""
    if len(keys) > _MAX_FETCH_BLOCKS:
      raise InputError(f"fetch of {len(keys)} blocks: at most {_MAX_FETCH_BLOCKS} a fetch; "
                       "split them (RemoteTier does).")
    if not self.available:
      self._failed(Failure.BREAKER, close=False)
      raise RemoteError("breaker", f"peer {self.address} is cooling down")
    try:
      self.expect(payload_shape, dtype)
      bits = np.dtype(pages_lib.bits_dtype(dtype))
      request = FetchBlocks(nonce=_nonce(), fingerprint=self.fingerprint, keys=tuple(keys),
                            token=_nonce(), transport=self.transport, sealed=self.encrypt,
                            wait_ms=max(0, int((deadline - time.monotonic()) * 1000)))
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
        stack = self._inline(data, want_shape, bits)
      else:
        stack = self._pull(offer, want_shape, bits, deadline)
      if self._seal is None and _digest(stack) != offer.crc32c:
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

  @staticmethod
  def _inline(data: list, shape, bits) -> np.ndarray:
    """The blocks carried in the answer's data frame, viewed without a copy."""
    want = int(np.prod(shape)) * bits.itemsize
    if len(data) != 1 or len(data[0]) != want:
      raise RemoteError("shape", f"{[len(d) for d in data]} bytes of data, expected [{want}]")
    return np.frombuffer(data[0], dtype=bits).reshape(shape)

  def _transfer_address(self, offered: str) -> str:
    """Where to pull an offer from: the peer's own host, at the port the offer names. An
    offer naming another host is malformed (a peer never sends this client elsewhere); an
    unspecified one (``0.0.0.0``, ``::``: the peer's transfer server listens on every
    interface) means the peer's host."""
    host, _, port = offered.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or host not in (self.host.strip("[]"), "0.0.0.0", "::"):
      raise RemoteError("malformed", f"the offer's transfer address {offered[:80]!r} is not "
                        f"on the peer's host {self.host}")
    return f"{self.host}:{int(port)}"

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
    addr = self._transfer_address(offer.transfer_address)
    import jax.experimental.transfer as transfer
    device = jax.local_devices()[0]
    if self._transfer_server is None:
      self._transfer_server = transfer.start_transfer_server(device.client, "127.0.0.1:0",
                                                             ["127.0.0.1:0"])
    nbytes = int(np.prod(shape)) * bits.itemsize
    pulled_shape, pulled_dtype = ((nbytes + security.Seal.OVERHEAD,), np.dtype(np.uint8)) if (
        offer.sealed) else (tuple(shape), bits)
    conn = self._connections.pop(addr, None)
    if conn is None:
      conn = self._transfer_server.connect(addr)  # lazy: it does not wait on the network
    self._connections[addr] = conn
    while len(self._connections) > _MAX_TRANSFER_CONNECTIONS:
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
        plain = self._seal.open(_pull_aad(offer.nonce), _bytes_of(value))
        return np.frombuffer(plain, dtype=bits).reshape(shape)
      self._seal.check(_pull_aad(offer.nonce), _bytes_of(value), bytes.fromhex(offer.data_tag))
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
