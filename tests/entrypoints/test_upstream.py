"""``upstream.relay_events``, the router's and the P/D proxy's pass-through of a streamed
answer, against an upstream on loopback that writes given bytes as HTTP/1.1 chunks and then
either ends its body or drops the connection mid-body (as a killed process does). Whole
events pass as they come; a stream broken before ``[DONE]`` ends at an event's boundary with
one error event and ``[DONE]``. No engine, no model: milliseconds a case.

The process tests (tests/combos/test_process_combos.py for the router,
tests/launch/test_pd.py for the proxy) kill real servers mid-stream."""

import asyncio
import json
import socket
import threading

import httpx

from jaxkv.entrypoints.openai import upstream

EVENTS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n']
DONE = b"data: [DONE]\n\n"


def serve_once(chunks: list[bytes], *, finish: bool) -> tuple[str, threading.Thread]:
  """A one-connection upstream: answers 200 text/event-stream with ``chunks``, one HTTP
  chunk each, then the body's last chunk (``finish``) or a closed socket (a break)."""
  listener = socket.create_server(("127.0.0.1", 0))
  listener.settimeout(30)

  def run():
    with listener, listener.accept()[0] as conn:
      conn.settimeout(30)
      data = b""
      while b"\r\n\r\n" not in data:
        data += conn.recv(65536) or b"\r\n\r\n"
      conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                   b"transfer-encoding: chunked\r\n\r\n")
      for c in chunks:
        conn.sendall(b"%x\r\n%s\r\n" % (len(c), c))
      if finish:
        conn.sendall(b"0\r\n\r\n")

  thread = threading.Thread(target=run, daemon=True)
  thread.start()
  return f"http://127.0.0.1:{listener.getsockname()[1]}", thread


def relay(chunks: list[bytes], *, finish: bool, **kwargs) -> tuple[bytes, list[str]]:
  """What a client of ``relay_events`` gets from such an upstream, and each ``why`` it was
  told of a break."""
  url, thread = serve_once(chunks, finish=finish)
  breaks = []

  def on_break(why):
    breaks.append(why)
    return "the upstream broke off"

  async def main():
    async with httpx.AsyncClient(timeout=30) as client:
      resp = await client.send(client.build_request("GET", url), stream=True)
      try:
        return b"".join([c async for c in upstream.relay_events(resp, on_break, **kwargs)])
      finally:
        await resp.aclose()

  got = asyncio.run(main())
  thread.join(30)
  return got, breaks


def said_broken(tail: bytes) -> None:
  """``tail`` is one error event of OpenAI's shape, then [DONE]."""
  event, done, rest = tail.split(b"\n\n")
  assert done == b"data: [DONE]" and rest == b"", tail
  assert json.loads(event.removeprefix(b"data: ")) == {"error": {
      "message": "the upstream broke off", "type": "server_error",
      "code": upstream.BROKEN_CODE, "param": None}}


def test_a_whole_stream_passes_unchanged_even_cut_into_single_bytes():
  whole = b"".join(EVENTS) + DONE
  for chunks in ([whole], [whole[i:i + 1] for i in range(len(whole))]):
    got, breaks = relay(chunks, finish=True)
    assert got == whole and breaks == []


def test_a_connection_dropped_mid_event_ends_at_the_last_whole_event_with_an_error():
  half = EVENTS[1][:-6]  # (its "b" is in no other event)
  got, breaks = relay([EVENTS[0], half], finish=False)
  assert got.startswith(EVENTS[0]) and half not in got, got
  said_broken(got[len(EVENTS[0]):])
  assert len(breaks) == 1 and "RemoteProtocolError" in breaks[0], breaks


def test_a_body_ended_before_done_is_a_break_too():
  got, breaks = relay(EVENTS, finish=True)
  assert got.startswith(b"".join(EVENTS))
  said_broken(got[len(b"".join(EVENTS)):])
  assert breaks == ["it ended the stream before its [DONE]"]


def test_an_event_over_the_bound_is_passed_in_pieces_and_a_break_inside_it_still_said():
  """Nothing past ``max_held_bytes`` waits for its blank line; a break inside such an event
  ends it with a blank line before the error event."""
  big = b'data: {"choices":[{"text":"' + b"x" * 300
  got, breaks = relay([EVENTS[0], big[:150], big[150:]], finish=False, max_held_bytes=100)
  assert got.startswith(EVENTS[0] + big), got[:80]
  said_broken(got[len(EVENTS[0] + big) + 2:])
  assert got[len(EVENTS[0] + big):][:2] == b"\n\n" and len(breaks) == 1
