"""REMOTE tier: blocks held by another job, asked for and carried over ZeroMQ.

Two parts, in two processes:
- ``BlockServer`` runs in the job that holds the blocks (a serving peer with spare memory).
  It binds a ZeroMQ ROUTER socket and answers on the serving job's own thread, in
  ``serve``/``poll``: a request is only read when that thread is between steps, so
  gathering blocks never races the engine's donated pools, and the server needs no thread.
- ``RemoteClient`` runs in the job that wants them (``TierConfig.remote_peers``). It asks
  how long a prefix of block keys the peer holds (``lookup``), then for the blocks
  (``fetch``): one round trip, the blocks travelling in the answer itself as one zero-copy
  frame after the signed header. ``transport="transfer"`` instead has the answer carry a
  ``jax.experimental.transfer`` offer that the client pulls (device to device where that
  library has a direct path; on CPU it is slower than the inline frame).

The wire: every message either side sends is one frozen dataclass of this module
(``Hello``, ``Lookup``, ``FetchBlocks``; ``Welcome``, ``Have``, ``Offer``, ``Refusal``), built
and checked in one place ("the wire" below). Each field has a rule, enforced whether the
message was built here or decoded off the socket (``decode``), so neither side handles a
dict, and a peer's malformed message is a ``WireError`` naming the field and the rule.

Authentication (``jaxkv.security``): when the serving cache has a deployment key, the server
gives each connection a random challenge (a ``hello`` round trip, once per connection) and
answers only requests that carry ``HMAC(key, challenge, request)``; others get an
"unauthenticated" refusal and are counted (``BlockServer.refused``). Its answers carry
``HMAC(key, nonce, header)`` over the client's per-request nonce, so a client with the key
also refuses a server without it. A server without a key answers anyone (keep it on a
private network).

What the reader never trusts: every answer names its block keys, dtype and shape, and
carries a CRC-32C of the blocks computed by the owner from the bytes it sends (inside the
signed header); the reader checks keys, dtype, shape and frame length before looking at the
bytes and the CRC after, and rejects the whole fetch on any mismatch (CRC-32C
catches damage at ~10x the speed of SHA-256; the block keys themselves stay SHA-256 chains).
Answers to an earlier request that timed out are told apart by their nonce and dropped.
Every wait has the reader's deadline; a late, refused or broken fetch is a miss and the
request recomputes. A peer that keeps failing trips a circuit breaker and is not asked
again until its cool-down has passed.
"""

from __future__ import annotations

import collections
import dataclasses
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

from jaxkv import buckets
from jaxkv import pages as pages_lib
from jaxkv import security
from jaxkv.config import REMOTE_TRANSPORTS as TRANSPORTS
from jaxkv.distributed import to_host
from jaxkv.index import Tier
from jaxkv.tiers.base import Breaker, Failure, Fetch, FetchOutcome
from jaxkv.errors import InputError, InvariantError

PROTOCOL = 4  # 4: every message one schema (``Hello`` ... ``Refusal``), named by its "op"
_MAX_REQUEST_BYTES = 16 << 20  # a request carries block keys only
_MAX_CHALLENGES = 4096  # connections remembered by the server (oldest forgotten first)


class RemoteError(RuntimeError):
  """A remote fetch that cannot be used; ``reason`` says how (a ``base.Failure``)."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = Failure(reason)


def _digest(stack: np.ndarray) -> int:
  return google_crc32c.value(np.ascontiguousarray(stack).reshape(-1).view(np.uint8))


def _nonce() -> str:
  return secrets.token_hex(16)


# ---- the wire: every message, its fields and their rules, in one place --------------------------
# A message travels as one JSON object: ``{"op": <kind>, "protocol": PROTOCOL, <fields>}``,
# followed by a MAC frame and, for an inline ``Offer``, one frame of block bits. Client and
# server build and read messages only through these classes: a value that breaks a field's
# rule raises ``WireError`` on either side, whether it was built here or came off the wire.
#
#   client                                   server
#   Hello(nonce)                        ->   Welcome(nonce, challenge)    once per connection
#   Lookup(nonce, fingerprint, keys)    ->   Have(nonce, have)
#   FetchBlocks(nonce, fingerprint,     ->   Offer(nonce, keys, dtype, shape, crc32c, token,
#               keys, token, transport)            [transfer_id, transfer_address])
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


# A nonce is empty only in a refusal of a request whose own nonce could not be read.
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{0,64}")
_NONCE = _Rule("at most 64 ASCII letters, digits, '-' or '_'",
               lambda v: isinstance(v, str) and _TOKEN_RE.fullmatch(v) is not None)
_TEXT = _Rule("a string", lambda v: isinstance(v, str))
_COUNT = _Rule("an integer >= 0", lambda v: _is_int(v) and v >= 0)
_KEYS = _Rule("a list of 32-byte block keys (hex on the wire)",
              lambda v: isinstance(v, tuple) and all(isinstance(k, bytes) and len(k) == 32
                                                     for k in v),
              to_json=lambda v: [k.hex() for k in v],
              from_json=lambda v: tuple(bytes.fromhex(k) for k in v))
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
  """Client: asks for the connection's challenge (once per connection)."""

  OP: ClassVar[str] = "hello"
  nonce: str = _field(_NONCE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Lookup(_Message):
  """Client: how long a prefix of ``keys`` does the peer hold (on one data shard)?"""

  OP: ClassVar[str] = "lookup"
  nonce: str = _field(_NONCE)
  fingerprint: str = _field(_TEXT)  # hex of the cache's model/layout fingerprint
  keys: tuple[bytes, ...] = _field(_KEYS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FetchBlocks(_Message):
  """Client: send these blocks (all of them, or a refusal), ``transport`` as asked."""

  OP: ClassVar[str] = "fetch"
  nonce: str = _field(_NONCE)
  fingerprint: str = _field(_TEXT)
  keys: tuple[bytes, ...] = _field(_KEYS)
  token: str = _field(_NONCE)  # repeated in the offer: binds it to this request
  transport: str = _field(_TRANSPORT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Welcome(_Message):
  """Server, to ``Hello``: the challenge that this connection's request MACs cover."""

  OP: ClassVar[str] = "welcome"
  nonce: str = _field(_NONCE)
  challenge: str = _field(_NONCE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Have(_Message):
  """Server, to ``Lookup``: how many leading keys it holds."""

  OP: ClassVar[str] = "have"
  nonce: str = _field(_NONCE)
  have: int = _field(_COUNT)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Offer(_Message):
  """Server, to ``FetchBlocks``: what it sends — ``keys``' raw bits ``dtype[shape]``
  (``[blocks, 2 * layers, kv_heads, page_size, head_dim]``) and their CRC-32C, computed
  from the bytes it sends. Inline, the bits follow as one frame; with the transfer
  transport, the client pulls ``transfer_id`` from ``transfer_address``."""

  OP: ClassVar[str] = "offer"
  nonce: str = _field(_NONCE)
  keys: tuple[bytes, ...] = _field(_KEYS)
  dtype: str = _field(_TEXT)
  shape: tuple[int, ...] = _field(_SHAPE)
  crc32c: int = _field(_COUNT)
  token: str = _field(_NONCE)
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


def decode(data: bytes, kinds: tuple[type, ...]):
  """The message ``data`` holds, one of ``kinds`` (``REQUESTS`` on the server, ``ANSWERS``
  on the client). Raises ``WireError`` naming what breaks the schema."""
  try:
    msg = json.loads(data)
  except (ValueError, UnicodeDecodeError) as e:
    raise WireError(f"a message must be a JSON object, this is not JSON "
                    f"({type(e).__name__}: {e})") from None
  if not isinstance(msg, dict):
    raise WireError(f"a message must be a JSON object, not {type(msg).__name__}")
  nonce = _readable_nonce(msg.get("nonce"))
  if msg.get("protocol") != PROTOCOL:
    raise WireError(f"protocol {msg.get('protocol')!r} is not {PROTOCOL} (this side's); run "
                    "the same jaxkv version on both", nonce)
  by_op = {k.OP: k for k in kinds}
  kind = by_op.get(msg.get("op"))
  if kind is None:
    raise WireError(f"unknown op {msg.get('op')!r}: expected one of {sorted(by_op)}", nonce)
  fields = {f.name: f for f in dataclasses.fields(kind)}
  extra = sorted(set(msg) - set(fields) - {"op", "protocol"})
  if extra:
    raise WireError(f"{kind.__name__} has no fields {extra}; its fields are {sorted(fields)}",
                    nonce)
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
  at a time). Each request is decoded (``decode``), authenticated, then answered by
  ``reply``; a fetch's blocks are gathered once and handed to ``ship``, which sends them
  the way the client asked. Every failure on the way is a ``Refusal``, never a crash."""

  def __init__(self, cache, host: str = "127.0.0.1", port: int = 0):
    self.cache = cache
    self._key = cache._deployment_key  # pylint: disable=protected-access
    self.refused = 0  # requests refused for a missing or wrong MAC
    self._challenges: collections.OrderedDict = collections.OrderedDict()
    self._transfer = None
    self._context = zmq.Context()
    self._socket = self._context.socket(zmq.ROUTER)
    self._socket.setsockopt(zmq.LINGER, 0)
    self._socket.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
    if port:
      self._socket.bind(f"tcp://{host}:{port}")
    else:
      port = self._socket.bind_to_random_port(f"tcp://{host}")
    self.address = f"{host}:{port}"

  def poll(self, timeout_s: float = 0.0) -> int:
    """Answers the requests that arrive within ``timeout_s``; returns how many."""
    n = 0
    deadline = time.monotonic() + timeout_s
    while self._socket.poll(max(0, int((deadline - time.monotonic()) * 1000))):
      frames = self._socket.recv_multipart(copy=True)
      self._socket.send_multipart([frames[0], *self._handle(frames[0], frames[1:])],
                                  copy=False)
      n += 1
    return n

  def serve(self, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
      self.poll(min(0.1, max(0.0, end - time.monotonic())))

  def close(self) -> None:
    self._socket.close(0)
    self._context.term()

  def _handle(self, peer: bytes, frames: list[bytes]) -> list:
    """The reply frames ``[answer, mac, *data]`` to one request."""
    nonce = ""
    try:
      if len(frames) != 2:
        raise WireError(f"a request has 2 frames (message, MAC), not {len(frames)}")
      body, mac = frames
      request = decode(body, REQUESTS)
      nonce = request.nonce
      if isinstance(request, Hello):
        challenge = self._challenges[peer] = _nonce()
        while len(self._challenges) > _MAX_CHALLENGES:
          self._challenges.popitem(last=False)
        answer, data = Welcome(nonce=nonce, challenge=challenge), []
      elif self._key is not None and not security.mac_ok(
          self._key, self._challenges.get(peer, ""), body, mac.decode("ascii", "replace")):
        self.refused += 1
        answer, data = Refusal(nonce=nonce, error="unauthenticated: a wrong or missing "
                               "deployment key"), []
      else:
        answer, data = self.reply(request)
    except InvariantError:  # our own bookkeeping broke: a bug, not the peer's problem
      raise
    except Exception as e:  # pylint: disable=broad-except  (answer, never crash)
      nonce = getattr(e, "nonce", nonce)
      answer, data = Refusal(nonce=nonce, error=f"{type(e).__name__}: {e}"), []
    header = answer.encode()
    mac = (security.challenge_mac(self._key, nonce, header).encode()
           if self._key is not None else b"")
    return [header, mac, *data]

  def reply(self, request: Lookup | FetchBlocks) -> tuple[Have | Offer | Refusal, list]:
    """The answer to an authenticated request, and the data frames that follow it."""
    if request.fingerprint != self.cache.config.fingerprint().hex():
      return Refusal(nonce=request.nonce, error="fingerprint: another model or layout"), []
    where = self._where(list(request.keys))
    if isinstance(request, Lookup):
      return Have(nonce=request.nonce, have=len(where)), []
    if len(where) < len(request.keys):
      return Refusal(nonce=request.nonce, error=f"missing: holds {len(where)} of "
                     f"{len(request.keys)} blocks"), []
    stack = self._gather(where)  # [blocks, arrays, kv_heads, page_size, head_dim] bits
    offer = Offer(nonce=request.nonce, keys=request.keys, dtype=np.dtype(stack.dtype).name,
                  shape=tuple(stack.shape), crc32c=_digest(stack), token=request.token)
    return self.ship(offer, stack, request.transport)

  def ship(self, offer: Offer, stack: np.ndarray, transport: str) -> tuple[Offer, list]:
    """Sends the blocks ``offer`` describes: inline, as one zero-copy frame after it; or
    as a ``jax.experimental.transfer`` pull the offer names (served once pulled)."""
    if transport == "inline":
      return offer, [memoryview(np.ascontiguousarray(stack)).cast("B")]
    if self._transfer is None:
      import jax.experimental.transfer as transfer
      self._transfer = transfer.start_transfer_server(jax.local_devices()[0].client,
                                                      f"{self.address.rpartition(':')[0]}:0",
                                                      ["127.0.0.1:0"])
    transfer_id = secrets.randbits(63)
    self._transfer.await_pull(transfer_id, [jax.device_put(stack, jax.local_devices()[0])])
    return dataclasses.replace(offer, transfer_id=transfer_id,
                               transfer_address=self._transfer.address()), []

  def _where(self, keys: list[bytes]) -> list[tuple[int, Tier, int]]:
    """(shard, tier, slot) of the longest prefix of ``keys`` on any one shard."""
    index = self.cache.index
    best: list = []
    for s in range(self.cache.num_shards):
      found = [(s, t, slot) for t, slot in index.locate(s, keys) if t in (Tier.DEVICE, Tier.HOST)]
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
  blocks from one peer come in one ``fetch``."""

  tier = Tier.REMOTE

  def __init__(self, clients: list["RemoteClient"], payload_shape: tuple, dtype):
    self.clients, self.payload_shape, self.dtype = clients, tuple(payload_shape), dtype

  def longest_prefix(self, keys: list[bytes], local: int) -> tuple[int, int] | None:
    """``(peer, blocks)`` of the peer holding the longest prefix of ``keys``, when it is
    longer than the ``local`` blocks this job holds."""
    best = None
    if len(keys) > local:
      for i, client in enumerate(self.clients):
        n = client.lookup(keys)
        if n > local and (best is None or n > best[1]):
          best = (i, n)
    return best

  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, tuple[Fetch, ...]]:
    return None, tuple(fetches)  # a fetch waits: it runs in finish_fetch, after the recompute

  def finish_fetch(self, fetches: tuple[Fetch, ...], t_end: float, stage) -> FetchOutcome:
    """One ``fetch`` per request and peer, its blocks in chain order; a group that fails
    fails every fetch of it."""
    groups: dict = {}
    for i, f in enumerate(fetches):
      groups.setdefault((f.request, f.slot), []).append(i)
    staged, failures = [], [None] * len(fetches)
    for (_, peer), positions in groups.items():
      positions.sort(key=lambda i: fetches[i].block)
      try:
        stack = self.clients[peer].fetch([fetches[i].key for i in positions],
                                         self.payload_shape, self.dtype, t_end)
      except Exception as e:  # pylint: disable=broad-except  (any failed pull is a miss)
        for i in positions:
          failures[i] = Failure.of(e, Failure.REMOTE)
        continue
      for j, i in enumerate(positions):
        staged.append((fetches[i].shard, fetches[i].page, stack[j]))
    return FetchOutcome(stage(staged) if staged else None, tuple(failures))


class RemoteClient:
  """Fetches blocks from one peer, with deadlines and a circuit breaker."""

  def __init__(self, address: str, fingerprint: bytes, *, deadline_s: float = 5.0,
               trip_after: int = 3, cool_down_s: float = 10.0, secret: bytes | None = None,
               transport: str = "inline"):
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
    self._challenge = ""
    self._context = zmq.Context.instance()
    self._sock = None
    self._transfer_server = None
    self._connections: dict = {}

  @property
  def available(self) -> bool:
    return self.breaker.available

  def _failed(self) -> None:
    self.breaker.record(False)
    self._close()

  def _close(self) -> None:
    if self._sock is not None:
      self._sock.close(0)
    self._sock = None

  def _exchange(self, request, deadline: float) -> tuple[Any, list]:
    """Sends one request and waits (until ``deadline``) for the answer to it: the answer
    its kind expects (``Refusal`` raises ``RemoteError``), and the data frames after it."""
    body = request.encode()
    mac = (security.challenge_mac(self._secret, self._challenge, body).encode()
           if self._secret is not None and not isinstance(request, Hello) else b"")
    self._sock.send_multipart([body, mac], flags=zmq.NOBLOCK)
    while True:  # answers to earlier requests that timed out carry other nonces: dropped
      wait_ms = int((deadline - time.monotonic()) * 1000)
      if wait_ms <= 0 or not self._sock.poll(wait_ms):
        raise RemoteError("deadline", f"peer {self.address} did not answer in time")
      frames = self._sock.recv_multipart(copy=False)
      if len(frames) < 2:
        raise RemoteError("refused", f"an answer of {len(frames)} frames")
      header = frames[0].bytes
      try:
        answer = decode(header, ANSWERS)
      except WireError as e:
        raise RemoteError("refused", f"the peer's answer breaks the protocol: {e}") from None
      if answer.nonce != request.nonce:
        continue
      if self._secret is not None and not security.mac_ok(
          self._secret, request.nonce, header, frames[1].bytes.decode("ascii", "replace")):
        raise RemoteError("refused", "the peer's answer is not signed with this deployment key")
      if isinstance(answer, Refusal):
        raise RemoteError("refused", answer.error)
      if not isinstance(answer, _ANSWER_TO[type(request)]):
        raise RemoteError("refused", f"a {type(answer).__name__} answering a "
                          f"{type(request).__name__}")
      return answer, frames[2:]

  def _call(self, request: Lookup | FetchBlocks, deadline: float) -> tuple[Any, list]:
    """``request``'s answer; the first call on a connection gets its challenge first."""
    if self._sock is None:
      self._sock = self._context.socket(zmq.DEALER)
      self._sock.setsockopt(zmq.LINGER, 0)
      self._sock.connect(f"tcp://{self.host}:{self.port}")
      welcome, _ = self._exchange(Hello(nonce=_nonce()), deadline)
      self._challenge = welcome.challenge
    return self._exchange(request, deadline)

  def lookup(self, keys: list[bytes]) -> int:
    """How many leading ``keys`` the peer holds (0 when it cannot be asked)."""
    if not keys or not self.available:
      return 0
    try:
      have, _ = self._call(Lookup(nonce=_nonce(), fingerprint=self.fingerprint,
                                  keys=tuple(keys)), time.monotonic() + min(self.deadline_s, 1.0))
      self.breaker.record(True)
      return have.have
    except (ValueError, RemoteError, zmq.ZMQError):
      self._failed()
      return 0

  def fetch(self, keys: list[bytes], payload_shape, dtype, deadline: float) -> np.ndarray:
    """The blocks' raw bits ``[blocks, *payload_shape]``, verified; raises RemoteError."""
    if not self.available:
      raise RemoteError("breaker", f"peer {self.address} is cooling down")
    try:
      bits = np.dtype(pages_lib.bits_dtype(dtype))
      request = FetchBlocks(nonce=_nonce(), fingerprint=self.fingerprint, keys=tuple(keys),
                            token=_nonce(), transport=self.transport)
      offer, data = self._call(request, deadline)
      want_shape = (len(keys), *payload_shape)
      if offer.token != request.token:
        raise RemoteError("token", "the answer is to another request")
      if offer.keys != request.keys:
        raise RemoteError("key", "the answer names other blocks")
      if offer.dtype != bits.name or offer.shape != want_shape:
        raise RemoteError("shape", f"offered {offer.dtype}{list(offer.shape)}, expected "
                          f"{bits.name}{list(want_shape)}")
      if self.transport == "inline":
        stack = self._inline(data, want_shape, bits)
      else:
        stack = self._pull(offer, want_shape, bits, deadline)
      if _digest(stack) != offer.crc32c:
        raise RemoteError("checksum", "the blocks do not match their CRC-32C")
      self.breaker.record(True)
      return stack
    except RemoteError as e:
      if e.reason in ("deadline", "closed", "refused", "pull"):
        self._failed()
      raise
    except (ValueError, zmq.ZMQError) as e:
      self._failed()
      raise RemoteError("io", str(e)) from None

  @staticmethod
  def _inline(data: list, shape, bits) -> np.ndarray:
    """The blocks carried in the answer's data frame, viewed without a copy."""
    want = int(np.prod(shape)) * bits.itemsize
    if len(data) != 1 or len(data[0]) != want:
      raise RemoteError("shape", f"{[len(d) for d in data]} bytes of data, expected [{want}]")
    return np.frombuffer(data[0].buffer, dtype=bits).reshape(shape)

  def _pull(self, offer, shape, bits, deadline: float) -> np.ndarray:
    import jax.experimental.transfer as transfer
    device = jax.local_devices()[0]
    if self._transfer_server is None:
      self._transfer_server = transfer.start_transfer_server(device.client, "127.0.0.1:0",
                                                             ["127.0.0.1:0"])
    if offer.transfer_id is None or offer.transfer_address is None:
      raise RemoteError("pull", "the offer names no transfer to pull")
    addr = offer.transfer_address
    result: dict = {}

    def pull():
      try:
        conn = self._connections.get(addr)
        if conn is None:
          conn = self._connections[addr] = self._transfer_server.connect(addr)
        out = conn.pull(offer.transfer_id, [jax.ShapeDtypeStruct(
            tuple(shape), jnp.dtype(bits), sharding=jax.sharding.SingleDeviceSharding(device))])
        result["value"] = np.asarray(out[0])
      except Exception as e:  # pylint: disable=broad-except  (reported below)
        result["error"] = e

    worker = threading.Thread(target=pull, daemon=True)  # a pull can hang: never join blindly
    worker.start()
    worker.join(max(0.0, deadline - time.monotonic()))
    if worker.is_alive():
      raise RemoteError("deadline", "the pull did not finish in time")
    if "error" in result:
      raise RemoteError("pull", str(result["error"]))
    value = result["value"]
    if value.dtype != bits or list(value.shape) != list(shape):
      raise RemoteError("shape", f"pulled {value.dtype}{list(value.shape)}")
    return value
