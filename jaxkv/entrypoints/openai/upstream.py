"""A stream of server-sent events from an upstream server (a router's replica, the P/D
proxy's decode node) passed on to the client, and a stream the upstream breaks said so.

An answer streamed by a jaxkv server (or vLLM) is a run of ``data: ...`` events ending with
``data: [DONE]``; a server's own mid-stream error is an error event (OpenAI's error object,
``protocol.error_event``) and then ``[DONE]``. When the upstream breaks its stream instead
(the process died, the connection was reset, it went silent past the timeout, it closed
the stream before ``[DONE]``), a front that passed on the bytes as they came would leave
its client with a stream that just stops, or with half an event. ``relay_events`` passes
on whole events as they come (a partial event is held until its blank line), and on a
break ends what was passed on at an event's boundary, then sends the client an error event
of the same form as the server's own, with ``code`` ``BROKEN_CODE``, and ``[DONE]``.

What an upstream's bytes may cost: an event is held until its end only up to
``MAX_HELD_BYTES`` (an event longer than that, e.g. an echoed long prompt's
log-probabilities, is passed on in pieces: should the stream break inside such an event,
the client sees that one event cut short before the error event).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx

from jaxkv.entrypoints.openai.protocol import error_event

BROKEN_CODE = "upstream_stream_broken"
MAX_HELD_BYTES = 1 << 20
_DONE = b"data: [DONE]"
_SEPARATORS = (b"\n\n", b"\r\n\r\n", b"\r\r")  # the blank line that ends an event


def _last_boundary(held: bytearray, start: int) -> int:
  """The offset just past the last blank line in ``held`` at or after ``start`` (0: none)."""
  ends = [i + len(sep) for sep in _SEPARATORS if (i := held.rfind(sep, start)) >= 0]
  return max(ends, default=0)


def _ends_done(data: bytes | bytearray) -> bool:
  return bytes(data).rstrip().endswith(_DONE)


async def relay_events(resp: httpx.Response, on_break: Callable[[str], str], *,
                       max_held_bytes: int = MAX_HELD_BYTES) -> AsyncIterator[bytes]:
  """``resp``'s events as they come; if its stream breaks before ``[DONE]``,
  ``on_break(why)`` (``why``: what broke, for the log) counts the break and returns the
  message of the error event the client is sent before ``[DONE]``. ``resp`` is left open
  (the caller closes it)."""
  held, done, cut_open = bytearray(), False, False
  try:
    async for chunk in resp.aiter_raw():
      start = max(0, len(held) - 3)  # a separator may straddle the chunks
      held += chunk
      end = _last_boundary(held, start)
      if end:
        out = bytes(held[:end])
        del held[:end]
        done, cut_open = _ends_done(out), False
        yield out
      if len(held) > max_held_bytes:  # one event this long: passed on in pieces
        out = bytes(held)
        held.clear()
        done, cut_open = False, True
        yield out
    if held.strip() and _ends_done(held):  # the last event without its blank line
      yield bytes(held) + b"\n\n"
      return
    if done and not held.strip():
      return
    why = "it ended the stream before its [DONE]"
  except httpx.HTTPError as e:
    why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
  message = on_break(why)
  # A partial event held back is dropped; one passed on in pieces is ended as it stands.
  lead = "\n\n" if cut_open else ""
  yield (lead + error_event(message, "server_error", code=BROKEN_CODE)
         + "data: [DONE]\n\n").encode()
