"""Sends KV events (``jaxkv.manager.events``) over ZeroMQ as vLLM does, so routers read them.

The wire, as vLLM's ``kv_events`` writes it and Dynamo's KV indexer reads it:

- a PUB socket (here an XPUB: it also learns when a subscriber connects) bound at
  ``endpoint``; each message is three frames, ``(topic, seq, payload)``: ``seq`` 8 bytes
  big-endian, one more per message, and ``payload`` msgpack ``[ts, events,
  data_parallel_rank]`` with events as tagged maps (``{"type": "BlockStored", ...}``);
- a ROUTER socket at ``replay`` that answers a request ``(b"", start seq as 8 bytes)`` with
  kept messages from that seq on as ``(b"", seq, payload)``, then ``(b"", -1, b"")``.

Two things vLLM's publisher leaves to the reader are done here:

- Sequence numbers start at the microseconds since the epoch, not at 0, so a replica that
  restarts continues above where it stopped: a reader that saw the old run takes the jump as
  a gap and asks the replay socket, whose answer starts with ``AllBlocksCleared``. (A
  reader that drops what is below the last seq it saw ignores a run restarted from 0.)
- When a subscriber connects (a router that started late, or reconnected), the publisher
  sends a snapshot: ``AllBlocksCleared`` and a ``BlockStored`` for every block held now,
  parents first, so a reader that joins late sees what was stored before it came.

Both sockets face whoever can reach them, with no key (the stream tells every tenant's
blocks: bind them on loopback or a private network). What a peer can make this process hold
is bounded (``PublisherLimits``; the numbers below are the defaults):

- **A frame a peer sends** is at most ``frame_bytes`` (512 B: a subscription is a topic, a
  replay request 8 bytes, a handshake with a 255-byte routing id fits). libzmq reads a
  frame's size before the frame and drops a peer that announces more, before allocating.
- **Subscriptions.** libzmq keeps a subscription as one trie node per byte. Only prefixes of
  our topic can match our messages; every other subscription (``subscriptions_foreign``) is
  counted in bytes, and past ``foreign_subscription_bytes`` (16 KiB) the XPUB is closed and
  bound again at the same address, which frees the trie: readers reconnect by themselves
  and get a snapshot. libzmq moves frames into the trie before we read them, as fast as a
  peer sends them while this thread touches the socket: 5-16 MiB of trie per re-bind were
  measured on loopback (``tests/manager/test_publisher_bounds.py``), against 300 MiB for
  8 MiB sent without the re-bind. (An attacker who keeps doing this makes readers reconnect
  and re-read a snapshot each time: it costs them time, not this process memory.)
- **Snapshots** are sent once per new connection (seen by a socket monitor), on its first
  subscription, at most one per ``snapshot_interval_s``: a peer that re-sends subscriptions
  on one connection makes none.
- **A subscriber that does not read** holds at most ``sndhwm`` messages (32), each at most
  ``message_bytes`` (128 KiB) unless one event alone is larger (a ``BlockStored`` of one
  block): 4 MiB per connection. A message is built once and shared by every queue it is in.
- **The replay buffer** keeps the last ``buffer_messages`` (10,000) messages and at most
  ``buffer_bytes`` (32 MiB) of payload.
- **A replay answer** is at most ``replay_answer_bytes`` (1 MiB) and ``replay_hwm`` - 1
  messages (31), then the end marker: a reader that wants more asks again from the seq
  after the last it got. A peer that does not read holds at most ``replay_hwm`` messages
  (4 MiB); a request that finds its queue full, or comes over ``replays_per_s`` (20), is
  not answered (``replays_refused``; the reader asks again).
- **Malformed replay requests** are counted (``replays_malformed``) and logged at most once a
  minute with the count since the last line.

One thread owns the sockets: events are queued by the thread that changed the index
(``put``) and sent in order, up to ``MAX_EVENTS`` per message. ``close`` stops it.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time

import msgspec
import zmq
from absl import logging
from zmq.utils import monitor as zmq_monitor

from jaxkv.config import check_endpoint
from jaxkv.errors import InputError
from jaxkv.manager.events import (AllBlocksCleared, BlockRemoved, BlockStored, Event,
                                  EventBatch)

MAX_EVENTS = 1024  # per message (and fewer where the message would pass message_bytes)
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 5  # an event waits at most this long in the queue
_WARN_EVERY_S = 60.0
_SUBSCRIPTION_HWM = 4  # subscription frames queued per peer before libzmq stops reading it
_REQUEST_HWM = 16  # replay requests queued per peer before libzmq stops reading it
_REBIND_S = 5.0  # how long a re-bind of the XPUB may retry a port the old socket still holds


@dataclasses.dataclass(frozen=True, kw_only=True)
class PublisherLimits:
  """What one peer of the event sockets can make the publisher hold (module docstring)."""
  frame_bytes: int = 512
  sndhwm: int = 32
  message_bytes: int = 128 * 1024
  buffer_messages: int = 10_000
  buffer_bytes: int = 32 * 2**20
  replay_answer_bytes: int = 2**20
  replay_hwm: int = 32
  replays_per_s: float = 20.0
  snapshot_interval_s: float = 1.0
  foreign_subscription_bytes: int = 16 * 1024

  def __post_init__(self):
    for name in ("frame_bytes", "sndhwm", "message_bytes", "buffer_messages", "buffer_bytes",
                 "replay_answer_bytes", "foreign_subscription_bytes"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise InputError(f"PublisherLimits.{name}={value!r} must be a positive int; fix it.")
    if self.frame_bytes < 64:
      raise InputError(f"PublisherLimits.frame_bytes={self.frame_bytes!r} must be >= 64: a "
                       "peer's handshake is a frame too; give 512.")
    if not isinstance(self.replay_hwm, int) or self.replay_hwm < 2:
      raise InputError(f"PublisherLimits.replay_hwm={self.replay_hwm!r} must be an int >= 2 "
                       "(an answer's messages and its end marker); give 256.")
    for name in ("replays_per_s", "snapshot_interval_s"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value <= 0:
        raise InputError(f"PublisherLimits.{name}={value!r} must be a number > 0; fix it.")

  @property
  def per_subscriber_bytes(self) -> int:
    """What a connected subscriber that never reads can hold (events within message_bytes)."""
    return self.sndhwm * self.message_bytes

  @property
  def per_replay_peer_bytes(self) -> int:
    """What a replay peer that never reads its answers can hold."""
    return self.replay_hwm * self.message_bytes


def endpoint_host(endpoint: str) -> str | None:
  """The host a ``tcp://HOST:PORT`` endpoint binds (``*`` for every interface); None for
  ``ipc://`` (a file, reachable from this machine only)."""
  if not endpoint.startswith("tcp://"):
    return None
  return endpoint[len("tcp://"):].rpartition(":")[0]


class _EveryMinute:
  """A warning logged at most once per ``_WARN_EVERY_S``, with how many it stands for."""

  def __init__(self, what: str):
    self.what, self.count, self._last = what, 0, float("-inf")

  def __call__(self, detail: str) -> None:
    self.count += 1
    now = time.monotonic()
    if now - self._last >= _WARN_EVERY_S:
      logging.warning("%s (%d since the last such line; latest: %s)", self.what, self.count,
                      detail)
      self._last, self.count = now, 0


class EventPublisher:
  """Publishes events on ``endpoint`` (and answers replays on ``replay``) from a thread.

  ``topic``: the first frame of every message. ``dp_rank``: the payload's
  ``data_parallel_rank``. ``limits``: what a peer can make it hold. Binding happens before
  the constructor returns; a port in use raises ``InputError``.

  Counters (read them from any thread): ``sent`` messages, ``snapshots``, ``replays``
  answered, ``replays_refused`` (over the rate, or the peer's queue full), ``replays_malformed``,
  ``subscriptions_foreign`` (bytes of subscriptions to what we never send), ``rebinds`` of the
  XPUB, ``peers_disconnected`` (left, or dropped by libzmq for an oversized frame),
  ``events_dropped`` (put after the thread stopped)."""

  def __init__(self, endpoint: str, *, replay: str | None = None, topic: str = "",
               dp_rank: int = 0, limits: PublisherLimits | None = None):
    self.endpoint = check_endpoint(endpoint, "kv_events")
    self.replay_endpoint = check_endpoint(replay, "kv_events_replay") if replay else None
    self.topic, self.dp_rank = topic.encode(), dp_rank
    self.limits = limits = limits or PublisherLimits()
    if len(self.topic) + 1 > limits.frame_bytes:
      raise InputError(f"kv_events_topic={topic!r} is {len(self.topic)} bytes; a subscription "
                       f"to it must fit PublisherLimits.frame_bytes={limits.frame_bytes}: use "
                       "a shorter topic.")
    self._kept: collections.deque = collections.deque()  # (seq, payload)
    self._kept_bytes = 0
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    # what a snapshot tells: (hash, medium, group_idx) -> its BlockStored
    self._held: dict[tuple[int, str | None, int | None], BlockStored] = {}
    self._encoder = msgspec.msgpack.Encoder()
    self._stop = threading.Event()
    self._bound = threading.Event()
    self._error: BaseException | None = None
    self.seq = time.time_ns() // 1000
    self.sent = self.replays = self.snapshots = 0
    self.replays_refused = self.replays_malformed = self.subscriptions_foreign = 0
    self.rebinds = self.peers_disconnected = self.events_dropped = 0
    # Connections (their fds) accepted and not yet subscribed, nor gone: a subscription
    # while one is here is a new reader's first (which one, libzmq does not say).
    self._new_peers: set[int] = set()
    self._snapshot_due = False
    self._last_snapshot = float("-inf")
    self._foreign_bytes = 0  # since the XPUB was bound
    self._tokens, self._tokens_at = float(limits.replays_per_s), time.monotonic()
    self._warn_malformed = _EveryMinute("KV event replay requests were malformed and ignored "
                                        "(expected identity, empty, 8-byte seq)")
    self.bound_endpoint = self.bound_replay = None
    self._thread = threading.Thread(target=self._run, name="jaxkv-kv-events", daemon=True)
    self._thread.start()
    if not self._bound.wait(10.0):
      self._stop.set()
      raise TimeoutError("the KV event publisher did not bind its sockets in 10 s.")
    if self._error is not None:
      raise self._error
    self.put(AllBlocksCleared())

  def put(self, event: Event) -> None:
    """Queues one event (any thread); it goes out in the next message. Once the thread
    has stopped (closed, or broken: logged), events are dropped, not kept."""
    if self._thread.is_alive():
      self._queue.put(event)
    else:
      self.events_dropped += 1

  def close(self, timeout_s: float = 5.0) -> None:
    """Sends what is queued, then stops the thread and closes the sockets."""
    self._stop.set()
    self._thread.join(timeout_s)
    if self._thread.is_alive():
      logging.warning("the KV event publisher did not stop in %.1f s", timeout_s)

  # ---- the thread -----------------------------------------------------------------------------
  def _open_pub(self, ctx, where: str):
    """An XPUB bound at ``where`` and the monitor that tells its new connections."""
    pub = ctx.socket(zmq.XPUB)
    try:
      pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also a repeated one
      pub.setsockopt(zmq.SNDHWM, self.limits.sndhwm)
      pub.setsockopt(zmq.MAXMSGSIZE, self.limits.frame_bytes)
      # libzmq moves a peer's queued subscriptions into its trie (and its queue for us)
      # whenever this thread touches the socket, also on each recv that takes one out: a
      # queue of a few frames keeps what it took in close to what we have counted.
      pub.setsockopt(zmq.RCVHWM, _SUBSCRIPTION_HWM)
      pub.setsockopt(zmq.LINGER, 0)
      pub.bind(where)
      mon = pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
    except BaseException:
      pub.close(0)
      raise
    return pub, mon

  def _close_pub(self, pub, mon) -> None:
    pub.disable_monitor()
    mon.close(0)
    pub.close(0)

  def _run(self) -> None:
    ctx = zmq.Context.instance()
    pub = mon = rep = None
    try:
      try:
        pub, mon = self._open_pub(ctx, self.endpoint)
      except zmq.ZMQError as e:
        raise InputError(f"kv_events={self.endpoint!r}: cannot listen there ({e}); pick a "
                         "free port.") from None
      self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
      if self.replay_endpoint:
        rep = ctx.socket(zmq.ROUTER)
        rep.setsockopt(zmq.LINGER, 0)
        rep.setsockopt(zmq.MAXMSGSIZE, self.limits.frame_bytes)
        rep.setsockopt(zmq.SNDHWM, self.limits.replay_hwm)
        rep.setsockopt(zmq.RCVHWM, _REQUEST_HWM)
        rep.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a full queue says so, not drops silently
        try:
          rep.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
          raise InputError(f"kv_events_replay={self.replay_endpoint!r}: cannot listen there "
                           f"({e}); pick a free port.") from None
        self.bound_replay = rep.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException as e:  # pylint: disable=broad-except  (raised in the constructor)
      self._error = e
      if pub is not None:
        self._close_pub(pub, mon)
      if rep is not None:
        rep.close(0)
      self._bound.set()
      return
    self._bound.set()
    try:
      while True:
        poller = zmq.Poller()
        for sock in (mon, pub, rep):
          if sock is not None:
            poller.register(sock, zmq.POLLIN)
        while True:
          stopping = self._stop.is_set()
          ready = dict(poller.poll(0 if stopping else _POLL_MS))
          if mon in ready:  # before the XPUB: a connection's accept precedes its subscription
            self._connections(mon)
          if pub in ready:
            self._subscriptions(pub)
          if rep is not None and rep in ready:
            self._replay(rep)
          if self._snapshot_due and (time.monotonic() - self._last_snapshot
                                     >= self.limits.snapshot_interval_s):
            self._snapshot(pub)
          self._drain(pub)
          if stopping:
            return
          if self._foreign_bytes > self.limits.foreign_subscription_bytes:
            break
        logging.warning("KV event subscribers sent %d bytes of subscriptions to topics this "
                        "publisher never sends; re-binding %s to free them (readers "
                        "reconnect)", self._foreign_bytes, self.bound_endpoint)
        self._close_pub(pub, mon)
        pub = mon = None
        pub, mon = self._rebind(ctx)
    except Exception:  # pylint: disable=broad-except  (a bug here must not stop serving)
      logging.exception("the KV event publisher stopped; routers no longer hear this replica")
    finally:
      if pub is not None:
        self._close_pub(pub, mon)
      if rep is not None:
        rep.close(0)

  def _rebind(self, ctx):
    """A new XPUB at the address of the one just closed (with the subscription trie its
    peers filled); readers reconnect by themselves and each gets a snapshot."""
    self._foreign_bytes = 0
    self._new_peers.clear()
    self.rebinds += 1
    deadline = time.monotonic() + _REBIND_S
    while True:
      try:
        return self._open_pub(ctx, self.bound_endpoint)
      except zmq.ZMQError:
        if time.monotonic() > deadline:  # the port was taken meanwhile: nothing to publish on
          raise
        time.sleep(0.05)

  def _connections(self, mon) -> None:
    while True:
      try:
        event = zmq_monitor.recv_monitor_message(mon, zmq.NOBLOCK)
      except zmq.Again:
        return
      if event["event"] == zmq.EVENT_ACCEPTED:
        self._new_peers.add(event["value"])
      elif event["event"] == zmq.EVENT_DISCONNECTED:
        self.peers_disconnected += 1
        self._new_peers.discard(event["value"])  # left without subscribing: owed nothing

  def _subscriptions(self, pub) -> None:
    while True:
      try:
        frame = pub.recv(zmq.NOBLOCK)
      except zmq.Again:
        return
      if frame[:1] != b"\x01":
        continue  # an unsubscription (the trie shrinks), or nothing a SUB sends
      if not self.topic.startswith(frame[1:]):  # never matches what we send
        self.subscriptions_foreign += len(frame)
        self._foreign_bytes += len(frame)
        if self._foreign_bytes > self.limits.foreign_subscription_bytes:
          return  # re-bind now: each further read lets libzmq take more into the trie
      elif self._new_peers:  # the first subscription of a new reader: tell it everything
        self._new_peers.pop()
        self._snapshot_due = True

  def _snapshot(self, pub) -> None:
    self._snapshot_due = False
    self._last_snapshot = time.monotonic()
    self.snapshots += 1
    self._send(pub, [AllBlocksCleared(), *self._ordered()])

  def _ordered(self) -> list[BlockStored]:
    """Every held block, each after its parent where the parent is held too."""
    held = self._held
    hashes = {h for h, _, _ in held}
    out, seen = [], set()
    children = collections.defaultdict(list)
    roots = []
    for item, ev in held.items():
      parent = ev.parent_block_hash
      (children[parent] if parent in hashes else roots).append(item)
    todo = list(reversed(roots))
    while todo:
      item = todo.pop()
      if item in seen:
        continue
      seen.add(item)
      out.append(held[item])
      todo.extend(reversed([c for c in children.get(item[0], ()) if c not in seen]))
    return out

  def _replay_allowed(self) -> bool:
    """A token bucket of ``replays_per_s``, one second deep."""
    now = time.monotonic()
    rate = self.limits.replays_per_s
    self._tokens = min(rate, self._tokens + (now - self._tokens_at) * rate)
    self._tokens_at = now
    if self._tokens < 1.0:
      return False
    self._tokens -= 1.0
    return True

  def _replay(self, rep) -> None:
    while True:
      try:
        frames = rep.recv_multipart(zmq.NOBLOCK)
      except zmq.Again:
        return
      if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
        self.replays_malformed += 1
        self._warn_malformed(f"{len(frames)} frames of {[len(f) for f in frames[:4]]} bytes")
        continue
      if not self._replay_allowed():
        self.replays_refused += 1
        continue
      client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
      if self._answer(rep, client, start):
        self.replays += 1
      else:
        self.replays_refused += 1

  def _answer(self, rep, client: bytes, start: int) -> bool:
    """Sends kept messages from ``start`` on, within the answer's bounds, then the end
    marker; False where the peer's queue is full or the peer is gone (the rest unsent)."""
    limits, kept = self.limits, self._kept
    skip = max(0, start - kept[0][0]) if kept else 0  # seqs in the buffer are consecutive
    size = count = 0
    try:
      for seq, payload in itertools.islice(kept, skip, None):
        if count and (size + len(payload) > limits.replay_answer_bytes
                      or count + 1 >= limits.replay_hwm):
          break  # the reader asks again from the seq after the last it got
        rep.send_multipart((client, b"", seq.to_bytes(8, "big", signed=True), payload),
                           zmq.NOBLOCK)
        size, count = size + len(payload), count + 1
      rep.send_multipart((client, b"", END_SEQ, b""), zmq.NOBLOCK)
    except zmq.ZMQError as e:  # EAGAIN: it does not read; EHOSTUNREACH: it left
      if e.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
        raise
      return False
    return True

  def _drain(self, pub) -> None:
    events = []
    while True:
      try:
        events.append(self._queue.get_nowait())
      except queue.Empty:
        break
    if events:
      self._send(pub, events)

  def _send(self, pub, events: list) -> None:
    for i in range(0, len(events), MAX_EVENTS):
      for chunk, payload in self._encoded(events[i:i + MAX_EVENTS]):
        for ev in chunk:
          self._track(ev)
        seq = self.seq
        self.seq += 1
        self._keep(seq, payload)
        pub.send_multipart((self.topic, seq.to_bytes(8, "big", signed=True), payload))
        self.sent += 1

  def _encoded(self, chunk: list):
    """``(events, payload)`` messages for ``chunk`` in order, each payload within
    ``message_bytes`` unless it is one event."""
    payload = self._encoder.encode(EventBatch(ts=time.time(), events=chunk,
                                              data_parallel_rank=self.dp_rank))
    if len(payload) <= self.limits.message_bytes or len(chunk) == 1:
      yield chunk, payload
      return
    half = len(chunk) // 2
    yield from self._encoded(chunk[:half])
    yield from self._encoded(chunk[half:])

  def _keep(self, seq: int, payload: bytes) -> None:
    self._kept.append((seq, payload))
    self._kept_bytes += len(payload)
    while len(self._kept) > 1 and (len(self._kept) > self.limits.buffer_messages
                                   or self._kept_bytes > self.limits.buffer_bytes):
      self._kept_bytes -= len(self._kept.popleft()[1])

  def _track(self, ev: Event) -> None:
    if isinstance(ev, BlockStored):
      for h in ev.block_hashes:
        self._held[h, ev.medium, ev.group_idx] = ev
    elif isinstance(ev, BlockRemoved):
      for h in ev.block_hashes:
        self._held.pop((h, ev.medium, ev.group_idx), None)
    elif isinstance(ev, AllBlocksCleared):
      self._held.clear()
