"""The REMOTE tier's wire: the messages both sides send, the frames they travel in, their caps.

Every message either side sends is one frozen dataclass of this module (``Hello``,
``Lookup``, ``FetchBlocks``; ``Welcome``, ``Have``, ``Offer``, ``Refusal``), built and
checked in one place ("the wire" below). Each field has a rule, enforced whether the
message was built here or decoded off the socket (``decode``), so neither side handles a
dict, and a peer's malformed message is a ``WireError`` naming the field and the rule.

Frames, read by hand (ZMTP, below): messages travel as ZeroMQ's wire protocol frames them
(ZMTP 3.1, so a ZeroMQ DEALER or ROUTER can talk to either side), but neither side reads
them through a ZeroMQ socket. ZeroMQ delivers a message only whole and caps the size of a
frame, never the number of frames of a message: its receive high-water mark counts whole
messages, so a socket queues a message of any number of frames, however large, before its
reader sees the first. Instead each side reads a frame's header before its bytes and
keeps only frames that can belong to what it waits for, within the caps here (the server:
``connections._Inbound``; the client: ``client._Link``).

Also here: what an answer's tags and seals are bound to (``head_aad``, ``chunk_aads``,
``pull_aad``), the ``CHUNK_BYTES`` pieces blocks are tagged or sealed in, and
``RemoteError`` (a fetch that cannot be used; ``auth.Unauthenticated`` is one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import secrets
from collections.abc import Callable
from typing import Any, ClassVar

import google_crc32c
import numpy as np

from jaxkv import security
from jaxkv.config import REMOTE_TRANSPORTS as TRANSPORTS
from jaxkv.worker.tiers.base import Failure

PROTOCOL = 7  # 6: requests numbered (replays refused by number); frames read by hand;
# 7: a hybrid model's window group (``Lookup.windows``, ``Have.windows``, ``FetchBlocks.group``)
MAX_KEYS = 16384  # block keys one lookup asks about (256k tokens at 16 a page)
MAX_FETCH_BLOCKS = 512  # blocks one fetch brings (``RemoteTier`` splits longer runs)
# A request is block keys only: 64 hex digits, quotes and a comma each, and a few fields.
MAX_REQUEST_BYTES = MAX_KEYS * 68 + 4096
MAX_HELLO_BYTES = 1024  # the one request read without the key is small
MAX_NONCE_BYTES = 64  # a nonce frame (``_NONCE``'s rule)
# "<epoch>-<8 hex>-<32 hex> <number> <64 hex>": a challenge, a request's number, its MAC.
_MAX_AUTH_BYTES = 160
REQUEST_FRAME_BYTES = (MAX_NONCE_BYTES, MAX_REQUEST_BYTES, _MAX_AUTH_BYTES)
# An answer's header names at most one fetch's keys (an offer repeats them).
MAX_HEADER_BYTES = 64 << 10


class RemoteError(RuntimeError):
  """A remote fetch that cannot be used; ``reason`` says how (a ``base.Failure``)."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = Failure(reason)



def stack_digest(stack) -> int:
  return google_crc32c.value(np.ascontiguousarray(stack).reshape(-1).view(np.uint8))


def bytes_of(stack: np.ndarray) -> memoryview:
  return memoryview(np.ascontiguousarray(stack)).cast("B")


def new_nonce() -> str:
  return secrets.token_hex(16)


# What an answer's tags and seals are bound to: each starts with its role and carries the
# request's nonce. The blocks frame is tagged (or sealed) in ``CHUNK_BYTES`` pieces, each
# bound to the header (its digest), its index and the count: ``Seal`` joins what it proves
# into one buffer, and a whole answer's join is a fresh multi-MiB buffer (page faults) on
# every fetch, while a piece's stays in cache.
CHUNK_BYTES = 256 << 10


def head_aad(nonce: str, header: bytes) -> bytes:
  return b"head\x00" + nonce.encode() + b"\x00" + header


def chunk_aads(nonce: str, header: bytes, count: int) -> list[bytes]:
  base = b"data\x00" + nonce.encode() + b"\x00" + hashlib.sha256(header).digest()
  return [base + i.to_bytes(4, "big") + count.to_bytes(4, "big") for i in range(count)]


def split_chunks(data) -> list[memoryview]:
  data = memoryview(data).cast("B")
  return [data[i:i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [data]


def piece_sizes(nbytes: int) -> list[int]:
  """The sizes of the ``CHUNK_BYTES`` pieces ``nbytes`` of blocks are tagged or sealed in
  (``split_chunks``'s)."""
  return [min(CHUNK_BYTES, nbytes - at) for at in range(0, nbytes, CHUNK_BYTES)] or [0]


def pull_aad(nonce: str) -> bytes:
  return b"pull\x00" + nonce.encode()



# ---- ZMTP: the framing under the wire, read by hand ---------------------------------------------
# ZMTP 3.1 (ZeroMQ RFC 23) with its NULL and PLAIN mechanisms (RFC 23, RFC 24): a greeting
# of 64 bytes each way (signature, version, mechanism, role), handshake commands, then
# frames: a flags byte (``MORE``: another frame of the message follows; ``LONG``: an
# 8-byte size follows, else a 1-byte one; ``COMMAND``), the size, the bytes.
#
#   client (DEALER)                              server (ROUTER)
#   greeting("PLAIN")                       <->  greeting("PLAIN", as server)
#   HELLO(user, token)                      ->   WELCOME, or ERROR("400") and closed
#   INITIATE(Socket-Type)                   ->   READY(Socket-Type)
#   (NULL, without a key: READY each way)
#   [nonce, message, auth]                  ->   [nonce, message, tags, *blocks]
MORE, LONG, COMMAND = 1, 2, 4
GREETING_BYTES = 64
MAX_COMMAND_BYTES = 4096  # a handshake's command (or a peer's ping) is small
_ZERO_COPY_BYTES = 64 << 10  # frames this large are sent from their own buffer, not copied


def greeting_bytes(mechanism: bytes, as_server: bool) -> bytes:
  """This side's greeting: signature, version 3.1, mechanism, role, filler."""
  return (b"\xff" + (1).to_bytes(8, "big") + b"\x7f\x03\x01" + mechanism.ljust(20, b"\x00")
          + bytes([as_server]) + bytes(31))


def greeting_mechanism(greeting) -> bytes | None:
  """The mechanism a peer's greeting names; None when it is no ZMTP 3 greeting."""
  if greeting[0] != 0xFF or not greeting[9] & 1 or greeting[10] < 3:
    return None
  return bytes(greeting[12:32]).rstrip(b"\x00")


def frame_head(size: int, flags: int = 0) -> bytes:
  """A frame's header: its flags and its size (one byte, or eight for a long frame)."""
  if size > 255:
    return bytes([flags | LONG]) + size.to_bytes(8, "big")
  return bytes([flags, size])


def parse_head(buf, at: int) -> tuple[int, int, int] | None:
  """``(flags, size, header bytes)`` of the frame that starts at ``buf[at]``; None until
  all of its header is there."""
  if len(buf) - at < 2:
    return None
  flags = buf[at]
  if not flags & LONG:
    return flags, buf[at + 1], 2
  if len(buf) - at < 9:
    return None
  return flags, int.from_bytes(buf[at + 1:at + 9], "big"), 9


def command_frame(name: bytes, body: bytes = b"") -> bytes:
  """A command frame, header and all."""
  data = bytes([len(name)]) + name + body
  return frame_head(len(data), COMMAND) + data


def command_parts(command) -> tuple[bytes, bytes]:
  """``(name, body)`` of a command frame's bytes."""
  n = command[0] if command else 0
  return bytes(command[1:1 + n]), bytes(command[1 + n:])


def socket_type(kind: bytes) -> bytes:
  """The metadata of a READY or INITIATE: the socket type this side plays."""
  return bytes([11]) + b"Socket-Type" + len(kind).to_bytes(4, "big") + kind



def encoded(frames) -> list:
  """``frames``, one message, as ZMTP bytes in as few pieces as a zero-copy send allows:
  the headers and small frames joined, each large frame a piece of its own (not copied).
  No piece is empty (an empty send closes a STREAM connection)."""
  out, small = [], bytearray()
  for i, frame in enumerate(frames):
    frame = memoryview(frame).cast("B")
    small += frame_head(len(frame), MORE if i < len(frames) - 1 else 0)
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
# ``CHUNK_BYTES`` piece of the blocks; empty without a key) and, for an inline ``Offer``,
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
_INDICES = _Rule(f"a list of at most {MAX_FETCH_BLOCKS} increasing integers >= 0",
                 lambda v: isinstance(v, tuple) and len(v) <= MAX_FETCH_BLOCKS
                 and all(_is_int(d) and d >= 0 for d in v)
                 and all(a < b for a, b in zip(v, v[1:])), from_json=tuple)
_GROUP = _Rule("0 (the blocks) or 1 (the window group's)", lambda v: _is_int(v) and v in (0, 1))


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
                        f"{f.metadata['rule'].what}.", nonce=readable_nonce(self.nonce))

  def encode(self) -> bytes:
    """The message as it travels (JSON, UTF-8)."""
    body = {f.name: f.metadata["rule"].to_json(getattr(self, f.name))
            for f in dataclasses.fields(self)}
    return json.dumps({"op": self.OP, "protocol": PROTOCOL, **body}).encode()


def readable_nonce(nonce) -> str:
  return nonce if _NONCE.holds(nonce) else ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hello(_Message):
  """Client: asks for the challenge its requests' MACs cover (once per connection)."""

  OP: ClassVar[str] = "hello"
  nonce: str = _field(_NONCE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lookup(_Message):
  """Client: how long a prefix of ``keys`` does the peer hold (on one data shard)? With
  ``windows`` (a model with a window group): and which of the last two windows' blocks of
  that prefix have their window KV there too?"""

  OP: ClassVar[str] = "lookup"
  nonce: str = _field(_NONCE)
  fingerprint: str = _field(_TEXT)  # hex of the cache's model/layout fingerprint
  keys: tuple[bytes, ...] = _field(_keys_rule(MAX_KEYS))
  windows: bool = _field(_BOOL, False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchBlocks(_Message):
  """Client: send these blocks (all of them, or a refusal), ``transport`` as asked,
  ``sealed`` (encrypted) when asked; the client waits ``wait_ms`` at most (a transfer
  offer expires then)."""

  OP: ClassVar[str] = "fetch"
  nonce: str = _field(_NONCE)
  fingerprint: str = _field(_TEXT)
  keys: tuple[bytes, ...] = _field(_keys_rule(MAX_FETCH_BLOCKS))
  token: str = _field(_NONCE)  # repeated in the offer: binds it to this request
  transport: str = _field(_TRANSPORT)
  sealed: bool = _field(_BOOL)
  wait_ms: int = _field(_COUNT)
  group: int = _field(_GROUP, 0)  # 1: the blocks' window KV (the window layers' K and V)


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
  """Server, to ``Lookup``: how many leading keys it holds; asked for ``windows``, the
  indices (into the keys) of the blocks among the last two windows' of that prefix whose
  window KV it holds too."""

  OP: ClassVar[str] = "have"
  nonce: str = _field(_NONCE)
  have: int = _field(_COUNT)
  windows: tuple[int, ...] = _field(_INDICES, ())


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
  keys: tuple[bytes, ...] = _field(_keys_rule(MAX_FETCH_BLOCKS))
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
ANSWER_TO = {Hello: Welcome, Lookup: Have, FetchBlocks: Offer}


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
  nonce = readable_nonce(msg.get("nonce"))
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

