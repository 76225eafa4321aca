"""The REMOTE tier's serving side: ``BlockServer``, the blocks of a job's cache for other jobs.

``BlockServer`` runs in the job that holds the blocks (a serving peer with spare memory).
It listens on a ZeroMQ STREAM socket and answers on the serving job's own thread, in
``serve``/``poll``: a request is only read when that thread is between steps, so
gathering blocks never races the engine's donated pools, and the server needs no thread.
What it may spend is its ``BlockServerLimits`` (the names below are its fields).

What a connection costs it: it reads raw bytes off its STREAM socket (``Connections``,
``jaxkv.worker.tiers.remote.connections``), which queues at
most ``RCVHWM_CHUNKS`` chunks of ``IN_BATCH_BYTES`` a connection between polls
(``BlockServer.queued_bytes_most``, (64 + 1) x 8 KiB = 520 KiB), then TCP holds the
sender back. A request is three frames, each capped (``REQUEST_FRAME_BYTES``: 64 B,
``MAX_REQUEST_BYTES`` = 1.07 MiB, 160 B); a frame over its cap or past the third is
dropped as its bytes arrive (counted, ``counts["frames_dropped"]``; its message is refused
once it ends), one over ``MAX_REQUEST_BYTES`` closes the connection. Requests read but
not yet answered are held up to ``max_pending_bytes_per_peer`` (2.13 MiB) a connection,
more are shed. So a connection costs the server at most ``queued_bytes_most`` +
``held_bytes_most`` (pending + the caps of one request being read + two chunks and a
command: 3.2 MiB), whatever it sends, plus what the kernel buffers for its socket
(``tcp_rmem``).

What the server never owes: a ``poll`` answers at most ``max_messages_per_poll``
requests, no connection more than ``max_messages_per_peer`` of them (its others wait for
the next poll), stops reading ``poll_overrun_s`` after its timeout, and stops once the
blocks it answered with pass ``max_answer_bytes_per_poll`` (a fetch is answered whole, so
a poll overruns that by at most one fetch: up to ``MAX_FETCH_BLOCKS`` blocks); answers
queue for a connection up to its send high-water mark (``4 x max_messages_per_peer``
largest answers), beyond which the connection is closed; transfer offers are bounded in
number and bytes and expire (``offer_ttl_s``, or the client's own wait, whichever is
shorter).
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import secrets
import time

import jax
import numpy as np

from jaxkv import buckets
from jaxkv.worker import pages as pages_lib
from jaxkv import security
from jaxkv.distributed import to_host
from jaxkv.manager.index import Tier
from jaxkv.errors import InputError, InvariantError
from jaxkv.worker.tiers.remote.auth import (KEYLESS_FIX, UNAUTHENTICATED, Challenges,
                                            handshake_token)
from jaxkv.worker.tiers.remote.connections import REQUEST_OVERHEAD_BYTES, Connections
from jaxkv.worker.tiers.remote.wire import (
    MAX_FETCH_BLOCKS, MAX_HELLO_BYTES, MAX_REQUEST_BYTES, REQUEST_FRAME_BYTES, REQUESTS,
    FetchBlocks, Have, Hello, Lookup, Offer, Refusal, Welcome, WireError, bytes_of, chunk_aads,
    split_chunks, stack_digest, encoded, head_aad, piece_sizes, pull_aad, readable_nonce, decode)


def _answer_frames(seal: security.Seal | None, answer, data: list, sealed: bool) -> list:
  """An answer's frames ``[nonce, header, tag(s), *data]``: without a key a CRC-32C in the
  header only; with one a tag over the header and each piece of the blocks, or (``sealed``)
  a sealed frame per piece, so that no buffer of the whole answer is made."""
  header = answer.encode()
  nonce = answer.nonce.encode()  # an answer is about the request it names
  if seal is None:
    return [nonce, header, b"", *data]
  tag = seal.tag(head_aad(answer.nonce, header))
  if not data:
    return [nonce, header, tag]
  chunks = split_chunks(data[0])
  aads = chunk_aads(answer.nonce, header, len(chunks))
  if sealed:
    return [nonce, header, tag, *map(seal.seal, aads, chunks)]
  return [nonce, header, b"".join([tag, *map(seal.tag, aads, chunks)]), data[0]]



@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockServerLimits:
  """What a ``BlockServer`` spends on its peers: per poll, per connection, on replay windows
  and on transfer offers (the module's docstring: what each bounds). The defaults suit a
  serving job polled between steps; a deployer tunes one by name, e.g.
  ``BlockServer(cache, limits=BlockServerLimits(max_offers=16))``."""

  max_messages_per_poll: int = 64  # requests one ``poll`` answers
  max_messages_per_peer: int = 16  # of them for one connection; its others wait for the next poll
  max_pending_bytes_per_peer: int = 2 * MAX_REQUEST_BYTES  # requests read, not yet answered
  poll_overrun_s: float = 0.005  # reading stops this long after ``poll``'s timeout
  max_answer_bytes_per_poll: int = 64 << 20  # ... or once its answers' blocks pass this
  challenge_epoch_s: float = 60.0  # a challenge holds for its epoch and the next one
  handshake_timeout_s: float = 30.0  # a connection still in its handshake after this is closed
  max_offers: int = 256  # transfer offers outstanding (not yet expired) ...
  max_offer_bytes: int = 1 << 30  # ... and their device bytes
  offer_ttl_s: float = 30.0  # the longest a transfer offer stands (the client's wait, if shorter)
  max_replay_windows: int = 4096  # challenges whose highest answered number is remembered

  def __post_init__(self):
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      least, above, why = _LIMIT_FLOORS[f.name]
      kind = int if f.type == "int" else (int, float)
      if (not isinstance(value, kind) or isinstance(value, bool) or not math.isfinite(value)
          or (value <= least if above else value < least)):
        raise InputError(
            f"BlockServerLimits.{f.name}={value!r} must be "
            f"{'an integer' if kind is int else 'a finite number'} {'>' if above else '>='} "
            f"{least} ({why}). Fix: give {f.name} a value {'>' if above else '>='} {least}, or "
            f"leave it out (its default: {f.default!r}).")


# Each limit's smallest value, whether it must be above it, and why.
_LIMIT_FLOORS = {
    "max_messages_per_poll": (1, False, "a poll that may answer nothing never serves"),
    "max_messages_per_peer": (1, False, "a connection that may get no answer is never served"),
    "max_pending_bytes_per_peer": (
        sum(REQUEST_FRAME_BYTES) + REQUEST_OVERHEAD_BYTES, False,
        "one request at its frames' caps: below it the largest lookups are always shed"),
    "poll_overrun_s": (0, False, "how long past its timeout a poll may read"),
    "max_answer_bytes_per_poll": (0, False, "bytes of blocks; at 0 a poll answers one fetch"),
    "challenge_epoch_s": (0, True, "a challenge must hold for some time"),
    "handshake_timeout_s": (0, True, "a handshake takes some time"),
    "max_offers": (0, False, "at 0 every transfer fetch is refused"),
    "max_offer_bytes": (0, False, "at 0 every transfer fetch is refused"),
    "offer_ttl_s": (0, True, "an offer must stand long enough to be pulled"),
    "max_replay_windows": (1, False, "at 0 every authenticated request is refused as busy"),
}


class BlockServer:
  """Serves the device and host blocks of ``cache`` (a ``jaxkv.KVCache``) to other jobs.

  Requests are read and answered only inside ``poll``/``serve``, on the calling thread (one
  thread at a time), within a budget per poll and per connection (``limits``, a
  ``BlockServerLimits``: the defaults unless given). Its ``Connections`` read each
  connection's bytes (the handshake, then requests frame by frame, within their bounds: the
  module's docstring) and hand out the requests in turn; the server answers them.
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

  def __init__(self, cache, host: str = "127.0.0.1", port: int = 0, *,
               allow_insecure: bool = False, limits: BlockServerLimits = BlockServerLimits()):
    if not isinstance(limits, BlockServerLimits):
      raise InputError(f"BlockServer(limits={limits!r}) must be a BlockServerLimits: build "
                       "one, BlockServerLimits(max_offers=...), naming the limits to change.")
    self.cache = cache
    self.limits = limits
    self._key = cache.deployment_key
    if self._key is None:
      if not security.is_loopback(host) and not allow_insecure:
        raise InputError(f"BlockServer on {host}:{port} has no deployment key: anyone who "
                         "reaches it could test which prompts were served and pull their KV. "
                         f"Fix: {KEYLESS_FIX}; or pass allow_insecure=True "
                         "(--allow_insecure) on an isolated network.")
      security.warn_insecure("the block server answers anyone, without a deployment key "
                             "(its answers carry a CRC-32C only)", KEYLESS_FIX)
    self._seal = security.Seal(self._key, "remote-answer") if self._key is not None else None
    self._token = handshake_token(self._key) if self._key is not None else None
    self.counts: collections.Counter = collections.Counter()
    self._offers: list[tuple[float, int]] = []  # (expiry, bytes) of outstanding offers
    self._challenges = Challenges(self, self._key)
    self._transfer = None
    # Per connection, in sends: a largest answer is a header piece and, sealed, two sends
    # a piece; beyond, the connection is closed (it does not read).
    block = int(np.prod(cache.payload_shape)) * np.dtype(
        pages_lib.bits_dtype(cache.config.jnp_dtype)).itemsize
    sends = 1 + 2 * len(piece_sizes(MAX_FETCH_BLOCKS * block))
    self._connections = Connections(host, port, token=self._token, limits=limits,
                                    counts=self.counts,
                                    send_hwm=4 * limits.max_messages_per_peer * sends)
    self.address = self._connections.address

  @property
  def refused(self) -> int:
    """Requests refused for a missing or wrong MAC (or an unknown challenge)."""
    return self.counts["unauthenticated"]

  @property
  def handshakes_refused(self) -> int:
    """Connections turned away in the handshake (a wrong token), before a request of
    theirs was read. A client without any credentials fails earlier still (its greeting
    names another mechanism) and is not counted here."""
    return self._connections.handshakes_refused

  @property
  def queued_bytes_most(self) -> int:
    """The most bytes ZeroMQ queues for one connection between polls
    (``Connections.queued_bytes_most``)."""
    return self._connections.queued_bytes_most

  @property
  def held_bytes_most(self) -> int:
    """The most bytes of one connection's requests this server holds
    (``Connections.held_bytes_most``)."""
    return self._connections.held_bytes_most

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
    stop = deadline + self.limits.poll_overrun_s
    connections = self._connections
    connections.tidy(now)
    connections.progressed = False  # a handshake takes a step: reading may overrun
    while (answered < self.limits.max_messages_per_poll
           and answered_bytes <= self.limits.max_answer_bytes_per_poll):
      turn = connections.next_turn(per_peer)
      if turn is not None:
        peer, frames, problem = turn
        per_peer[peer] += 1
        reply, blocks_bytes = self._handle(peer, frames, problem)
        connections.send(peer, encoded(reply))
        answered += 1
        answered_bytes += blocks_bytes
        continue
      now = time.monotonic()
      until = stop if connections.progressed else deadline
      if now >= stop or not connections.readable(until - now):
        break
      connections.receive()
    self.counts["answered"] += answered
    return answered

  def waiting(self) -> bool:
    """Whether a request or bytes wait to be read (a ``poll`` left work for the next one)."""
    return self._connections.waiting()

  def serve(self, duration_s: float) -> None:
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
      self.poll(min(0.1, max(0.0, end - time.monotonic())))

  def close(self) -> None:
    self._connections.close()

  # ---- one request --------------------------------------------------------------------------
  def _handle(self, peer: bytes, frames: list, problem: str) -> tuple[list, int]:
    """The reply frames ``[nonce, answer, tag, *data]`` to one request
    ``[nonce, message, auth]`` (``problem``: why its frames already break the protocol),
    and the bytes of the blocks it answers with (for the poll's budget): checked from the
    cheapest test on, parsed only once authenticated (a hello excepted)."""
    nonce = ""
    sealed = False
    try:
      nonce = readable_nonce(bytes(frames[0][:65]).decode("ascii", "replace") if frames else "")
      if problem:
        raise WireError(problem)
      body, auth = frames[1], frames[2]
      signed = (self._challenges.authentic(peer, body, auth) if self._key is not None and auth
                else None)
      if self._key is not None and (auth or len(body) > MAX_HELLO_BYTES) and signed is None:
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
                                 valid_ms=int(self.limits.challenge_epoch_s * 1000)), []
        elif self._key is not None and signed is None:
          answer, data = self._refuse_unauthenticated(nonce), []
        elif self._key is not None and (new := self._challenges.first_time(*signed)) is not True:
          if new is None:
            self.counts["replay_windows_full"] += 1
            answer = Refusal(nonce=nonce, error=f"busy: requests under "
                             f"{self.limits.max_replay_windows} challenges are numbered here "
                             "already (say hello again later)")
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
    return Refusal(nonce=nonce, error=f"{UNAUTHENTICATED}: a wrong or missing deployment "
                   "key, or a challenge this server did not make for this connection or that "
                   "expired (say hello again)")

  def reply(self, request: Lookup | FetchBlocks) -> tuple[Have | Offer | Refusal, list]:
    """The answer to an authenticated request, and the data frames that follow it."""
    if request.fingerprint != self.cache.config.fingerprint().hex():
      return Refusal(nonce=request.nonce, error="fingerprint: another model or layout"), []
    if isinstance(request, FetchBlocks) and request.sealed and self._key is None:
      return Refusal(nonce=request.nonce, error="sealed: this peer has no deployment key, "
                     "it cannot seal blocks"), []
    windows = self.cache.manager.windows
    group = getattr(request, "group", 0)
    if group and windows is None:
      return Refusal(nonce=request.nonce, error="group: this peer's model has no window "
                     "group"), []
    where = (self._where_windows(list(request.keys)) if group
             else self._where(list(request.keys)))
    if isinstance(request, Lookup):
      held = (self._window_indices(request.keys, len(where))
              if request.windows and windows is not None else ())
      return Have(nonce=request.nonce, have=len(where), windows=held), []
    if len(where) < len(request.keys):
      return Refusal(nonce=request.nonce, error=f"missing: holds {len(where)} of "
                     f"{len(request.keys)} blocks"), []
    stack = self._gather(where, windows=bool(group))  # [blocks, arrays, kv_heads, ...] bits
    transfer = request.transport == "transfer"
    offer = Offer(nonce=request.nonce, keys=request.keys, dtype=np.dtype(stack.dtype).name,
                  shape=tuple(stack.shape), token=request.token, sealed=request.sealed,
                  crc32c=stack_digest(stack) if self._key is None else None,
                  expires_ms=(min(request.wait_ms, int(self.limits.offer_ttl_s * 1000))
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
      return offer, [bytes_of(stack)]
    payload = stack
    if self._seal is not None and offer.sealed:
      payload = np.frombuffer(self._seal.seal(pull_aad(offer.nonce), bytes_of(stack)),
                              np.uint8)
    elif self._seal is not None:
      offer = dataclasses.replace(
          offer, data_tag=self._seal.tag(pull_aad(offer.nonce), bytes_of(stack)).hex())
    now = time.monotonic()
    self._offers = [(t, n) for t, n in self._offers if t > now]
    held = sum(n for _, n in self._offers)
    if (len(self._offers) >= self.limits.max_offers
        or held + payload.nbytes > self.limits.max_offer_bytes):
      self.counts["offers_refused"] += 1
      return Refusal(nonce=offer.nonce, error=f"busy: {len(self._offers)} transfer offers "
                     f"({held} bytes) outstanding, the most this peer holds"), []
    if self._transfer is None:
      import jax.experimental.transfer as transfer
      self._transfer = transfer.start_transfer_server(jax.local_devices()[0].client,
                                                      f"{self.address.rpartition(':')[0]}:0",
                                                      ["127.0.0.1:0"])
    ttl_s = (offer.expires_ms if offer.expires_ms is not None
             else self.limits.offer_ttl_s * 1000) / 1000
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

  def _where_windows(self, keys: list[bytes]) -> list[tuple[int, Tier, int]]:
    """(shard, tier, page or slot) of each of ``keys`` whose window KV is kept, on a device
    or in host memory (``WindowPages.find``), up to the first that is not."""
    found = []
    for key in keys:
      at = self.cache.manager.windows.find(key)
      if at is None:
        break
      found.append(at)
    return found

  def _window_indices(self, keys, have: int) -> tuple[int, ...]:
    """Which of the last two windows' blocks of the ``have`` keys held have their window
    KV kept here (what a hit past the window edge needs: ``Have.windows``)."""
    windows = self.cache.manager.windows
    lo = max(0, have - 2 * windows.window)
    return tuple(j for j in range(lo, have) if windows.find(keys[j]) is not None)

  def warm(self) -> int:
    """Compiles the device gather of every fetch size a peer may ask for (power-of-two
    buckets up to a sequence's pages, ``MAX_FETCH_BLOCKS`` at most), reading page 0 only;
    otherwise a peer's first fetch of each size waits for that compile. Returns how many
    sizes it compiled. Call it before serving, from the thread that polls."""
    cache = self.cache
    most = min(MAX_FETCH_BLOCKS, cache.config.max_pages_per_seq)
    sizes = sorted({buckets.transfer_pages(n) for n in range(1, most + 1)})
    for n in sizes:
      ids = np.zeros((cache.num_shards, n), np.int32)
      jax.block_until_ready(pages_lib.gather_stacked(
          cache.worker.pools, cache.put_rows(ids), mesh=cache.mesh, config=cache.config))
    windows = cache.manager.windows
    if windows is not None:  # a window fetch asks for two windows' blocks at most
      for n in sorted({buckets.transfer_pages(n) for n in range(1, 2 * windows.window + 1)}):
        ids = np.zeros((cache.num_shards, n), np.int32)
        jax.block_until_ready(pages_lib.gather_stacked(
            cache.worker.window_pools, cache.put_rows(ids), mesh=cache.mesh,
            config=cache.config))
    return len(sizes)

  def _gather(self, where, windows: bool = False) -> np.ndarray:
    """The blocks' raw bits ``[blocks, arrays, kv_heads, page_size, head_dim]`` (with
    ``windows``, their window KV: the window group's arrays): one gather per tier for all
    of them; only the rows of the shards holding them come to the host, then one numpy
    copy puts each block in place."""
    cache = self.cache
    pools = cache.worker.window_pools if windows else cache.worker.pools
    host = cache.worker.window_host if windows else cache.worker.host
    out = None
    for tier in (Tier.DEVICE, Tier.HOST):
      picks = [(i, s, slot) for i, (s, t, slot) in enumerate(where) if t == tier]
      if not picks:
        continue
      ids, per = buckets.shard_ids(picks, cache.num_shards, 0, lambda p: p[2],
                                   shard_of=lambda p: p[1])
      n = ids.shape[1]
      if tier == Tier.DEVICE:
        stack = pages_lib.gather_stacked(pools, cache.put_rows(ids), mesh=cache.mesh,
                                         config=cache.config)
      else:
        stack = host.read_numpy(ids)
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
