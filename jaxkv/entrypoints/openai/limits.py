"""What an HTTP connection may cost the server before its request reaches a handler.

API keys are checked by the handlers, so everything before them is open to anyone who can
reach the port: the connection, the request line, the headers, the body. Each gets a bound
here, enforced by ``BoundedHttpToolsProtocol`` (uvicorn's httptools protocol, which itself
bounds none of them: a header that never ends is buffered whole, and a connection that
sends nothing is kept forever):

- ``max_connections``: connections open at once; one more is answered 503 and closed at
  once (so a flood of idle connections cannot use up the process's file descriptors).
- ``max_head_bytes`` / ``max_headers`` / ``max_url_bytes``: the request line and headers
  (431 or 414, then the connection closes; bytes received while the headers are incomplete
  are counted, so at most one read beyond the bound is ever buffered).
- ``head_timeout_s``: from a connection's start, or a request's first byte, to the end of
  its headers (408). ``body_timeout_s``: from the end of the headers to the end of the
  body (408; the handler sees the client gone). ``keep_alive_s``: an idle keep-alive
  connection is closed.

``uvicorn_config(app, limits, host=..., port=...)`` builds the uvicorn ``Config`` that
serves ``app`` under these bounds (what ``launch/server.py`` runs).
"""

from __future__ import annotations

import dataclasses
import resource

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from jaxkv.errors import InputError

LINGER_S = 2.0  # how long a refused connection is read (and dropped) before it closes
_REASONS = {408: b"Request Timeout", 414: b"URI Too Long",
            431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}


def default_max_connections() -> int:
  """Half the process's file-descriptor limit (the rest stays for the model's files, its
  stores and its peers), at most 1,000."""
  soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
  return max(8, min(1000, soft // 2)) if soft != resource.RLIM_INFINITY else 1000


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpLimits:
  """Bounds on a connection before its request reaches a handler (see the module)."""

  max_connections: int = dataclasses.field(default_factory=default_max_connections)
  max_head_bytes: int = 64 * 1024
  max_headers: int = 100
  max_url_bytes: int = 8 * 1024
  head_timeout_s: float = 10.0
  body_timeout_s: float = 30.0
  keep_alive_s: float = 5.0

  def __post_init__(self):
    for name in ("max_connections", "max_head_bytes", "max_headers", "max_url_bytes"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"HttpLimits.{name}={value!r} must be an integer >= 1.")
    for name in ("head_timeout_s", "body_timeout_s", "keep_alive_s"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
        raise InputError(f"HttpLimits.{name}={value!r} must be a number of seconds > 0.")


class BoundedHttpToolsProtocol(HttpToolsProtocol):
  """uvicorn's httptools protocol under ``HttpLimits`` (``config.jaxkv_limits``)."""

  def __init__(self, config, server_state, app_state, _loop=None):
    super().__init__(config, server_state, app_state, _loop)
    self.limits: HttpLimits = config.jaxkv_limits
    self._in_head = True  # the headers of the next request are not complete yet
    self._head_bytes = 0
    self._num_headers = 0
    self._url_bytes = 0
    self._timer = None  # the head or body deadline
    self._refused = False

  # ---- the connection ---------------------------------------------------------------------------
  def connection_made(self, transport) -> None:
    super().connection_made(transport)
    if len(self.connections) > self.limits.max_connections:
      self._refuse(503, f"this server holds {self.limits.max_connections} connections, its "
                   "limit; retry shortly.")
      return
    self._arm(self.limits.head_timeout_s, "the request's headers")

  def connection_lost(self, exc) -> None:
    self._disarm()
    super().connection_lost(exc)

  def data_received(self, data: bytes) -> None:
    if self._refused:
      return
    if self._in_head and self._timer is None:  # a keep-alive connection's next request
      self._arm(self.limits.head_timeout_s, "the request's headers")
    super().data_received(data)
    if self._in_head and not self._refused:
      self._head_bytes += len(data)
      if self._head_bytes > self.limits.max_head_bytes:
        self._refuse(431, f"the request line and headers are more than "
                     f"{self.limits.max_head_bytes} bytes, the most this server reads.")

  # ---- the parser's callbacks -------------------------------------------------------------------
  def on_message_begin(self) -> None:
    super().on_message_begin()
    self._in_head, self._num_headers, self._url_bytes = True, 0, 0

  def on_url(self, url: bytes) -> None:
    self._url_bytes += len(url)
    if self._url_bytes > self.limits.max_url_bytes:
      self._refuse(414, f"the request's URL is more than {self.limits.max_url_bytes} bytes.")
      return
    super().on_url(url)

  def on_header(self, name: bytes, value: bytes) -> None:
    self._num_headers += 1
    if self._num_headers > self.limits.max_headers:
      self._refuse(431, f"the request has more than {self.limits.max_headers} headers.")
      return
    super().on_header(name, value)

  def on_headers_complete(self) -> None:
    if self._refused:
      return
    self._in_head, self._head_bytes = False, 0
    self._disarm()
    super().on_headers_complete()
    self._arm(self.limits.body_timeout_s, "the request's body")

  def on_body(self, body: bytes) -> None:
    if not self._refused:
      super().on_body(body)

  def on_message_complete(self) -> None:
    if self._refused:
      return
    self._disarm()
    super().on_message_complete()

  def on_response_complete(self) -> None:
    self._in_head, self._head_bytes = True, 0
    super().on_response_complete()  # arms the keep-alive timeout; a next byte arms ours

  # ---- refusing ---------------------------------------------------------------------------------
  def _arm(self, seconds: float, what: str) -> None:
    self._disarm()
    self._timer = self.loop.call_later(seconds, self._late, seconds, what)

  def _disarm(self) -> None:
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None

  def _late(self, seconds: float, what: str) -> None:
    self._timer = None
    if self.cycle is not None and not self._in_head:  # the body is late: the handler waits
      self.cycle.disconnected = True
      self.cycle.message_event.set()
      if self.cycle.response_started:
        self.transport.close()
        return
    self._refuse(408, f"{what} did not arrive within {seconds:g} s.")

  def _refuse(self, status: int, message: str) -> None:
    """Answers ``status`` with ``message`` (unless a response began) and closes: first the
    sending side, then, after ``LINGER_S`` of reading and dropping whatever the client
    still sends, the connection (closing at once, with bytes unread, would reset it and
    could destroy the answer before the client reads it)."""
    if self._refused:
      return
    self._refused = True
    self._disarm()
    if self.transport.is_closing():
      return
    started = self.cycle is not None and self.cycle.response_started and not (
        self.cycle.response_complete)
    if started:
      self.transport.close()
      return
    body = message.encode()
    self.transport.write(b"".join([
        b"HTTP/1.1 %d %s\r\n" % (status, _REASONS[status]),
        b"content-type: text/plain; charset=utf-8\r\n",
        b"content-length: %d\r\n" % len(body), b"connection: close\r\n\r\n", body]))
    if self.transport.can_write_eof():
      self.transport.write_eof()
    self._timer = self.loop.call_later(LINGER_S, self.transport.close)


def uvicorn_config(app, limits: HttpLimits | None = None, **kwargs) -> uvicorn.Config:
  """A uvicorn ``Config`` serving ``app`` with ``limits`` (defaults: ``HttpLimits()``)."""
  limits = limits or HttpLimits()
  config = uvicorn.Config(app, http=BoundedHttpToolsProtocol,
                          timeout_keep_alive=limits.keep_alive_s, **kwargs)
  config.jaxkv_limits = limits
  return config
