"""A prefill node and a decode node driven as one OpenAI-compatible server (``make_app``).

Each POST /v1/completions or /v1/chat/completions goes to the prefill node with
``max_tokens=1``, ``stream=false``, no log-probabilities and ``kv_transfer_params:
{"do_remote_decode": true}``; the ``kv_transfer_params`` of its answer (the prompt's blocks
are in the pool by then) go on with the original request to the decode node, whose answer
(streamed or not) is passed back as it comes. The Authorization header goes to both. A
prefill that fails is answered with its error; the decode node is not asked. GET /v1/models
and /health are the decode node's.

What a client's bytes may cost the proxy, before either node has checked its key:
- the connection, the request line, the headers and slow clients are bounded by the
  ``HttpLimits`` the process serves under (``launch/_common.serve_app``), as the API
  server's are;
- the body is read with ``protocol.read_body``: a ``content-length`` over
  ``max_body_bytes`` is refused (413) before a byte of the body is read, a chunked body as
  soon as it passes the bound, and a body over ``PARSE_ON_LOOP_BYTES`` is parsed in a
  worker thread, so that one client's big token list stalls no other client;
- the prefill node's answer is read up to ``MAX_PREFILL_ANSWER_BYTES`` (its text is one
  token and is dropped; only its ``kv_transfer_params`` are used), so a node that answers
  without end costs the proxy a bounded buffer, and is parsed off the loop when large.
The decode node's answer is streamed through as it comes (never buffered whole). A stream
the decode node breaks before ``[DONE]`` (it died, reset the connection) ends with an error
event (OpenAI's error object, code ``upstream_stream_broken``) and ``[DONE]``, as a
server's own mid-stream error does (``upstream.relay_events``).
"""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
from absl import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxkv.entrypoints.openai import protocol
from jaxkv.entrypoints.openai.upstream import relay_events

# A prefill answer is one token's choice and the hand-off's parameters: a few KiB. More
# than this is a node gone wrong; the proxy answers 502 rather than buffer it.
MAX_PREFILL_ANSWER_BYTES = 1 << 20
# Fields dropped from the prefill request: its answer is discarded (one token), so asking
# it for log-probabilities (with echo, of the whole prompt) would only cost it and us.
_PREFILL_DROPS = ("max_completion_tokens", "stream_options", "logprobs", "top_logprobs",
                  "echo")


def make_app(prefill: str, decode: str, *, timeout_s: float,
             max_body_bytes: int = protocol.MAX_BODY_BYTES) -> FastAPI:
  """The proxy's app over the nodes' base URLs (``http://HOST:PORT``, no trailing slash)."""
  api = FastAPI(title="jaxkv pd proxy", docs_url=None, redoc_url=None, openapi_url=None)
  client = httpx.AsyncClient(timeout=timeout_s)

  def headers(request: Request) -> dict:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}

  def error(status: int, message: str) -> JSONResponse:
    return protocol.ApiError(status, message, "server_error").response()

  async def relay(request: Request, path: str):
    try:
      raw = await protocol.read_body(request, max_body_bytes)
      body = await protocol.parse_body(raw)
    except protocol.ApiError as e:
      return e.response()
    large = len(raw) > protocol.PARSE_ON_LOOP_BYTES  # encoded off the loop too
    # The prefill node computes the prompt once (one choice: its blocks are what the
    # decode node's n choices share).
    first = dict(body, max_tokens=1, n=1, stream=False,
                 kv_transfer_params={"do_remote_decode": True})
    for name in _PREFILL_DROPS:
      first.pop(name, None)
    try:
      status, content_type, raw = await _bounded_post(
          client, f"{prefill}{path}", await _encode(first, large), headers(request),
          MAX_PREFILL_ANSWER_BYTES)
    except httpx.HTTPError as e:
      return error(502, f"the prefill node did not answer: {e}")
    except _TooLarge:
      return error(502, f"the prefill node's answer is more than {MAX_PREFILL_ANSWER_BYTES} "
                   "bytes (it should be one token's); check the node given as --prefill.")
    if status != 200:
      return Response(raw, status_code=status, media_type=content_type)
    try:
      params = (await protocol.parse_body(raw)).get("kv_transfer_params")
    except protocol.ApiError as e:
      return error(502, f"the prefill node's answer is not a JSON object: {e.message}")
    second = dict(body, kv_transfer_params=params)
    req = client.build_request("POST", f"{decode}{path}", content=await _encode(second, large),
                               headers={**headers(request), "content-type": "application/json"})
    try:
      resp = await client.send(req, stream=True)
    except httpx.HTTPError as e:
      return error(502, f"the decode node did not answer: {e}")

    kind = resp.headers.get("content-type") or ""

    async def passthrough():
      chunks = (relay_events(resp, functools.partial(_broke, decode))
                if "text/event-stream" in kind else resp.aiter_raw())
      try:
        async for chunk in chunks:
          yield chunk
      finally:
        await resp.aclose()

    return StreamingResponse(passthrough(), status_code=resp.status_code,
                             media_type=kind or None)

  @api.post("/v1/completions")
  async def completions(request: Request):
    return await relay(request, "/v1/completions")

  @api.post("/v1/chat/completions")
  async def chat(request: Request):
    return await relay(request, "/v1/chat/completions")

  @api.get("/v1/models")
  async def models(request: Request):
    try:
      status, content_type, raw = await _bounded_get(
          client, f"{decode}/v1/models", headers(request), MAX_PREFILL_ANSWER_BYTES)
    except (httpx.HTTPError, _TooLarge) as e:
      return error(502, f"the decode node's /v1/models did not answer in bounds: {e}")
    return Response(raw, status_code=status, media_type=content_type)

  @api.get("/health")
  async def health():
    try:
      codes = [(await client.get(f"{url}/health")).status_code for url in (prefill, decode)]
    except httpx.HTTPError as e:
      return error(503, f"a node does not answer: {e}")
    return ({"status": "ok"} if codes == [200, 200]
            else error(503, f"prefill /health {codes[0]}, decode /health {codes[1]}"))

  return api


def _broke(decode: str, why: str) -> str:
  """The error event's message for a stream the decode node broke (logged here)."""
  logging.warning("the decode node %s broke off a stream (%s)", decode, why)
  return (f"the decode node broke off this stream ({why}); the answer is incomplete: retry "
          "the request.")


class _TooLarge(Exception):
  """An upstream answer longer than the bound it is read under."""


async def _read_bounded(resp: httpx.Response, limit: int) -> bytes:
  """``resp``'s body, ``_TooLarge`` as soon as it passes ``limit`` bytes (never buffered
  beyond one chunk past it)."""
  length = resp.headers.get("content-length")
  if length is not None and length.isdigit() and int(length) > limit:
    raise _TooLarge(f"content-length {length} > {limit}")
  chunks, size = [], 0
  async for chunk in resp.aiter_bytes():
    size += len(chunk)
    if size > limit:
      raise _TooLarge(f"more than {limit} bytes")
    chunks.append(chunk)
  return b"".join(chunks)


async def _encode(body: dict, large: bool) -> bytes:
  """``body`` as JSON bytes, in a worker thread when it came in ``large``."""
  encode = functools.partial(json.dumps, separators=(",", ":"))
  text = await asyncio.to_thread(encode, body) if large else encode(body)
  return text.encode()


async def _bounded_post(client, url, content, headers, limit) -> tuple[int, str | None, bytes]:
  headers = {**headers, "content-type": "application/json"}
  async with client.stream("POST", url, content=content, headers=headers) as resp:
    return resp.status_code, resp.headers.get("content-type"), await _read_bounded(resp, limit)


async def _bounded_get(client, url, headers, limit) -> tuple[int, str | None, bytes]:
  async with client.stream("GET", url, headers=headers) as resp:
    return resp.status_code, resp.headers.get("content-type"), await _read_bounded(resp, limit)
