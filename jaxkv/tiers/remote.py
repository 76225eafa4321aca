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
import json
import secrets
import threading
import time

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
from jaxkv.tiers.base import Breaker, Failure, Fetch, Landing
from jaxkv.errors import InputError

PROTOCOL = 3  # 3: ZeroMQ, a hello for the challenge, blocks inline in the answer
_MAX_REQUEST_BYTES = 16 << 20  # a request carries block keys only
_MAX_CHALLENGES = 4096  # connections remembered by the server (oldest forgotten first)


class RemoteError(RuntimeError):
  """A remote fetch that cannot be used; ``reason`` says how (a ``base.Failure``)."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = Failure(reason)


def _digest(stack: np.ndarray) -> int:
  return google_crc32c.value(np.ascontiguousarray(stack).reshape(-1).view(np.uint8))


# ---- the serving side ---------------------------------------------------------------------------
class BlockServer:
  """Serves the device and host blocks of ``cache`` (a ``jaxkv.KVCache``) to other jobs.

  Requests are answered only inside ``poll``/``serve``, on the calling thread (one thread
  at a time)."""

  def __init__(self, cache, host: str = "127.0.0.1", port: int = 0, *, fault: str | None = None):
    self.cache = cache
    # Fault injection for tests, around the real path: "checksum" (a bit flipped after
    # hashing), "dtype" (values sent widened, the right dtype claimed), "shape" (a wrong
    # shape claimed), "keys" (other blocks named), "hang" (a fetch never answered; with the
    # transfer transport, an offer never served).
    self.fault = fault
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
      reply = self._handle(frames[0], frames[1:])
      if reply is not None:
        self._socket.send_multipart([frames[0], *reply], copy=False)
      n += 1
    return n

  def serve(self, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
      self.poll(min(0.1, max(0.0, end - time.monotonic())))

  def close(self) -> None:
    self._socket.close(0)
    self._context.term()

  def _handle(self, peer: bytes, frames: list[bytes]) -> list | None:
    """The reply frames ``[header, mac, *data]`` to one request, None for no reply."""
    nonce, data = "", []
    try:
      if len(frames) != 2:
        raise ValueError(f"a request has 2 frames, not {len(frames)}")
      body, mac = frames
      msg = json.loads(body)
      nonce = str(msg.get("nonce", ""))
      if msg.get("op") == "hello":
        challenge = self._challenges[peer] = secrets.token_hex(16)
        while len(self._challenges) > _MAX_CHALLENGES:
          self._challenges.popitem(last=False)
        answer = {"protocol": PROTOCOL, "challenge": challenge}
      elif self._key is not None and not security.mac_ok(
          self._key, self._challenges.get(peer, ""), body, mac.decode("ascii", "replace")):
        self.refused += 1
        answer = {"error": "unauthenticated: a wrong or missing deployment key"}
      else:
        answer, data = self._answer(msg)
        if answer is None:
          return None  # the "hang" fault
    except Exception as e:  # pylint: disable=broad-except  (answer, never crash)
      answer, data = {"error": f"{type(e).__name__}: {e}"}, []
    header = json.dumps({**answer, "nonce": nonce}).encode()
    mac = (security.challenge_mac(self._key, nonce, header).encode()
           if self._key is not None else b"")
    return [header, mac, *data]

  def _where(self, keys: list[bytes]) -> list[tuple[int, Tier, int]]:
    """(shard, tier, slot) of the longest prefix of ``keys`` on any one shard."""
    index = self.cache.index
    best: list = []
    for s in range(self.cache.num_shards):
      found = [(s, t, slot) for t, slot in index.locate(s, keys) if t in (Tier.DEVICE, Tier.HOST)]
      if len(found) > len(best):
        best = found
    return best

  def _answer(self, msg: dict) -> tuple[dict | None, list]:
    if msg.get("protocol") != PROTOCOL:
      return {"error": f"protocol {msg.get('protocol')} is not {PROTOCOL}"}, []
    if msg.get("fingerprint") != self.cache.config.fingerprint().hex():
      return {"error": "fingerprint: another model or layout"}, []
    keys = [bytes.fromhex(k) for k in msg.get("keys", [])]
    if msg["op"] == "lookup":
      return {"have": len(self._where(keys))}, []
    if msg["op"] != "fetch":
      return {"error": f"unknown op {msg.get('op')!r}"}, []
    transport = msg.get("transport", "inline")
    if transport not in TRANSPORTS:
      return {"error": f"transport {transport!r} is not one of {TRANSPORTS}"}, []
    where = self._where(keys)
    if len(where) < len(keys):
      return {"error": f"missing: holds {len(where)} of {len(keys)} blocks"}, []
    stack = self._gather(where)  # [blocks, arrays, kv_heads, page_size, head_dim] bits
    digest = _digest(stack)
    if self.fault == "checksum":
      stack.reshape(-1)[7] ^= 1
    claimed_dtype, claimed_shape = stack.dtype, list(stack.shape)
    if self.fault == "dtype":
      stack = stack.astype(np.uint32 if stack.dtype == np.uint16 else np.uint16)
    if self.fault == "shape":
      claimed_shape = [claimed_shape[0] + 1, *claimed_shape[1:]]
    if self.fault == "hang" and transport == "inline":
      return None, []
    offered_keys = [k.hex() for k in keys]
    if self.fault == "keys":
      offered_keys = offered_keys[::-1]
    answer = {"shape": claimed_shape, "dtype": np.dtype(claimed_dtype).name,
              "crc32c": digest, "keys": offered_keys, "token": msg.get("token")}
    if transport == "inline":
      return answer, [memoryview(stack).cast("B")]
    if self._transfer is None:
      import jax.experimental.transfer as transfer
      self._transfer = transfer.start_transfer_server(jax.local_devices()[0].client,
                                                      f"{self.address.rpartition(':')[0]}:0",
                                                      ["127.0.0.1:0"])
    transfer_id = secrets.randbits(63)
    if self.fault != "hang":
      self._transfer.await_pull(transfer_id, [jax.device_put(stack, jax.local_devices()[0])])
    return {**answer, "transfer_id": transfer_id,
            "transfer_address": self._transfer.address()}, []

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

  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, list[Fetch]]:
    return None, list(fetches)  # a fetch waits: it runs in finish_fetch, after the recompute

  def finish_fetch(self, fetches: list[Fetch], t_end: float, stage) -> Landing | None:
    groups: dict = {}
    for f in fetches:
      groups.setdefault((f.request, f.slot), []).append(f)
    staged = []
    for (_, peer), group in groups.items():
      group.sort(key=lambda f: f.block)
      try:
        stack = self.clients[peer].fetch([f.key for f in group], self.payload_shape,
                                         self.dtype, t_end)
      except Exception as e:  # pylint: disable=broad-except  (any failed pull is a miss)
        for f in group:
          f.reason = Failure.of(e, Failure.REMOTE)
        continue
      for i, f in enumerate(group):
        f.ok = True
        staged.append((f.shard, f.page, stack[i]))
    return stage(staged) if staged else None


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

  def _exchange(self, msg: dict, deadline: float) -> tuple[dict, list]:
    """Sends one request and waits (until ``deadline``) for the answer to it."""
    nonce = secrets.token_hex(16)
    body = json.dumps({**msg, "protocol": PROTOCOL, "fingerprint": self.fingerprint,
                       "nonce": nonce}).encode()
    mac = (security.challenge_mac(self._secret, self._challenge, body).encode()
           if self._secret is not None and msg["op"] != "hello" else b"")
    self._sock.send_multipart([body, mac], flags=zmq.NOBLOCK)
    while True:  # answers to earlier requests that timed out carry other nonces: dropped
      wait_ms = int((deadline - time.monotonic()) * 1000)
      if wait_ms <= 0 or not self._sock.poll(wait_ms):
        raise RemoteError("deadline", f"peer {self.address} did not answer in time")
      frames = self._sock.recv_multipart(copy=False)
      if len(frames) < 2:
        raise RemoteError("refused", f"an answer of {len(frames)} frames")
      header = frames[0].bytes
      answer = json.loads(header)
      if answer.get("nonce") != nonce:
        continue
      if self._secret is not None and not security.mac_ok(
          self._secret, nonce, header, frames[1].bytes.decode("ascii", "replace")):
        raise RemoteError("refused", "the peer's answer is not signed with this deployment key")
      if "error" in answer:
        raise RemoteError("refused", answer["error"])
      return answer, frames[2:]

  def _call(self, msg: dict, deadline: float) -> tuple[dict, list]:
    if self._sock is None:
      self._sock = self._context.socket(zmq.DEALER)
      self._sock.setsockopt(zmq.LINGER, 0)
      self._sock.connect(f"tcp://{self.host}:{self.port}")
      hello, _ = self._exchange({"op": "hello"}, deadline)
      if hello.get("protocol") != PROTOCOL:
        raise RemoteError("refused", f"the peer speaks protocol {hello.get('protocol')}, "
                          f"this client {PROTOCOL}")
      self._challenge = str(hello["challenge"])
    return self._exchange(msg, deadline)

  def lookup(self, keys: list[bytes]) -> int:
    """How many leading ``keys`` the peer holds (0 when it cannot be asked)."""
    if not keys or not self.available:
      return 0
    try:
      answer, _ = self._call({"op": "lookup", "keys": [k.hex() for k in keys]},
                             time.monotonic() + min(self.deadline_s, 1.0))
      self.breaker.record(True)
      return int(answer["have"])
    except (ValueError, KeyError, TypeError, RemoteError, zmq.ZMQError):
      self._failed()
      return 0

  def fetch(self, keys: list[bytes], payload_shape, dtype, deadline: float) -> np.ndarray:
    """The blocks' raw bits ``[blocks, *payload_shape]``, verified; raises RemoteError."""
    if not self.available:
      raise RemoteError("breaker", f"peer {self.address} is cooling down")
    try:
      bits = np.dtype(pages_lib.bits_dtype(dtype))
      token = secrets.token_hex(16)
      offer, data = self._call({"op": "fetch", "keys": [k.hex() for k in keys],
                                "token": token, "transport": self.transport}, deadline)
      want_shape = [len(keys), *payload_shape]
      if offer.get("token") != token:
        raise RemoteError("token", "the answer is to another request")
      if offer["keys"] != [k.hex() for k in keys]:
        raise RemoteError("key", "the answer names other blocks")
      if offer["dtype"] != bits.name or offer["shape"] != want_shape:
        raise RemoteError("shape", f"offered {offer['dtype']}{offer['shape']}, expected "
                          f"{bits.name}{want_shape}")
      if self.transport == "inline":
        stack = self._inline(data, want_shape, bits)
      else:
        stack = self._pull(offer, want_shape, bits, deadline)
      if _digest(stack) != offer["crc32c"]:
        raise RemoteError("checksum", "the blocks do not match their CRC-32C")
      self.breaker.record(True)
      return stack
    except RemoteError as e:
      if e.reason in ("deadline", "closed", "refused", "pull"):
        self._failed()
      raise
    except (ValueError, KeyError, TypeError, zmq.ZMQError) as e:
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
    addr = offer["transfer_address"]
    result: dict = {}

    def pull():
      try:
        conn = self._connections.get(addr)
        if conn is None:
          conn = self._connections[addr] = self._transfer_server.connect(addr)
        out = conn.pull(offer["transfer_id"], [jax.ShapeDtypeStruct(
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
