"""What one request may cost the API server's event loop and its answer: a real
``OpenAIServer`` over a tiny engine, served by uvicorn under its ``HttpLimits`` on loopback
in this process, driven with raw sockets. A large token-id body is parsed and checked off
the loop (another client's /health is answered first), and a request whose answer would
hold more log-probability entries than the server gives one request is refused up front.

Every request here is refused before it reaches the engine, so nothing is compiled."""

import json
import select
import socket
import threading
import time

import pytest
import uvicorn

import helpers
from jaxkv.config import MAX_LOGPROB_ENTRIES
from jaxkv.entrypoints.openai import limits
from jaxkv.entrypoints.openai.server import OpenAIServer
from jaxkv.serving.service import EngineService

BIG_BODY_BYTES = 24 << 20  # the size of token list that stalled every client for seconds


@pytest.fixture(scope="module")
def front(mesh):
  engine = helpers.make_engine(mesh)  # max context 32 pages x 4 = 128 tokens, vocabulary 128
  service = EngineService(engine)  # not started: nothing here reaches it
  api = OpenAIServer(service, model_name="m", max_body_bytes=BIG_BODY_BYTES + (1 << 20),
                     request_timeout_s=5.0)
  api.ready = True
  sock = socket.socket()
  sock.bind(("127.0.0.1", 0))
  server = uvicorn.Server(limits.uvicorn_config(api.app, limits.HttpLimits(),
                                                log_level="warning", access_log=False))
  thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
  thread.start()
  try:
    helpers.wait_for(lambda: server.started, 30, "the test's API server listens")
    yield {"port": sock.getsockname()[1], "api": api}
  finally:
    server.should_exit = True
    thread.join(30)
    sock.close()
    service.close()


def post(port: int, path: str, body: bytes) -> socket.socket:
  sock = socket.create_connection(("127.0.0.1", port), timeout=60)
  sock.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               f"content-length: {len(body)}\r\n\r\n".encode() + body)
  return sock


def answer(sock: socket.socket) -> tuple[int, dict]:
  """The status and JSON body of the answer on ``sock`` (read to its content-length)."""
  data = b""
  while b"\r\n\r\n" not in data:
    chunk = sock.recv(65536)
    assert chunk, f"closed with no answer ({data!r})"
    data += chunk
  head, _, rest = data.partition(b"\r\n\r\n")
  length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:"))
  while len(rest) < length:
    chunk = sock.recv(65536)
    assert chunk, "closed mid-answer"
    rest += chunk
  return int(head.split(b" ", 2)[1]), json.loads(rest)


def test_a_large_token_id_body_is_checked_off_the_loop(front):
  ids = ("5," * (BIG_BODY_BYTES // 2 - 64)).rstrip(",")
  body = f'{{"model": "m", "max_tokens": 1, "prompt": [{ids}]}}'.encode()
  big = post(front["port"], "/v1/completions", body)
  try:
    time.sleep(0.3)  # the server has read the body (loopback) and is parsing it
    probe = socket.create_connection(("127.0.0.1", front["port"]), timeout=60)
    try:
      probe.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
      readable, _, _ = select.select([big, probe], [], [], 60)
      # /health is answered while the big body is parsed and its ids checked: it was
      # sent after the body, and its answer comes first.
      assert readable == [probe], "the big body's parse held the event loop"
      assert answer(probe)[0] in (200, 503)
    finally:
      probe.close()
    status, out = answer(big)  # then the big one is refused: longer than the context
    assert status == 400 and out["error"]["param"] == "max_tokens", out
  finally:
    big.close()


def test_echo_and_logprobs_over_a_batch_past_the_bound_are_refused_up_front(front):
  prompts = [[(i * 7 + j) % 120 + 1 for j in range(100)] for i in range(64)]
  request = {"model": "m", "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 20}
  entries = 64 * (100 + 1) * 21
  assert entries > MAX_LOGPROB_ENTRIES  # (the request is small: ~25 KB)
  sock = post(front["port"], "/v1/completions", json.dumps(request).encode())
  try:
    status, out = answer(sock)
  finally:
    sock.close()
  assert status == 400, out
  message = out["error"]["message"]
  assert out["error"]["param"] == "logprobs"
  assert f"{entries} log-probability entries" in message and str(MAX_LOGPROB_ENTRIES) in message
  assert "send fewer prompts per request" in message
