"""REMOTE tier: blocks held by another job, pulled with ``jax.experimental.transfer``.

Two parts, in two processes:
- ``BlockServer`` runs in the job that holds the blocks (a serving peer with spare memory).
  It answers a small JSON-lines control protocol on TCP and offers block data through a
  JAX transfer server. All JAX work (gathering the blocks, offering them) runs on the
  serving job's main thread in ``serve``/``poll`` — the control thread only queues
  requests — so transfers are issued from one thread in order.
- ``RemoteClient`` runs in the job that wants them (``TierConfig.remote_peers``). It asks
  how long a prefix of block keys the peer holds (``lookup``), then asks for an offer of
  those blocks and pulls them (``fetch``).

Authentication (``jaxkv.security``): when the serving cache has a deployment key, the server
greets each connection with a random challenge and answers only requests that carry
``HMAC(key, challenge, request)``; others get an "unauthenticated" refusal and are counted
(``BlockServer.refused``). Its answers carry ``HMAC(key, nonce, answer)`` over the client's
per-request nonce, so a client with the key also refuses a server without it. A server
without a key answers anyone (keep it on a private network).

What the reader never trusts: every offer names its block keys, dtype and shape, and
carries a CRC-32C per block computed by the owner from the bytes it offers; the reader
checks keys, dtype and shape before pulling and every block's CRC after, and rejects
the whole pull on any mismatch (CRC-32C catches damage at ~10x the speed of SHA-256; the
block keys themselves stay SHA-256 chains). Transfer ids are 63-bit random numbers bound to
the request's own random token. Pulls run in a helper thread that the reader waits for with
its own deadline (a pull of an id never offered can hang); a late, refused or broken pull
is a miss and the request recomputes. A peer that keeps failing trips a circuit breaker
and is not asked again until its cool-down has passed.
"""

from __future__ import annotations

import json
import queue
import secrets
import socket
import socketserver
import threading
import time

import google_crc32c
import jax
import jax.numpy as jnp
import numpy as np

from jaxkv import buckets
from jaxkv import pages as pages_lib
from jaxkv import security
from jaxkv.distributed import to_host
from jaxkv.index import Tier
from jaxkv.tiers.base import Breaker, Failure, Fetch, Landing
from jaxkv.errors import InputError

PROTOCOL = 2  # 2: challenge greeting, MACs, CRC-32C digests


class RemoteError(RuntimeError):
  """A remote fetch that cannot be used; ``reason`` says how (a ``base.Failure``)."""

  def __init__(self, reason: str, detail: str = ""):
    super().__init__(f"{reason}: {detail}" if detail else reason)
    self.reason = Failure(reason)


def _digest(block: np.ndarray) -> int:
  return google_crc32c.value(np.ascontiguousarray(block).reshape(-1).view(np.uint8))


# ---- the serving side ---------------------------------------------------------------------------
class BlockServer:
  """Serves the device and host blocks of ``cache`` (a ``jaxkv.KVCache``) to other jobs."""

  def __init__(self, cache, host: str = "127.0.0.1", port: int = 0, *, fault: str | None = None):
    import jax.experimental.transfer as transfer
    self.cache = cache
    # Fault injection for tests, around the real transfer: "checksum" (a bit flipped after
    # hashing), "dtype" (values sent widened, the right dtype claimed), "shape" (a wrong
    # shape claimed), "keys" (other blocks named), "hang" (an id offered but never served).
    self.fault = fault
    self._device = jax.local_devices()[0]
    self._transfer = transfer.start_transfer_server(self._device.client, f"{host}:0",
                                                    [f"{host}:0"])
    self._requests: queue.Queue = queue.Queue()
    self._offers = 0
    outer = self

    key = cache._deployment_key  # pylint: disable=protected-access
    self.refused = 0  # requests refused for a missing or wrong MAC
    refused_lock = threading.Lock()

    class Handler(socketserver.StreamRequestHandler):
      def handle(self):
        challenge = secrets.token_hex(16)
        self.wfile.write((json.dumps({"protocol": PROTOCOL, "challenge": challenge}) + "\n"
                          ).encode())
        self.wfile.flush()
        for line in self.rfile:
          nonce = ""
          try:
            outer_msg = json.loads(line)
            body = outer_msg["body"]
            msg = json.loads(body)
            nonce = str(msg.get("nonce", ""))
            if key is not None and not security.mac_ok(key, challenge, body.encode(),
                                                       outer_msg.get("mac")):
              with refused_lock:
                outer.refused += 1
              answer = {"error": "unauthenticated: a wrong or missing deployment key"}
            else:
              reply: queue.Queue = queue.Queue(maxsize=1)
              outer._requests.put((msg, reply))
              answer = reply.get(timeout=30.0)
          except Exception as e:  # pylint: disable=broad-except  (answer, never crash)
            answer = {"error": f"{type(e).__name__}: {e}"}
          text = json.dumps(answer)
          mac = security.challenge_mac(key, nonce, text.encode()) if key is not None else None
          self.wfile.write((json.dumps({"body": text, "mac": mac}) + "\n").encode())
          self.wfile.flush()

    class Server(socketserver.ThreadingTCPServer):
      daemon_threads = True
      allow_reuse_address = True

    self._tcp = Server((host, port), Handler)
    self.address = f"{host}:{self._tcp.server_address[1]}"
    self._thread = threading.Thread(target=self._tcp.serve_forever, daemon=True)
    self._thread.start()

  def poll(self, timeout_s: float = 0.0) -> int:
    """Answers queued requests on this thread; returns how many were answered."""
    n = 0
    deadline = time.monotonic() + timeout_s
    while True:
      try:
        msg, reply = self._requests.get(timeout=max(0.0, deadline - time.monotonic()))
      except queue.Empty:
        return n
      try:
        reply.put(self._answer(msg))
      except Exception as e:  # pylint: disable=broad-except
        reply.put({"error": f"{type(e).__name__}: {e}"})
      n += 1

  def serve(self, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
      self.poll(min(0.1, max(0.0, end - time.monotonic())))

  def close(self) -> None:
    self._tcp.shutdown()
    self._tcp.server_close()

  def _where(self, keys: list[bytes]) -> list[tuple[int, Tier, int]]:
    """(shard, tier, slot) of the longest prefix of ``keys`` on any one shard."""
    index = self.cache.index
    best: list = []
    for s in range(self.cache.num_shards):
      found = [(s, t, slot) for t, slot in index.locate(s, keys) if t in (Tier.DEVICE, Tier.HOST)]
      if len(found) > len(best):
        best = found
    return best

  def _answer(self, msg: dict) -> dict:
    if msg.get("protocol") != PROTOCOL:
      return {"error": f"protocol {msg.get('protocol')} is not {PROTOCOL}"}
    if msg.get("fingerprint") != self.cache.config.fingerprint().hex():
      return {"error": "fingerprint: another model or layout"}
    keys = [bytes.fromhex(k) for k in msg.get("keys", [])]
    if msg["op"] == "lookup":
      return {"have": len(self._where(keys))}
    if msg["op"] == "offer":
      where = self._where(keys)
      if len(where) < len(keys):
        return {"error": f"missing: holds {len(where)} of {len(keys)} blocks"}
      stack = self._gather(where)  # [blocks, arrays, kv_heads, page_size, head_dim] bits
      digests = [_digest(stack[i]) for i in range(len(keys))]
      if self.fault == "checksum":
        stack = stack.copy()
        stack.reshape(-1)[7] ^= 1
      claimed_dtype, claimed_shape = stack.dtype, list(stack.shape)
      if self.fault == "dtype":
        stack = stack.astype(np.uint32 if stack.dtype == np.uint16 else np.uint16)
      if self.fault == "shape":
        claimed_shape = [claimed_shape[0] + 1, *claimed_shape[1:]]
      send = jax.device_put(stack, self._device)
      transfer_id = secrets.randbits(63)
      if self.fault != "hang":
        self._transfer.await_pull(transfer_id, [send])
      self._offers += 1
      offered_keys = [k.hex() for k in keys]
      if self.fault == "keys":
        offered_keys = offered_keys[::-1]
      return {"transfer_id": transfer_id, "transfer_address": self._transfer.address(),
              "shape": claimed_shape, "dtype": np.dtype(claimed_dtype).name,
              "digests": digests, "keys": offered_keys, "token": msg.get("token")}
    return {"error": f"unknown op {msg.get('op')!r}"}

  def _gather(self, where) -> np.ndarray:
    """The blocks' raw bits ``[blocks, arrays, kv_heads, page_size, head_dim]``: one
    gather per tier for all of them."""
    cache = self.cache
    out = [None] * len(where)
    for tier in (Tier.DEVICE, Tier.HOST):
      picks = [(i, s, slot) for i, (s, t, slot) in enumerate(where) if t == tier]
      if not picks:
        continue
      ids, per = buckets.shard_ids(picks, cache.num_shards, 0, lambda p: p[2],
                                   shard_of=lambda p: p[1])
      n = ids.shape[1]
      if tier == Tier.DEVICE:
        stack = to_host(pages_lib.gather_stacked(cache.pools, cache.put_rows(ids),
                                                 mesh=cache.mesh, config=cache.config))
      else:
        stack = cache.host.read_numpy(ids)
      for s, items in enumerate(per):
        for j, (i, _, _) in enumerate(items):
          out[i] = stack[:, :, s * n + j]
    return np.stack(out)


# ---- the reading side ----------------------------------------------------------------------------
class RemoteTier:
  """The peers of ``TierConfig.remote_peers`` as one ``FetchSource``: each request's
  blocks from one peer come in one offer and one pull."""

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
    return None, list(fetches)  # a pull waits: it runs in finish_fetch, after the recompute

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
               trip_after: int = 3, cool_down_s: float = 10.0, secret: bytes | None = None):
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
      raise InputError(f"remote peer {address!r} must be 'host:port'.")
    self.address, self.host, self.port = address, host, int(port)
    self.fingerprint = fingerprint.hex()
    self.deadline_s = deadline_s
    self.breaker = Breaker(trip_after, cool_down_s)
    self._secret = security.check_key(secret)
    self._challenge = ""
    self._sock = None
    self._file = None
    self._transfer_server = None
    self._connections: dict = {}

  @property
  def available(self) -> bool:
    return self.breaker.available

  def _failed(self) -> None:
    self.breaker.record(False)
    self._close()

  def _close(self) -> None:
    for x in (self._file, self._sock):
      try:
        if x is not None:
          x.close()
      except OSError:
        pass
    self._sock = self._file = None

  def _call(self, msg: dict, deadline: float) -> dict:
    if self._sock is None:
      self._sock = socket.create_connection((self.host, self.port),
                                            timeout=max(0.05, deadline - time.monotonic()))
      self._file = self._sock.makefile("rwb")
      hello = self._file.readline()
      if not hello:
        raise RemoteError("closed", "the peer closed the connection")
      hello = json.loads(hello)
      if hello.get("protocol") != PROTOCOL:
        raise RemoteError("refused", f"the peer speaks protocol {hello.get('protocol')}, "
                          f"this client {PROTOCOL}")
      self._challenge = str(hello["challenge"])
    self._sock.settimeout(max(0.05, deadline - time.monotonic()))
    nonce = secrets.token_hex(16)
    body = json.dumps({**msg, "protocol": PROTOCOL, "fingerprint": self.fingerprint,
                       "nonce": nonce})
    mac = (security.challenge_mac(self._secret, self._challenge, body.encode())
           if self._secret is not None else None)
    self._file.write((json.dumps({"body": body, "mac": mac}) + "\n").encode())
    self._file.flush()
    line = self._file.readline()
    if not line:
      raise RemoteError("closed", "the peer closed the connection")
    reply = json.loads(line)
    if self._secret is not None and not security.mac_ok(self._secret, nonce,
                                                        reply["body"].encode(), reply.get("mac")):
      raise RemoteError("refused", "the peer's answer is not signed with this deployment key")
    answer = json.loads(reply["body"])
    if "error" in answer:
      raise RemoteError("refused", answer["error"])
    return answer

  def lookup(self, keys: list[bytes]) -> int:
    """How many leading ``keys`` the peer holds (0 when it cannot be asked)."""
    if not keys or not self.available:
      return 0
    try:
      n = int(self._call({"op": "lookup", "keys": [k.hex() for k in keys]},
                         time.monotonic() + min(self.deadline_s, 1.0))["have"])
      self.breaker.record(True)
      return n
    except (OSError, ValueError, RemoteError):
      self._failed()
      return 0

  def fetch(self, keys: list[bytes], payload_shape, dtype, deadline: float) -> np.ndarray:
    """The blocks' raw bits ``[blocks, *payload_shape]``, verified; raises RemoteError."""
    if not self.available:
      raise RemoteError("breaker", f"peer {self.address} is cooling down")
    try:
      bits = np.dtype(pages_lib.bits_dtype(dtype))
      token = secrets.token_hex(16)
      offer = self._call({"op": "offer", "keys": [k.hex() for k in keys], "token": token},
                         deadline)
      want_shape = [len(keys), *payload_shape]
      if offer.get("token") != token:
        raise RemoteError("token", "the offer answers another request")
      if offer["keys"] != [k.hex() for k in keys]:
        raise RemoteError("key", "the offer names other blocks")
      if offer["dtype"] != bits.name or offer["shape"] != want_shape:
        raise RemoteError("shape", f"offered {offer['dtype']}{offer['shape']}, expected "
                          f"{bits.name}{want_shape}")
      stack = self._pull(offer, want_shape, bits, deadline)
      for i, d in enumerate(offer["digests"]):
        if _digest(stack[i]) != d:
          raise RemoteError("checksum", f"block {i} does not match its digest")
      self.breaker.record(True)
      return stack
    except RemoteError as e:
      if e.reason in ("deadline", "closed", "refused", "pull"):
        self._failed()
      raise
    except (OSError, ValueError, KeyError, TypeError) as e:
      self._failed()
      raise RemoteError("io", str(e)) from None

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
