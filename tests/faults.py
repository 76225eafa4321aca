"""Faults injected around real jaxkv parts. The product code has no test hooks: each fault
here wraps the real part and changes only what the fault is about.

- ``LyingBlockServer``: a real ``BlockServer`` whose ``ship`` damages, misdescribes or
  withholds the blocks it sends (what a broken or lying peer does on the wire).
- ``SlowReads`` / ``HeldReads`` / ``FailingReads``: a real ``DiskTier``'s reads arrive
  late, are held until the test releases them, or raise.
- ``FailingWrites``: a real ``DiskTier``'s writes fail (after reaching the store, or not).
- ``link_in_place`` / ``fifo_in_place`` / ``socket_in_place``: what whoever can write a
  local store's directories (but lacks the key) plants under the names a ``DiskTier``
  uses: real symbolic links, FIFOs and sockets.
- ``FaultyFront``: a real HTTP server on loopback in front of a real jaxkv server, passing
  each request on and misbehaving in one way per request (refusing, cutting or dropping
  the stream, an engine error event, stalling, altering what the client asked).
Install a disk fault by shadowing the method on the instance (``disk.read =
SlowReads(disk, 4.0)``); ``del disk.read`` puts the real one back.
"""

import dataclasses
import json
import os
import secrets
import socket
import threading
import time

import jax
import numpy as np
import tensorstore as ts

from jaxkv.worker.tiers.disk import PendingRead
from jaxkv.worker.tiers.remote import BlockServer

SERVER_FAULTS = ("checksum", "dtype", "shape", "keys", "hang")


class LyingBlockServer(BlockServer):
  """A ``BlockServer`` that answers every fetch wrongly, one way:

  - ``checksum``: a bit of the blocks flipped after their CRC-32C was computed;
  - ``dtype``: the values sent widened, the right dtype claimed;
  - ``shape``: a wrong shape claimed;
  - ``keys``: other blocks named (the keys reversed);
  - ``hang``: no answer to the fetch ever comes (inline: only an answer to another
    request does); with the transfer transport, an offer whose pull is never served.
  Lookups are answered truthfully, so a client does ask for the blocks.
  """

  def __init__(self, cache, fault: str, **kw):
    if fault not in SERVER_FAULTS:
      raise ValueError(f"{fault=} must be one of {SERVER_FAULTS}.")
    super().__init__(cache, **kw)
    self.fault = fault
    self._unserved = None  # a transfer server that is never asked to serve anything

  def ship(self, offer, stack, transport):
    if self.fault == "checksum":
      stack = np.array(stack)
      stack.reshape(-1)[7] ^= 1
    elif self.fault == "dtype":
      stack = stack.astype(np.uint32 if stack.dtype == np.uint16 else np.uint16)
    elif self.fault == "shape":
      offer = dataclasses.replace(offer, shape=(offer.shape[0] + 1, *offer.shape[1:]))
    elif self.fault == "keys":
      offer = dataclasses.replace(offer, keys=offer.keys[::-1])
    elif self.fault == "hang":
      if transport == "inline":
        return dataclasses.replace(offer, nonce="never-asked"), []
      if self._unserved is None:
        import jax.experimental.transfer as transfer
        self._unserved = transfer.start_transfer_server(jax.local_devices()[0].client,
                                                        "127.0.0.1:0", ["127.0.0.1:0"])
      return dataclasses.replace(offer, transfer_id=secrets.randbits(63),
                                 transfer_address=self._unserved.address()), []
    return super().ship(offer, stack, transport)


class SlowReads:
  """A real ``DiskTier``'s reads, each result arriving ``delay_s`` late."""

  def __init__(self, disk, delay_s: float):
    self.real_read, self.delay_s = disk.read, delay_s

  def __call__(self, key: bytes) -> PendingRead:
    pending = self.real_read(key)
    promise, future = ts.Promise.new()

    def later():
      time.sleep(self.delay_s)
      try:
        promise.set_result(pending.future.result())
      except BaseException as e:  # pylint: disable=broad-except  (handed to the reader)
        promise.set_exception(e)

    threading.Thread(target=later, daemon=True).start()
    return dataclasses.replace(pending, future=future)


class HeldReads:
  """A real ``DiskTier``'s reads, issued to the store at once, their results held back
  until ``release()``: a store that answers no read before the test says so. ``issued``:
  the keys read; ``delivered``: how many results have been handed on. ``backstop_s``:
  the reads are released then anyway, so a reader that waits for them (a bug) gets them
  late and the test sees them delivered, rather than hanging."""

  def __init__(self, disk, backstop_s: float = 60.0):
    self.real_read, self.issued, self.delivered = disk.read, [], 0
    self._held, self._lock = [], threading.Lock()
    self._backstop = threading.Timer(backstop_s, self.release)
    self._backstop.daemon = True
    self._backstop.start()

  def __call__(self, key: bytes) -> PendingRead:
    pending = self.real_read(key)
    promise, future = ts.Promise.new()
    with self._lock:
      self.issued.append(key)
      self._held.append((pending, promise))
    return dataclasses.replace(pending, future=future)

  def release(self) -> None:
    """Hands every held read its real result (or error), in the order they were issued."""
    self._backstop.cancel()
    with self._lock:
      held, self._held = self._held, []
      for pending, promise in held:
        try:
          promise.set_result(pending.future.result())
        except BaseException as e:  # pylint: disable=broad-except  (handed to the reader)
          promise.set_exception(e)
        self.delivered += 1


class FailingReads:
  """A real ``DiskTier``'s reads: the first ``times`` reads of each record raise (the
  store's error surfaces in the read's future, as TensorStore reports I/O errors).
  ``failed[key]`` counts the reads that failed."""

  def __init__(self, disk, times: int):
    self.real_read, self.times, self.failed = disk.read, times, {}

  def __call__(self, key: bytes) -> PendingRead:
    if self.failed.get(key, 0) < self.times:
      self.failed[key] = self.failed.get(key, 0) + 1
      promise, future = ts.Promise.new()
      promise.set_exception(OSError(f"transient I/O error reading block {key.hex()[:16]}"))
      return PendingRead(key, future, time.monotonic())
    return self.real_read(key)


class FailingWrites:
  """A real ``DiskTier``'s writes, each reported failed with ``error``: issued to the
  store and failed at once (``landed=False``: the store is down), or failed only after
  the bytes were written (``landed=True``: e.g. a permission error on the rename)."""

  def __init__(self, disk, error: BaseException, *, landed: bool = False):
    self.real_write, self.error, self.landed = disk.write, error, landed

  def __call__(self, key: bytes, payload, parent):
    written = self.real_write(key, payload, parent)
    if self.landed:
      written.result(timeout=30)
    promise, future = ts.Promise.new()
    promise.set_exception(self.error)
    return future


# ---- what whoever can write a local store's directories plants there ------------------------
def link_in_place(path: str, target: str) -> str | None:
  """Puts a symbolic link to ``target`` at ``path``; what was there (a file or a directory)
  is moved aside to ``path + '.aside'``, whose name is returned (None if nothing was)."""
  path = path.rstrip("/")
  aside = None
  if os.path.lexists(path):
    aside = path + ".aside"
    os.rename(path, aside)
  os.symlink(target, path)
  return aside


def fifo_in_place(path: str) -> None:
  """Puts a FIFO at ``path`` (what was there is removed): a read of it that opens it
  blocking waits forever for a writer."""
  if os.path.lexists(path):
    os.unlink(path)
  os.mkfifo(path, 0o600)


def socket_in_place(path: str) -> None:
  """Puts a Unix socket at ``path`` (bound, then closed: the name stays). Changes the
  working directory while it binds (a record's path is longer than a socket address may
  be): call it in a child process, not in the test process."""
  if os.path.lexists(path):
    os.unlink(path)
  here = os.getcwd()
  os.chdir(os.path.dirname(path))
  try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
      s.bind(os.path.basename(path))
  finally:
    os.chdir(here)


FRONT_FAULTS = ("busy", "token_900", "no_token_ids", "cut", "drop", "engine_error", "stall")


class _Dropped(Exception):
  """Raised inside the front's app once a response has started: uvicorn then closes the
  connection in the middle of the body (what a crashed server or a cut link does)."""


class FaultyFront:
  """A real HTTP server (uvicorn, in a thread, on loopback) in front of the real server at
  ``upstream`` (its base, e.g. ``http://127.0.0.1:PORT``). Each POST takes the next entry
  of ``faults`` (then ``default``; None passes it on untouched):

  - ``busy``: 429 and an error body, the server not asked (a server that stays full); the
    k-th answer to one request body says ``Retry-After: busy_retry_after[k]`` (the last
    entry from then on);
  - ``token_900``: the prompt's first id changed to 900 before it is passed on (the server's
    own refusal comes back);
  - ``no_token_ids``: ``return_token_ids`` taken out of the request (as a server that
    ignores it streams);
  - ``cut``: the server's stream up to its first event with tokens, then the response ends
    (no ``[DONE]``); ``drop``: the same, then the connection is closed mid-body;
  - ``engine_error``: the first event with tokens, then the error event the server sends
    when its engine fails, and ``[DONE]``;
  - ``stall``: the first event with tokens, then nothing until the client goes away.

  ``seen``: per POST, ``(path, the body as the client sent it, the events the client got,
  parsed)``. ``url``: the API base to give clients (``.../v1``)."""

  def __init__(self, upstream: str):
    import uvicorn
    self.upstream = upstream.rstrip("/")
    self.faults: list = []
    self.default = None
    self.seen: list = []
    self.busy_retry_after = ["0"]
    self._busy: dict = {}  # request body -> 429s it was given
    config = uvicorn.Config(self._app, host="127.0.0.1", port=0, log_level="error",
                            interface="asgi3",
                            lifespan="off")
    self._server = uvicorn.Server(config)
    self._thread = threading.Thread(target=self._server.run, daemon=True)
    self._thread.start()
    while not self._server.started:
      if not self._thread.is_alive():
        raise RuntimeError("the fault front did not start")
      time.sleep(0.01)
    port = self._server.servers[0].sockets[0].getsockname()[1]
    self.url = f"http://127.0.0.1:{port}/v1"

  def close(self) -> None:
    self._server.should_exit = True
    self._thread.join(30)

  async def _app(self, scope, receive, send):
    import httpx
    raw = b""
    while True:
      message = await receive()
      raw += message.get("body", b"")
      if not message.get("more_body"):
        break
    fault = (self.faults.pop(0) if self.faults else self.default) if scope[
        "method"] == "POST" else None
    if fault is not None and fault not in FRONT_FAULTS:
      raise ValueError(f"{fault=} must be one of {FRONT_FAULTS}")
    body = json.loads(raw) if raw else None
    events: list = []
    if scope["method"] == "POST":
      self.seen.append((scope["path"], body, events))
    if fault == "busy":
      k = self._busy[raw] = self._busy.get(raw, -1) + 1
      wait = self.busy_retry_after[min(k, len(self.busy_retry_after) - 1)]
      await send({"type": "http.response.start", "status": 429, "headers": [
          (b"content-type", b"application/json"), (b"retry-after", wait.encode())]})
      await send({"type": "http.response.body", "body": json.dumps(
          {"error": {"message": "busy", "type": "rate_limit_error"}}).encode()})
      return
    if fault == "token_900":
      body = {**body, "prompt": [900, *body["prompt"][1:]]}
    elif fault == "no_token_ids":
      body = {k: v for k, v in body.items() if k != "return_token_ids"}
    headers = {k.decode(): v.decode() for k, v in scope["headers"]
               if k.lower() in (b"authorization", b"content-type")}
    url = self.upstream + scope["path"]
    async with httpx.AsyncClient(timeout=120.0) as client:
      async with client.stream(scope["method"], url, headers=headers,
                               content=json.dumps(body).encode() if body is not None else b""
                               ) as response:
        keep = [(k.encode(), v.encode()) for k, v in response.headers.items()
                if k.lower() in ("content-type", "retry-after")]
        await send({"type": "http.response.start", "status": response.status_code,
                    "headers": keep})
        if response.status_code != 200 or "text/event-stream" not in response.headers.get(
            "content-type", ""):
          await send({"type": "http.response.body", "body": await response.aread()})
          return
        async for line in response.aiter_lines():
          if not line.startswith("data:"):
            continue
          payload = line[5:].strip()
          events.append(payload if payload == "[DONE]" else json.loads(payload))
          await send({"type": "http.response.body", "body": (line + "\n\n").encode(),
                      "more_body": True})
          if fault in ("cut", "drop", "engine_error", "stall") and _carries_tokens(events[-1]):
            break
      # The server's stream is closed here (it sees the client go and aborts the request).
    if fault == "engine_error":
      error = {"error": {"message": "the engine failed while generating this answer; retry "
                                    "the request.", "type": "server_error", "code": None,
                         "param": None}}
      events.extend([error, "[DONE]"])
      await send({"type": "http.response.body", "more_body": True,
                  "body": f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()})
    elif fault == "drop":
      raise _Dropped("the connection is closed in the middle of the stream")
    elif fault == "stall":
      while (await receive())["type"] != "http.disconnect":
        pass
      return
    await send({"type": "http.response.body", "body": b""})


def _carries_tokens(event) -> bool:
  """An event of a streamed answer with tokens in it (ids, text or chat content)."""
  if not isinstance(event, dict):
    return False
  return any(c.get("token_ids") or c.get("text") or (c.get("delta") or {}).get("content")
             for c in event.get("choices") or ())
