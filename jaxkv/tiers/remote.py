"""REMOTE tier: blocks held by another job, asked for and carried over ZeroMQ.

Two parts, in two processes:
- ``BlockServer`` runs in the job that holds the blocks (a serving peer with spare memory).
  It binds a ZeroMQ ROUTER socket and answers on the serving job's own thread, in
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

Authentication (``jaxkv.security``), when the serving cache has a deployment key:
- **Connections.** The server takes a connection only after a ZeroMQ PLAIN handshake whose
  password is a token derived from the key (``_handshake_token``), checked by the server's
  ZAP handler (``_Gatekeeper``); libzmq queues nothing from a connection before its
  handshake passes. This is what bounds the memory a client without the key can cost:
  ZeroMQ caps each *frame* (``MAXMSGSIZE``) and counts whole *messages* against the
  receive high-water mark, delivering a multipart message at once, so without it one
  message of thousands of maximal frames, on each of any number of connections, would be
  queued before ``poll`` saw its frame count. What it stops: a client off the path without
  the key can no longer open a connection that queues anything (a wrong token is refused
  in the handshake and counted, ``BlockServer.handshakes_refused``; the client sees the
  refusal at once: a counted "refused" miss, not a wait for its deadline). What it does
  not: PLAIN is not encrypted, so whoever reads the traffic learns the token and can
  connect and queue messages: an attacker on the path, who can cut the traffic anyway.
  Against them the checks below stay the second line. (CURVE would hide the token, but
  encrypts every byte of the data path too.) A keyless server has no handshake: anyone
  who reaches it connects; it is loopback-only unless ``allow_insecure``.
- **Requests.** A client asks once per connection for a challenge (``Hello``: the only
  request answered without the key) and sends ``HMAC(key, challenge, request)`` with each
  request; the server answers only those. Others get an "unauthenticated" refusal
  (counted in ``BlockServer.refused``) and no answer to what they asked: not which blocks
  the server holds, nor anything of them. (They do learn that it holds a key: the
  handshake asks for a token, a ``Welcome`` carries a tag, and the refusal says why.) The
  challenge is *stateless*: ``<epoch>-HMAC(server secret, routing id, epoch)``, a
  server-local random secret, so the server keeps nothing per connection before a request
  is authenticated and no flood of hellos can push a peer's challenge out. A challenge
  holds for the epoch it was made in and the next (``challenge_epoch_s``, 60 s: one more
  hello round trip per connection a minute). After authentication the server remembers
  the (challenge, nonce) of the last ``max_remembered_nonces`` requests and refuses a
  repeat ("replay", counted): a request recorded on the path is answered once, not
  re-injected to fill the transfer offers, unless that many authenticated requests came
  after it within its challenge's two epochs (then it is forgotten, and may be answered
  again on the connection it was made for, until its challenge expires).
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
reader checks keys, dtype, shape and frame length before looking at the bytes and the tag
or CRC, and rejects the whole fetch on any mismatch. It caps what it reads (a header of
``_MAX_HEADER_BYTES``, frames of at most the largest answer it can expect), and any answer
that breaks the protocol is a counted miss (``RemoteClient.failures_by_reason``), never an
exception. Answers to an earlier request that timed out are told apart by their nonce and
dropped. Every wait has the reader's deadline; a late, refused or broken fetch is a miss
and the request recomputes. A peer that keeps failing trips a circuit breaker and is not
asked again until its cool-down has passed.

What the server never owes: a ``poll`` answers at most ``max_messages_per_poll`` messages,
no peer more than ``max_messages_per_peer`` of them (the rest of its messages that poll
are shed: a well-behaved client has one request in flight), stops reading
``poll_overrun_s`` after its timeout, and stops once the blocks it answered with pass
``max_answer_bytes_per_poll`` (a fetch is answered whole, so a poll overruns that by at
most one fetch: up to ``_MAX_FETCH_BLOCKS`` blocks); requests are capped in size (block
keys only) and frame count; transfer offers are bounded in number and bytes and expire
(``offer_ttl_s``, or the client's own wait, whichever is shorter).

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
import threading
import time
from collections.abc import Callable
from typing import Any, ClassVar

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np
import zmq
from zmq.utils import monitor as zmq_monitor

from jaxkv import buckets
from jaxkv import pages as pages_lib
from jaxkv import security
from jaxkv.config import REMOTE_TRANSPORTS as TRANSPORTS
from jaxkv.distributed import to_host
from jaxkv.index import Tier
from jaxkv.tiers.base import Breaker, Failure, Fetch, FetchOutcome
from jaxkv.errors import InputError, InvariantError

PROTOCOL = 5  # 5: stateless challenges; answers tagged over header and data; sealed blocks
_MAX_KEYS = 16384  # block keys one lookup asks about (256k tokens at 16 a page)
_MAX_FETCH_BLOCKS = 512  # blocks one fetch brings (``RemoteTier`` splits longer runs)
# A request is block keys only: 64 hex digits, quotes and a comma each, and a few fields.
_MAX_REQUEST_BYTES = _MAX_KEYS * 68 + 4096
_MAX_HELLO_BYTES = 1024  # the one request read without the key is small
# An answer's header names at most one fetch's keys (an offer repeats them).
_MAX_HEADER_BYTES = 64 << 10
_KEYLESS_FIX = ("set a deployment key on every job (--deployment_key_file or "
                "$JAXKV_DEPLOYMENT_KEY_FILE)")
_MAX_TRANSFER_CONNECTIONS = 4  # a client's transfer connections (to its one peer's host)
_HANDSHAKE_USER = b"jaxkv"  # the PLAIN user name of a keyed connection; the token is its password
_ZAP_DOMAIN = b"jaxkv"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


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


def _pull_aad(nonce: str) -> bytes:
  return b"pull\x00" + nonce.encode()


# ---- the handshake: who may connect at all ------------------------------------------------------
def _handshake_token(key: bytes) -> bytes:
  """The PLAIN password of a keyed connection. It crosses the network in clear, so it is a
  derivation of the key made for this use alone: knowing it proves nothing else."""
  return hmac.new(key, b"jaxkv-zmq-handshake", hashlib.sha256).hexdigest().encode()


class _Gatekeeper:
  """The ZAP handler (ZeroMQ RFC 27) of one keyed server's ZeroMQ context: libzmq asks it,
  during each connection's handshake, whether the PLAIN credentials pass, and queues
  nothing from the connection until they do. It passes the key's handshake token only
  (compared in constant time, never logged) and counts the rest (``refused``).

  It answers on its own thread: a handshake must not wait for the serving thread's next
  ``poll``. (pyzmq's ``ThreadAuthenticator`` does the same job, but compares passwords with
  ``==`` and logs accepted ones at debug level.) ``close`` ends the thread."""

  def __init__(self, context: zmq.Context, token: bytes):
    self.refused = 0
    self._token = token
    # Bound here, before the server's socket is: a PLAIN handshake without a handler fails.
    zap = context.socket(zmq.REP)
    zap.setsockopt(zmq.LINGER, 0)
    zap.bind("inproc://zeromq.zap.01")
    wake = f"inproc://jaxkv-gatekeeper-{secrets.token_hex(8)}"
    self._stop = context.socket(zmq.PAIR)
    self._stop.setsockopt(zmq.LINGER, 0)
    self._stop.bind(wake)
    woken = context.socket(zmq.PAIR)
    woken.setsockopt(zmq.LINGER, 0)
    woken.connect(wake)
    # Both sockets belong to the thread from here on (its start is the memory barrier
    # ZeroMQ asks for when a socket changes threads).
    self._thread = threading.Thread(target=self._run, args=(zap, woken), daemon=True,
                                    name="jaxkv-zap")
    self._thread.start()

  def _run(self, zap, woken) -> None:
    poller = zmq.Poller()
    poller.register(zap, zmq.POLLIN)
    poller.register(woken, zmq.POLLIN)
    try:
      while woken not in dict(poller.poll()):
        zap.send_multipart(self._answer(zap.recv_multipart()))
    finally:
      zap.close(0)
      woken.close(0)

  def _answer(self, request: list[bytes]) -> list[bytes]:
    """The ZAP reply to ``[version, request id, domain, address, routing id, mechanism,
    user, password]``: 200 for the token, 400 for anything else."""
    passed = (len(request) == 8 and request[0] == b"1.0" and request[5] == b"PLAIN"
              and request[6] == _HANDSHAKE_USER and hmac.compare_digest(request[7], self._token))
    if not passed:
      self.refused += 1  # this thread's alone: no other writes it
    request_id = request[1] if len(request) > 1 else b""
    if passed:
      return [b"1.0", request_id, b"200", b"OK", _HANDSHAKE_USER, b""]
    return [b"1.0", request_id, b"400", b"not this deployment's key", b"", b""]

  def close(self) -> None:
    if self._thread.is_alive():
      self._stop.send(b"")
      self._thread.join()
    self._stop.close(0)


# ---- the wire: every message, its fields and their rules, in one place --------------------------
# A request travels as three frames: its nonce, the message (one JSON object,
# ``{"op": <kind>, "protocol": PROTOCOL, <fields>}``) and its authentication
# (``"<challenge> <HMAC hex>"``, empty for a hello or without a key). An answer travels as
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
class BlockServer:
  """Serves the device and host blocks of ``cache`` (a ``jaxkv.KVCache``) to other jobs.

  Requests are answered only inside ``poll``/``serve``, on the calling thread (one thread
  at a time), within a budget per poll (the attributes below; a test or an operator may
  set them on an instance). Each request is checked (frames, nonce, authentication)
  before it is parsed (``decode``), then answered by ``reply``; a fetch's blocks are
  gathered once and handed to ``ship``, which sends them the way the client asked. Every
  failure on the way is a ``Refusal``, never a crash.

  With a deployment key only connections that pass the handshake (``_Gatekeeper``) reach
  it at all. Without one the server answers anyone who reaches it: bound to a
  non-loopback ``host`` it refuses to start unless ``allow_insecure``, and it logs that it
  is insecure in any case. ``counts`` tells what it did (answered, unauthenticated,
  replay, shed, malformed, offers refused for the bound); ``handshakes_refused``, how many
  connections it turned away before reading a byte of theirs. ``close`` it: it owns a
  ZeroMQ context and, with a key, the handshake's thread.
  """

  max_messages_per_poll = 64  # messages one ``poll`` reads, answered or shed
  max_messages_per_peer = 16  # answered for one routing id in one ``poll``; the rest shed
  poll_overrun_s = 0.005  # reading stops this long after ``poll``'s timeout
  max_answer_bytes_per_poll = 64 << 20  # ... or once its answers' blocks pass this
  challenge_epoch_s = 60.0  # a challenge holds for its epoch and the next one
  max_offers = 256  # transfer offers outstanding (not yet expired) ...
  max_offer_bytes = 1 << 30  # ... and their device bytes
  offer_ttl_s = 30.0  # the longest a transfer offer stands (the client's wait, if shorter)
  max_remembered_nonces = 4096  # authenticated requests remembered, to refuse their replays

  def __init__(self, cache, host: str = "127.0.0.1", port: int = 0, *,
               allow_insecure: bool = False):
    self.cache = cache
    self._key = cache._deployment_key  # pylint: disable=protected-access
    if self._key is None:
      if not security.is_loopback(host) and not allow_insecure:
        raise InputError(f"BlockServer on {host}:{port} has no deployment key: anyone who "
                         "reaches it could test which prompts were served and pull their KV. "
                         f"Fix: {_KEYLESS_FIX}; or pass allow_insecure=True "
                         "(--allow_insecure) on an isolated network.")
      security.warn_insecure("the block server answers anyone, without a deployment key "
                             "(its answers carry a CRC-32C only)", _KEYLESS_FIX)
    self._seal = security.Seal(self._key, "remote-answer") if self._key is not None else None
    self._challenge_secret = secrets.token_bytes(32)  # this process's: no state per peer
    self.counts: collections.Counter = collections.Counter()
    self._offers: list[tuple[float, int]] = []  # (expiry, bytes) of outstanding offers
    # (challenge, nonce) -> challenge epoch of authenticated requests, oldest first.
    self._answered: collections.OrderedDict = collections.OrderedDict()
    self._transfer = None
    self._context = zmq.Context()  # its own: the handshake's handler is per context
    self._gatekeeper = None
    self._socket = None
    try:
      self._socket = self._context.socket(zmq.ROUTER)
      self._socket.setsockopt(zmq.LINGER, 0)
      self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)  # per frame: zmq disconnects
      self._socket.setsockopt(zmq.RCVHWM, 4 * self.max_messages_per_peer)  # per connection
      self._socket.setsockopt(zmq.SNDHWM, 4 * self.max_messages_per_peer)  # beyond: dropped
      if self._key is not None:  # before binding: no connection is ever taken without it
        self._gatekeeper = _Gatekeeper(self._context, _handshake_token(self._key))
        self._socket.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
        self._socket.setsockopt(zmq.PLAIN_SERVER, 1)
      if port:
        self._socket.bind(f"tcp://{host}:{port}")
      else:
        port = self._socket.bind_to_random_port(f"tcp://{host}")
    except BaseException:  # e.g. the port is taken: leave no thread or socket behind
      if self._gatekeeper is not None:
        self._gatekeeper.close()
      self._context.destroy(linger=0)
      raise
    self.address = f"{host}:{port}"

  @property
  def refused(self) -> int:
    """Requests refused for a missing or wrong MAC (or an unknown challenge)."""
    return self.counts["unauthenticated"]

  @property
  def handshakes_refused(self) -> int:
    """Connections turned away in the handshake (a wrong token), before anything of theirs
    was queued. A client without any credentials fails earlier still (its handshake
    offers no PLAIN at all) and is not counted here."""
    return self._gatekeeper.refused if self._gatekeeper is not None else 0

  def poll(self, timeout_s: float = 0.0) -> int:
    """Answers requests that arrive within ``timeout_s``, at most ``max_messages_per_poll``
    of them read and ``max_messages_per_peer`` answered per routing id (ZeroMQ reads the
    connections in turn; a peer's messages beyond its share are shed, counted), and none
    once its answers' blocks pass ``max_answer_bytes_per_poll``. Returns how many it
    answered; messages left waiting are read by the next poll."""
    answered = read = answered_bytes = 0
    per_peer: collections.Counter = collections.Counter()
    deadline = time.monotonic() + timeout_s
    stop = deadline + self.poll_overrun_s
    while read < self.max_messages_per_poll and answered_bytes <= self.max_answer_bytes_per_poll:
      now = time.monotonic()
      if now >= stop or not self._socket.poll(max(0, int((deadline - now) * 1000))):
        break
      frames = self._socket.recv_multipart(copy=False)
      read += 1
      peer = frames[0].bytes
      per_peer[peer] += 1
      if per_peer[peer] > self.max_messages_per_peer:
        self.counts["shed"] += 1
        continue
      reply, blocks_bytes = self._handle(peer, frames[1:])
      self._socket.send_multipart([peer, *reply], copy=False)
      answered += 1
      answered_bytes += blocks_bytes
    self.counts["answered"] += answered
    return answered

  def waiting(self) -> bool:
    """Whether a message waits to be read (a ``poll`` left work for the next one)."""
    return bool(self._socket.poll(0))

  def serve(self, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
      self.poll(min(0.1, max(0.0, end - time.monotonic())))

  def close(self) -> None:
    if self._socket is not None:
      self._socket.close(0)
    if self._gatekeeper is not None:
      self._gatekeeper.close()
    self._context.term()

  # ---- challenges: recomputed, never stored ------------------------------------------------
  def _epoch(self) -> int:
    return int(time.monotonic() // self.challenge_epoch_s)

  def _challenge(self, peer: bytes, epoch: int) -> str:
    mac = hmac.new(self._challenge_secret, b"%d\x00" % epoch + peer, hashlib.sha256)
    return f"{epoch}-{mac.hexdigest()[:32]}"

  def _authentic(self, peer: bytes, body: bytes, auth: bytes) -> bool:
    """Whether ``auth`` holds a challenge this server made for ``peer`` (this epoch or the
    last) and the key's MAC over it and ``body``."""
    challenge, _, mac = auth.decode("ascii", "replace").partition(" ")
    epoch, _, _ = challenge.partition("-")
    if not (epoch.isdigit() and len(epoch) <= 15):
      return False
    now = self._epoch()
    return (int(epoch) in (now, now - 1)
            and hmac.compare_digest(self._challenge(peer, int(epoch)), challenge)
            and security.mac_ok(self._key, challenge, body, mac))

  def _first_time(self, challenge: str, nonce: str) -> bool:
    """Whether an authenticated request under ``challenge`` with ``nonce`` is new (and from
    now on remembered): a repeat is a replay. Remembers the last ``max_remembered_nonces``,
    dropping first those whose challenge has expired (a replay of those is refused as
    unauthenticated anyway)."""
    seen = (challenge, nonce)
    if seen in self._answered:
      return False
    oldest = self._epoch() - 1
    while self._answered and (len(self._answered) >= self.max_remembered_nonces
                              or next(iter(self._answered.values())) < oldest):
      self._answered.popitem(last=False)
    self._answered[seen] = int(challenge.partition("-")[0])
    return True

  # ---- one request --------------------------------------------------------------------------
  def _handle(self, peer: bytes, frames: list) -> tuple[list, int]:
    """The reply frames ``[nonce, answer, tag, *data]`` to one request
    ``[nonce, message, auth]``, and the bytes of the blocks it answers with (for the
    poll's budget): checked from the cheapest test on, parsed only once authenticated (a
    hello excepted)."""
    nonce = ""
    sealed = False
    try:
      nonce = _readable_nonce(frames[0].bytes[:65].decode("ascii", "replace") if frames else "")
      if len(frames) != 3:
        raise WireError(f"a request has 3 frames (nonce, message, auth), not {len(frames)}")
      body, auth = frames[1].bytes, frames[2].bytes
      if self._key is not None and (auth or len(body) > _MAX_HELLO_BYTES) and not (
          auth and self._authentic(peer, body, auth)):
        answer, data = self._refuse_unauthenticated(nonce), []
      else:
        request = decode(body, REQUESTS)
        if request.nonce != nonce:
          raise WireError(f"the message's nonce {request.nonce!r} is not its frame's", nonce)
        if isinstance(request, Hello):
          self.counts["hello"] += 1
          answer, data = Welcome(nonce=nonce, challenge=self._challenge(peer, self._epoch()),
                                 valid_ms=int(self.challenge_epoch_s * 1000)), []
        elif self._key is not None and not auth:
          answer, data = self._refuse_unauthenticated(nonce), []
        elif self._key is not None and not self._first_time(
            auth.decode("ascii", "replace").partition(" ")[0], request.nonce):
          self.counts["replay"] += 1
          answer, data = Refusal(nonce=nonce, error="replay: a request this server has "
                                 "already answered (the same challenge and nonce)"), []
        else:
          answer, data = self.reply(request)
          sealed = isinstance(answer, Offer) and answer.sealed
    except InvariantError:  # our own bookkeeping broke: a bug, not the peer's problem
      raise
    except Exception as e:  # pylint: disable=broad-except  (answer, never crash)
      self.counts["malformed"] += 1
      answer, data = Refusal(nonce=getattr(e, "nonce", nonce) or nonce,
                             error=f"{type(e).__name__}: {str(e)[:200]}"), []
    header = answer.encode()
    nonce = answer.nonce  # an answer is about the request it names
    blocks_bytes = (int(np.prod(answer.shape)) * np.dtype(answer.dtype).itemsize
                    if isinstance(answer, Offer) else 0)
    if self._seal is None:
      return [nonce.encode(), header, b"", *data], blocks_bytes
    tag = self._seal.tag(_head_aad(nonce, header))
    if not data:
      return [nonce.encode(), header, tag], blocks_bytes
    chunks = _chunks(data[0])
    aads = _chunk_aads(nonce, header, len(chunks))
    if sealed:  # a frame per sealed piece: no buffer of the whole answer is made
      return [nonce.encode(), header, tag, *map(self._seal.seal, aads, chunks)], blocks_bytes
    return [nonce.encode(), header, b"".join([tag, *map(self._seal.tag, aads, chunks)]),
            data[0]], blocks_bytes

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


class RemoteClient:
  """Fetches blocks from one peer, with deadlines and a circuit breaker.

  ``secret``: the deployment key (the peer must have the same); ``encrypt``: ask for
  sealed blocks and refuse plaintext ones (needs the key). With a key, each connection
  opens with the handshake's token (``_handshake_token``); a peer that refuses the
  handshake (another key, or none) is a "refused" miss as soon as it says so. Whatever
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
    self._max_frame_bytes = _MAX_HEADER_BYTES  # until ``expect`` sizes the blocks frame
    self._context = zmq.Context.instance()
    self._token = _handshake_token(self._secret) if self._secret is not None else None
    self._sock = None
    self._monitor = None  # the socket's handshake failures, as ZeroMQ reports them
    self._poller = None  # the socket and its monitor
    self._transfer_server = None
    # transfer address -> connection, least recently used first (``_MAX_TRANSFER_CONNECTIONS``)
    self._connections: collections.OrderedDict = collections.OrderedDict()

  @property
  def available(self) -> bool:
    return self.breaker.available

  def expect(self, payload_shape, dtype) -> None:
    """Sizes the largest frame this client reads (ZeroMQ drops a connection that sends a
    bigger one): one fetch's blocks inline (sealed ones come in smaller pieces), else an
    answer header. Set before the first connection (``RemoteTier`` does); a change
    re-makes the connection."""
    block = int(np.prod(payload_shape)) * np.dtype(pages_lib.bits_dtype(dtype)).itemsize
    most = _MAX_HEADER_BYTES
    if self.transport == "inline":
      most = max(most, _MAX_FETCH_BLOCKS * block + security.Seal.OVERHEAD)
    if most != self._max_frame_bytes:
      self._max_frame_bytes = most
      self._close()

  def _failed(self, reason: Failure, close: bool = True) -> Failure:
    self.failures_by_reason[reason.value] += 1
    if close:
      self.breaker.record(False)
      self._close()
    return reason

  def _close(self) -> None:
    if self._sock is not None:
      self._sock.disable_monitor()
      self._monitor.close(0)
      self._sock.close(0)
    self._sock = self._monitor = self._poller = None
    self._challenge = ""

  def _exchange(self, request, deadline: float) -> tuple[Any, list]:
    """Sends one request and waits (until ``deadline``) for the answer to it: the answer
    its kind expects (``Refusal`` raises ``RemoteError``), and its data frames (opened,
    when sealed). With a key, the answer's tag is checked before anything of it is parsed;
    an answer that breaks the protocol raises ``RemoteError("malformed")``."""
    body = request.encode()
    auth = b""
    if self._secret is not None and not isinstance(request, Hello):
      auth = f"{self._challenge} {security.challenge_mac(self._secret, self._challenge, body)}"
      auth = auth.encode("ascii")
    nonce = request.nonce.encode()
    self._sock.send_multipart([nonce, body, auth], flags=zmq.NOBLOCK)
    sealed = isinstance(request, FetchBlocks) and request.sealed
    while True:
      wait_ms = int((deadline - time.monotonic()) * 1000)
      ready = dict(self._poller.poll(wait_ms)) if wait_ms > 0 else {}
      if self._monitor in ready:
        event = zmq_monitor.recv_monitor_message(self._monitor)
        raise RemoteError("refused", f"peer {self.address} refused this connection's "
                          f"handshake ({zmq.Event(event['event']).name}): the two jobs do not "
                          "hold the same deployment key, or only one of them has one")
      if self._sock not in ready:
        raise RemoteError("deadline", f"peer {self.address} did not answer in time")
      frames = self._sock.recv_multipart(copy=False)
      if frames[0].bytes != nonce:  # to an earlier request that timed out, or junk: unread
        self.stale_answers += 1
        continue
      most = 4 if not sealed else 3 + -(-self._max_frame_bytes // _CHUNK_BYTES)
      if not 3 <= len(frames) <= most:
        raise RemoteError("malformed", f"an answer of {len(frames)} frames, not 3 to {most}")
      header, tag = frames[1].bytes, frames[2].bytes
      if len(header) > _MAX_HEADER_BYTES:
        raise RemoteError("malformed", f"an answer header of {len(header)} bytes (at most "
                          f"{_MAX_HEADER_BYTES})")
      data = [f.buffer for f in frames[3:]]
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
    if self._sock is None:
      self._sock = self._context.socket(zmq.DEALER)
      self._sock.setsockopt(zmq.LINGER, 0)
      self._sock.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes)
      self._sock.setsockopt(zmq.RCVHWM, 16)
      self._sock.setsockopt(zmq.SNDHWM, 16)
      if self._token is not None:
        self._sock.setsockopt(zmq.PLAIN_USERNAME, _HANDSHAKE_USER)
        self._sock.setsockopt(zmq.PLAIN_PASSWORD, self._token)
      self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED)
      self._poller = zmq.Poller()
      self._poller.register(self._sock, zmq.POLLIN)
      self._poller.register(self._monitor, zmq.POLLIN)
      self._sock.connect(f"tcp://{self.host}:{self.port}")
    welcome, _ = self._exchange(Hello(nonce=_nonce()), deadline)
    self.hellos += 1
    self._challenge = welcome.challenge
    self._challenge_until = time.monotonic() + welcome.valid_ms / 1000

  def _call(self, request: Lookup | FetchBlocks, deadline: float) -> tuple[Any, list]:
    """``request``'s answer; a connection gets its challenge first, again once it expires,
    and once more when the peer no longer takes it (a re-made connection)."""
    for attempt in range(2):
      if self._sock is None or not self._challenge or time.monotonic() >= self._challenge_until:
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
