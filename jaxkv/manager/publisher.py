"""Sends KV events (``jaxkv.manager.events``) over ZeroMQ as vLLM does, so routers read them.

The wire, as vLLM's ``kv_events`` writes it and Dynamo's KV indexer reads it:

- a PUB socket (here an XPUB: it also learns when a subscriber connects) bound at
  ``endpoint``; each message is three frames, ``(topic, seq, payload)``: ``seq`` 8 bytes
  big-endian, one more per message, and ``payload`` msgpack ``[ts, events,
  data_parallel_rank]`` with events as tagged maps (``{"type": "BlockStored", ...}``);
- a ROUTER socket at ``replay`` that answers a request ``(b"", start seq as 8 bytes)`` with
  every kept message from that seq on as ``(b"", seq, payload)``, then ``(b"", -1, b"")``.
  The last ``buffer`` messages are kept.

Two things vLLM's publisher leaves to the reader are done here:

- Sequence numbers start at the microseconds since the epoch, not at 0, so a replica that
  restarts continues above where it stopped: a reader that saw the old run takes the jump as
  a gap and asks the replay socket, whose answer starts with ``AllBlocksCleared``. (A
  reader that drops what is below the last seq it saw ignores a run restarted from 0.)
- When a subscriber connects (a router that started late, or reconnected), the publisher
  sends a snapshot: ``AllBlocksCleared`` and a ``BlockStored`` for every block held now,
  parents first, so a reader that joins late sees what was stored before it came.

One thread owns the sockets: events are queued by the thread that changed the index
(``put``) and sent in order, up to ``MAX_EVENTS`` per message. ``close`` stops it.
"""

from __future__ import annotations

import collections
import queue
import threading
import time

import msgspec
import zmq
from absl import logging

from jaxkv.config import check_endpoint
from jaxkv.errors import InputError
from jaxkv.manager.events import (AllBlocksCleared, BlockRemoved, BlockStored, Event,
                                  EventBatch)

MAX_EVENTS = 1024  # per message
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 5  # an event waits at most this long in the queue


class EventPublisher:
  """Publishes events on ``endpoint`` (and answers replays on ``replay``) from a thread.

  ``topic``: the first frame of every message. ``buffer``: messages kept for replay.
  ``dp_rank``: the payload's ``data_parallel_rank``. Binding happens before the
  constructor returns; a port in use raises ``InputError``."""

  def __init__(self, endpoint: str, *, replay: str | None = None, topic: str = "",
               buffer: int = 10000, dp_rank: int = 0, hwm: int = 100_000):
    self.endpoint = check_endpoint(endpoint, "kv_events")
    self.replay_endpoint = check_endpoint(replay, "kv_events_replay") if replay else None
    self.topic, self.dp_rank, self.hwm = topic.encode(), dp_rank, hwm
    self._kept: collections.deque = collections.deque(maxlen=max(1, buffer))
    self._queue: queue.SimpleQueue = queue.SimpleQueue()
    self._held: dict[tuple[int, str | None], BlockStored] = {}  # what a snapshot tells
    self._encoder = msgspec.msgpack.Encoder()
    self._stop = threading.Event()
    self._bound = threading.Event()
    self._error: BaseException | None = None
    self.seq = time.time_ns() // 1000
    self.sent = self.replays = self.snapshots = 0
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

  def close(self, timeout_s: float = 5.0) -> None:
    """Sends what is queued, then stops the thread and closes the sockets."""
    self._stop.set()
    self._thread.join(timeout_s)
    if self._thread.is_alive():
      logging.warning("the KV event publisher did not stop in %.1f s", timeout_s)

  # ---- the thread -----------------------------------------------------------------------------
  def _run(self) -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.XPUB)
    rep = ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
    try:
      pub.setsockopt(zmq.XPUB_VERBOSE, 1)  # every subscription, also a repeated one
      pub.setsockopt(zmq.SNDHWM, self.hwm)
      pub.setsockopt(zmq.LINGER, 0)
      for sock, where, flag in ((pub, self.endpoint, "kv_events"),
                                (rep, self.replay_endpoint, "kv_events_replay")):
        if sock is None:
          continue
        try:
          sock.bind(where)
        except zmq.ZMQError as e:
          raise InputError(f"{flag}={where!r}: cannot listen there ({e}); pick a free "
                           "port.") from None
      self.bound_endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
      if rep is not None:
        rep.setsockopt(zmq.LINGER, 0)
        self.bound_replay = rep.getsockopt_string(zmq.LAST_ENDPOINT)
    except BaseException as e:  # pylint: disable=broad-except  (raised in the constructor)
      self._error = e
      for sock in (pub, rep):
        if sock is not None:
          sock.close(0)
      self._bound.set()
      return
    self._bound.set()
    poller = zmq.Poller()
    poller.register(pub, zmq.POLLIN)
    if rep is not None:
      poller.register(rep, zmq.POLLIN)
    try:
      while True:
        stopping = self._stop.is_set()
        ready = dict(poller.poll(0 if stopping else _POLL_MS))
        if pub in ready:
          self._subscriptions(pub)
        if rep is not None and rep in ready:
          self._replay(rep)
        self._drain(pub)
        if stopping:
          return
    except Exception:  # pylint: disable=broad-except  (a bug here must not stop serving)
      logging.exception("the KV event publisher stopped; routers no longer hear this replica")
    finally:
      for sock in (pub, rep):
        if sock is not None:
          sock.close(0)

  def _subscriptions(self, pub) -> None:
    joined = False
    while True:
      try:
        frame = pub.recv(zmq.NOBLOCK)
      except zmq.Again:
        break
      joined = joined or frame[:1] == b"\x01"
    if joined:  # a reader came (or came back): tell it everything held now
      self.snapshots += 1
      self._send(pub, [AllBlocksCleared(), *self._ordered()])

  def _ordered(self) -> list[BlockStored]:
    """Every held block, each after its parent where the parent is held too."""
    held = self._held
    hashes = {h for h, _ in held}
    out, seen = [], set()
    children = collections.defaultdict(list)
    roots = []
    for (h, medium), ev in held.items():
      parent = ev.parent_block_hash
      (children[parent] if parent in hashes else roots).append((h, medium))
    todo = list(reversed(roots))
    while todo:
      item = todo.pop()
      if item in seen:
        continue
      seen.add(item)
      out.append(held[item])
      todo.extend(reversed([c for c in children.get(item[0], ()) if c not in seen]))
    return out

  def _replay(self, rep) -> None:
    while True:
      try:
        frames = rep.recv_multipart(zmq.NOBLOCK)
      except zmq.Again:
        return
      if len(frames) != 3 or len(frames[2]) != 8:
        logging.warning("a KV event replay request with %d frames was ignored (expected "
                        "identity, empty, 8-byte seq)", len(frames))
        continue
      client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
      self.replays += 1
      for seq, payload in list(self._kept):
        if seq >= start:
          rep.send_multipart((client, b"", seq.to_bytes(8, "big", signed=True), payload))
      rep.send_multipart((client, b"", END_SEQ, b""))

  def _drain(self, pub) -> None:
    events = []
    while True:
      try:
        events.append(self._queue.get_nowait())
      except queue.Empty:
        break
    if events:
      self._send(pub, events)  # MAX_EVENTS to a message

  def _send(self, pub, events: list) -> None:
    for i in range(0, len(events), MAX_EVENTS):
      chunk = events[i:i + MAX_EVENTS]
      for ev in chunk:
        self._track(ev)
      payload = self._encoder.encode(EventBatch(ts=time.time(), events=chunk,
                                                data_parallel_rank=self.dp_rank))
      seq = self.seq
      self.seq += 1
      self._kept.append((seq, payload))
      pub.send_multipart((self.topic, seq.to_bytes(8, "big", signed=True), payload))
      self.sent += 1

  def _track(self, ev: Event) -> None:
    if isinstance(ev, BlockStored):
      for h in ev.block_hashes:
        self._held[h, ev.medium] = ev
    elif isinstance(ev, BlockRemoved):
      for h in ev.block_hashes:
        self._held.pop((h, ev.medium), None)
    elif isinstance(ev, AllBlocksCleared):
      self._held.clear()
