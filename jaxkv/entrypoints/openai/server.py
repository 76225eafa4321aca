"""An OpenAI-compatible HTTP API over an ``EngineService`` (FastAPI; run it with uvicorn).

  POST /v1/completions        prompt as text (with a tokenizer) or token ids
  POST /v1/chat/completions   messages through the checkpoint's chat template
  GET  /v1/models             the one model served
  GET  /health                200 once the engine is warm and taking requests, else 503
  GET  /metrics               jaxkv's Prometheus families + HTTP requests by route and status

Handlers only parse, validate and wait: a request is validated here (every refusal is a
4xx with OpenAI's error JSON naming the field, the value and the fix), submitted to the
service, and its answer read from its own asyncio queue, fed by the engine thread.
Parameters: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop`` (strings, matched on the detokenized text; the answer ends
before the match), ``stop_token_ids``, ``ignore_eos``, ``n=1``, ``stream`` (server-sent
events) with ``stream_options.include_usage``, ``cache_salt`` (sharing only with requests
that give the same salt), ``return_token_ids`` (each choice carries ``token_ids``; always
on without a tokenizer, where ``text`` is empty). ``usage.prompt_tokens_details
.cached_tokens`` is the prompt's prefix-cache hit.

Tenants: with ``api_keys`` (``{key: tenant}``) every request needs ``Authorization: Bearer
<key>`` and runs as its tenant, whose blocks are keyed with its own salt: tenants never hit
each other's prefixes. A client that disconnects aborts its request at the next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import Mapping

from absl import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jaxkv.config import SamplingParams
from jaxkv.errors import InputError, check_text
from jaxkv.serving.service import Delta, Draining, EngineFailed, EngineService, Overloaded

MAX_BODY_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 32  # a request's JSON nests a few levels; deeper is refused before use
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
TENANT_SEPARATOR = "\x1f"  # tenant names may not hold it: (tenant, salt) pairs stay distinct


class ApiError(Exception):
  """A refusal: HTTP status, OpenAI error type, a message naming the value and the fix."""

  def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
               code: str | None = None, param: str | None = None, headers=None):
    super().__init__(message)
    self.status, self.message, self.kind, self.code, self.param = (
        status, message, kind, code, param)
    self.headers = headers

  def response(self) -> JSONResponse:
    return JSONResponse(status_code=self.status, headers=self.headers, content={
        "error": {"message": self.message, "type": self.kind, "code": self.code,
                  "param": self.param}})


def _bad(message: str, param: str | None = None) -> ApiError:
  return ApiError(400, message, param=param)


# ---- reading a request -------------------------------------------------------------------------
async def _read_json(request: Request, limit: int) -> dict:
  length = request.headers.get("content-length")
  if length is not None and length.isdigit() and int(length) > limit:
    raise ApiError(413, f"the body is {int(length)} bytes, more than this server takes "
                   f"({limit}); send a shorter prompt.", code="request_too_large")
  chunks, size = [], 0
  try:
    async for chunk in request.stream():
      size += len(chunk)
      if size > limit:
        raise ApiError(413, f"the body is more than {limit} bytes, the most this server "
                       "takes; send a shorter prompt.", code="request_too_large")
      chunks.append(chunk)
  except ClientDisconnect:  # gone (or too slow: the connection's body deadline)
    raise ApiError(400, "the client left before its request's body arrived.") from None
  try:
    body = json.loads(b"".join(chunks))
  except RecursionError:
    raise _bad(f"the body nests deeper than this server parses; send at most "
               f"{MAX_JSON_DEPTH} levels.") from None
  except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
    raise _bad(f"the body is not valid JSON ({_clip(str(e))}); send a JSON object.") from None
  if not isinstance(body, dict):
    raise _bad(f"the body is a JSON {type(body).__name__}; send a JSON object.")
  _check_json(body)
  return body


def _clip(text: str, n: int = 200) -> str:
  return text if len(text) <= n else text[:n] + "..."


def _check_json(body: dict) -> None:
  """Refuses a body nested deeper than ``MAX_JSON_DEPTH`` or holding a string that is not
  Unicode text (a lone surrogate such as ``"\ud800"`` is valid JSON, but no encoder takes
  it): every string of a request is text by the time a handler reads it. (Iterative: a
  deep body costs no recursion.)"""
  stack = [(body, "body", None, 1)]  # (value, its path, the top-level field, depth)
  while stack:
    value, path, field, depth = stack.pop()
    if depth > MAX_JSON_DEPTH:
      raise _bad(f"{_clip(path.encode('utf-8', 'backslashreplace').decode(), 80)} nests deeper than {MAX_JSON_DEPTH} levels; send a "
                 "flatter body.", field)
    pairs = value.items() if isinstance(value, dict) else enumerate(value)
    for key, item in pairs:
      where = f"{path}.{key}" if isinstance(value, dict) else f"{path}[{key}]"
      top = field if field is not None else str(key)
      for text in (key, item):
        if isinstance(text, str):
          try:
            text.encode("utf-8")
          except UnicodeEncodeError as e:
            shown = where.encode("utf-8", "backslashreplace").decode()
            raise _bad(f"{_clip(shown, 80)} holds {text[e.start]!r} at character {e.start}, "
                       "a lone surrogate (not a Unicode character); send valid UTF-8 text.",
                       top) from None
      if isinstance(item, (dict, list)):
        stack.append((item, where, top, depth + 1))


def _int(body, name, *, default=None, low=None, high=None):
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, int) or isinstance(value, bool):
    raise _bad(f"{name}={_clip(repr(value))} must be an integer.", name)
  if (low is not None and value < low) or (high is not None and value > high):
    rule = (f">= {low}" if high is None else f"<= {high}" if low is None
            else f"in [{low}, {high}]")
    raise _bad(f"{name}={_clip(str(value))} must be {rule}.", name)
  return value


def _number(body, name, *, default, low, high, low_open=False):
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise _bad(f"{name}={_clip(repr(value))} must be a number.", name)
  try:
    finite = math.isfinite(value)
  except OverflowError:  # an integer beyond any float
    finite = False
  if not finite:
    raise _bad(f"{name}={_clip(repr(value))} must be a finite number.", name)
  if value > high or value < low or (low_open and value == low):
    raise _bad(f"{name}={value} must be in {'(' if low_open else '['}{low}, {high}].", name)
  return float(value)


def _bool(body, name) -> bool:
  value = body.get(name, False)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise _bad(f"{name}={value!r} must be true or false.", name)
  return value


def _token_ids(value, name: str, vocab_size: int) -> list[int]:
  if not isinstance(value, list) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in value):
    raise _bad(f"{name} must be a list of integer token ids.", name)
  bad = [t for t in value if not 0 <= t < vocab_size]
  if bad:
    raise _bad(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size}).",
               name)
  return value


def _key_digest(key: str) -> bytes:
  return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class OpenAIServer:
  """The routes' logic over one service (the FastAPI app is ``app``)."""

  def __init__(self, service: EngineService, *, model_name: str, tokenizer=None,
               api_keys: Mapping[str, str] | None = None, registry: CollectorRegistry
               | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               request_timeout_s: float = 600.0, metrics_tenants=()):
    self.service, self.model_name, self.tokenizer = service, model_name, tokenizer
    # Kept by digest: a lookup then takes no time that depends on how much of a guessed
    # key matches a real one, and the keys themselves are not kept in memory.
    self.api_keys = {_key_digest(k): t for k, t in api_keys.items()} if api_keys else None
    for tenant in (self.api_keys or {}).values():
      if not isinstance(tenant, str) or not tenant or TENANT_SEPARATOR in tenant:
        raise InputError(f"tenant {tenant!r} in the API keys must be a non-empty string "
                         "without control characters.")
    # With API keys, /metrics answers only these tenants' keys: its counters are the whole
    # server's, every tenant's hits among them.
    self.metrics_tenants = frozenset(metrics_tenants)
    unknown = self.metrics_tenants - set((self.api_keys or {}).values())
    if unknown:
      raise InputError(f"metrics tenants {sorted(unknown)} have no API key; name tenants of "
                       "the API keys file.")
    self.max_body_bytes = max_body_bytes
    self.request_timeout_s = request_timeout_s
    self._box: _Mailbox | None = None
    self.ready = False  # set once the engine is warm and its thread runs
    self.created = int(time.time())
    self.run_id = uuid.uuid4().hex[:12]  # this server's run: the first part of response ids
    cache = service.engine.cache
    self.vocab_size = service.engine.vocab_size
    self.max_seq_len = cache.config.max_seq_len
    # Longer sequences are refused here, before a stream starts (the engine streams them
    # from lower tiers only with a StreamConfig).
    self.context_check = service.engine.stream is None
    self.registry = registry or CollectorRegistry(auto_describe=True)
    self.http_requests = Counter("jaxkv_http_requests", "HTTP requests by route and status.",
                                 ["route", "status"], registry=self.registry)
    self.app = self._routes()

  # ---- the app --------------------------------------------------------------------------------
  def _routes(self) -> FastAPI:
    app = FastAPI(title="jaxkv", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc):  # unknown routes, wrong methods
      kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
      return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      kind).response()

    @app.exception_handler(Exception)
    async def bug(request, exc):  # logged with its traceback by the server; never sent
      return ApiError(500, "the server failed on this request (see its log); retry it.",
                      "server_error").response()

    app.add_middleware(_CountRequests, counter=self.http_requests)

    @app.get("/health")
    async def health():
      if self.service.failed.is_set():
        return ApiError(503, f"the engine stopped on an internal error ({self.service.failure}"
                        "); this server is exiting.", "service_unavailable").response()
      if not self.ready:
        return ApiError(503, "the engine is warming up.", "service_unavailable").response()
      if not self.service.accepting:
        return ApiError(503, "the server is shutting down.", "service_unavailable").response()
      return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
      try:
        self._tenant(request)
      except ApiError as e:
        return e.response()
      return {"object": "list", "data": [{"id": self.model_name, "object": "model",
                                          "created": self.created, "owned_by": "jaxkv"}]}

    @app.get("/metrics")
    async def metrics(request: Request):
      if self.api_keys is not None:
        try:
          tenant = self._tenant(request)
        except ApiError as e:
          return e.response()
        if tenant not in self.metrics_tenants:
          return ApiError(403, f"tenant {tenant!r} may not read /metrics (it counts every "
                          "tenant's requests); use a key of a metrics tenant "
                          "(--metrics_tenants) or the loopback --metrics_port.",
                          "permission_error").response()
      return Response(generate_latest(self.registry),
                      media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
      return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
      return await self._serve(request, chat=True)

    return app

  def _tenant(self, request: Request) -> str:
    if self.api_keys is None:
      return "default"
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    tenant = self.api_keys.get(_key_digest(key)) if key else None
    if tenant is None:
      raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'.",
                     "authentication_error", code="invalid_api_key")
    return tenant

  # ---- a generation request ---------------------------------------------------------------------
  async def _serve(self, request: Request, *, chat: bool):
    try:
      tenant = self._tenant(request)
      if not self.ready:
        raise ApiError(503, "the engine is warming up; retry when /health says ok.",
                       "service_unavailable", headers={"Retry-After": "5"})
      body = await _read_json(request, self.max_body_bytes)
      if chat or isinstance(body.get("prompt"), str):  # a template or tokenizer runs: not
        job = await asyncio.to_thread(self._parse, body, chat, tenant)  # on the event loop
      else:
        job = self._parse(body, chat, tenant)
      queue: asyncio.Queue = asyncio.Queue()
      try:
        ticket = self.service.submit(job.prompt, job.sampling, job.tenant,
                                     functools.partial(self._mailbox().post, queue),
                                     quota=tenant)
      except Overloaded as e:
        raise ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
      except (Draining, EngineFailed) as e:
        raise ApiError(503, str(e), "service_unavailable") from None
    except ApiError as e:
      return e.response()
    answer = _Answer(job, self.tokenizer, f"{self.run_id}-{ticket}")
    waiter = _Waiter(queue, request, self.request_timeout_s,
                     functools.partial(self.service.abort, ticket))
    if job.stream:  # the headers go at once; what the engine says comes as events
      return StreamingResponse(self._events(job, answer, ticket, waiter),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    try:
      while True:
        delta = await waiter.next()
        if delta is None:  # the client left
          return Response(status_code=499)
        if delta.error is not None:
          return _bad(delta.error).response()
        if answer.take(delta):
          break
    except ApiError as e:
      return e.response()
    finally:
      waiter.close()
      if not answer.done_by_engine:
        self.service.abort(ticket)
      _log_end(ticket, answer)
    if answer.finish_reason == "error":
      return ApiError(500, "the engine failed while generating this answer (see the server "
                      "log); retry the request.", "server_error").response()
    return JSONResponse(answer.body(self.model_name, chat))

  def _mailbox(self) -> _Mailbox:
    loop = asyncio.get_running_loop()
    if self._box is None or self._box.loop is not loop:
      self._box = _Mailbox(loop)
    return self._box

  async def _events(self, job, answer, ticket, waiter):
    """The server-sent events of a streamed answer; a closed stream aborts the request.
    Deltas that queued up while the client read are sent as one event."""
    try:
      if job.chat:
        yield _sse(answer.chunk(self.model_name, {"role": "assistant", "content": ""}, None))
      while True:
        try:
          delta = await waiter.next()
        except ApiError as e:
          yield _error_event(e.message, e.kind)
          break
        if delta is None:
          return
        if delta.error is not None:  # refused by the engine (a capacity it checks)
          yield _error_event(delta.error, "invalid_request_error")
          break
        done = answer.take(delta)
        while not done and (more := waiter.ready()) is not None:
          done = answer.take(more)
        text, ids = answer.flush(done)
        if done and answer.finish_reason == "error":
          yield _error_event("the engine failed while generating this answer; retry the "
                             "request.", "server_error")
          break
        if text or ids or done:
          yield _sse(answer.chunk(self.model_name, text, ids,
                                  answer.finish_reason if done else None))
        if done:
          if job.include_usage:
            yield _sse(answer.usage_chunk(self.model_name))
          break
      yield "data: [DONE]\n\n"
    finally:
      waiter.close()
      if not answer.done_by_engine:  # a closed stream, a stop string or the deadline
        self.service.abort(ticket)
      _log_end(ticket, answer)

  def _parse(self, body: dict, chat: bool, tenant: str) -> _Job:
    model = body.get("model")
    if not isinstance(model, str):
      raise _bad(f"model={model!r}: give the model's name, {self.model_name!r} (GET /v1/models).",
                 "model")
    if model != self.model_name:
      raise ApiError(404, f"model {model!r} is not served here; this server serves "
                     f"{self.model_name!r}.", "not_found_error", code="model_not_found",
                     param="model")
    n = _int(body, "n", default=1)
    if n != 1:
      raise _bad(f"n={_clip(str(n))}: this server returns one choice per request; send n=1 (or several "
                 "requests).", "n")
    for name, default in _UNSUPPORTED.items():
      if body.get(name) not in (None, default, []):
        raise _bad(f"{name}={body[name]!r} is not supported by this server; leave it out.", name)
    tok = self.tokenizer
    if chat:
      prompt = self._chat_prompt(body.get("messages"))
    else:
      prompt = self._text_prompt(body.get("prompt"))
    max_tokens = _int(body, "max_completion_tokens", low=1, high=2**31 - 1)
    if max_tokens is None:
      max_tokens = _int(body, "max_tokens", low=1, high=2**31 - 1)
    if max_tokens is None:  # chat: up to the context; completions: OpenAI's 16
      max_tokens = max(1, self.max_seq_len - len(prompt)) if chat else 16
    total = len(prompt) + max_tokens - 1
    if self.context_check and total > self.max_seq_len:
      c = self.service.engine.cache.config
      raise _bad(f"the prompt's {len(prompt)} tokens + max_tokens={max_tokens} need KV for "
                 f"{total} tokens, more than a sequence holds here (max_pages_per_seq="
                 f"{c.max_pages_per_seq} x page_size={c.page_size} = {self.max_seq_len}); "
                 "shorten the prompt or lower max_tokens.", "max_tokens")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
      raise _bad(f"stop={stop!r} must be a non-empty string or a list of them.", "stop")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
      raise _bad(f"stop has {len(stops)} strings (longest {max(map(len, stops))} characters); "
                 f"this server takes at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} "
                 "characters.", "stop")
    if stops and tok is None:
      raise _bad("stop strings need a tokenizer (start the server with --model_dir); send "
                 "stop_token_ids instead.", "stop")
    stop_ids = _token_ids(body.get("stop_token_ids") or [], "stop_token_ids", self.vocab_size)
    if len(stop_ids) > 1024:
      raise _bad(f"stop_token_ids has {len(stop_ids)} ids; at most 1024.", "stop_token_ids")
    if tok is not None and not _bool(body, "ignore_eos"):
      stop_ids = stop_ids + [t for t in tok.eos_token_ids if t not in stop_ids]
    temperature = _number(body, "temperature", default=1.0, low=0.0, high=2.0)
    top_p = _number(body, "top_p", default=1.0, low=0.0, high=1.0, low_open=True)
    top_k = _int(body, "top_k", default=0, low=-1, high=self.vocab_size)
    seed = _int(body, "seed", low=0, high=2**32 - 1)
    if seed is None:
      seed = secrets.randbelow(2**32)
    salt = body.get("cache_salt")
    if salt is not None:
      try:
        check_text(salt, "cache_salt", max_chars=256)
      except InputError as e:
        raise _bad(str(e), "cache_salt") from None
    stream = _bool(body, "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
      raise _bad(f"stream_options={options!r} must be an object.", "stream_options")
    try:
      sampling = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                                top_k=max(top_k, 0), top_p=top_p, seed=seed,
                                stop_token_ids=tuple(stop_ids))
    except InputError as e:
      raise _bad(str(e)) from None
    return _Job(chat=chat, prompt=prompt, sampling=sampling, stops=stops,
                tenant=tenant if salt is None else f"{tenant}{TENANT_SEPARATOR}{salt}",
                stream=stream, include_usage=_bool(options, "include_usage"),
                return_ids=_bool(body, "return_token_ids") or tok is None)

  def _text_prompt(self, prompt) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
      prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise _bad("this server has no tokenizer (started without --model_dir): send the "
                   "prompt as a list of token ids.", "prompt")
      ids = self.tokenizer.encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
      ids = _token_ids(prompt, "prompt", self.vocab_size)
    else:
      raise _bad("prompt must be a string or a non-empty list of token ids (one prompt per "
                 "request).", "prompt")
    if not ids:
      raise _bad("prompt is empty; send at least one token.", "prompt")
    return ids

  def _chat_prompt(self, messages) -> list[int]:
    if self.tokenizer is None:
      raise _bad("chat needs a tokenizer and chat template: start the server with "
                 "--model_dir, or use /v1/completions with token ids.", "messages")
    if not isinstance(messages, list) or not messages:
      raise _bad("messages must be a non-empty list of {'role', 'content'} objects.",
                 "messages")
    plain = []
    for i, m in enumerate(messages):
      if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise _bad(f"messages[{i}] must be an object with a string 'role'.", "messages")
      content = m.get("content")
      if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
          raise _bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': "
                     "...}}) are supported.", "messages")
        content = "".join(p["text"] for p in content)
      if not isinstance(content, str):
        raise _bad(f"messages[{i}].content must be a string or a list of text parts.",
                   "messages")
      plain.append({"role": m["role"], "content": content})
    try:
      return self.tokenizer.encode_chat(plain)
    except InputError as e:
      raise _bad(str(e), "messages") from None


_UNSUPPORTED = {"logprobs": False, "top_logprobs": 0, "echo": False, "best_of": 1,
                "suffix": "", "tools": ()}
_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class _Mailbox:
  """Hands deltas from the engine thread to the event loop: one wake-up of the loop per
  batch of deltas (a step's), not one per token of every request."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._items: list = []
    self._lock = threading.Lock()

  def post(self, queue: asyncio.Queue, delta: Delta) -> None:
    with self._lock:
      self._items.append((queue, delta))
      if len(self._items) > 1:
        return  # a wake-up is on its way
    self.loop.call_soon_threadsafe(self._deliver)

  def _deliver(self) -> None:
    with self._lock:
      items, self._items = self._items, []
    for queue, delta in items:
      queue.put_nowait(delta)


_GONE, _LATE = object(), object()  # what a request's watch puts in its queue


class _Waiter:
  """Waits for a request's deltas while a watch (one task per request, not a timer per
  token) looks at its client every 0.1 s: ``next()`` is None once the client has
  disconnected, and raises ``ApiError`` 504 past the request's deadline. ``close()`` ends
  the watch. The watch aborts the request itself, so that a response that never started
  (its client left at once) leaves nothing running."""

  def __init__(self, queue: asyncio.Queue, request: Request, timeout_s: float, abort):
    self.queue, self.request, self.timeout_s, self.abort = queue, request, timeout_s, abort
    self.deadline = time.monotonic() + timeout_s
    self._watch = asyncio.get_running_loop().create_task(self._look())

  async def _look(self) -> None:
    while True:
      await asyncio.sleep(min(0.1, max(0.0, self.deadline - time.monotonic())))
      if time.monotonic() >= self.deadline:
        self.queue.put_nowait(_LATE)
        self.abort()
        return
      if await self.request.is_disconnected():  # (also when no one reads the queue now)
        self.queue.put_nowait(_GONE)
        self.abort()
        return

  def close(self) -> None:
    self._watch.cancel()

  async def next(self) -> Delta | None:
    item = self.queue.get_nowait() if not self.queue.empty() else await self.queue.get()
    if item is _GONE:
      return None
    if item is _LATE:
      raise ApiError(504, f"no answer within the server's request timeout "
                     f"({self.timeout_s:g} s); send a shorter request or retry.",
                     "timeout_error", code="request_timeout")
    return item

  def ready(self) -> Delta | None:
    """A delta already queued (sent along with the one just taken), else None."""
    if self.queue.empty():
      return None
    item = self.queue.get_nowait()
    if item is _GONE or item is _LATE:
      self.queue.put_nowait(item)  # seen by the next ``next``
      return None
    return item


class _CountRequests:
  """ASGI middleware counting HTTP requests by route and status ("499": the client left
  before an answer began). A plain ASGI wrapper, so handlers still see disconnects."""

  def __init__(self, app, counter):
    self.app, self.counter = app, counter

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    status = ["499"]

    async def tell(message):
      if message["type"] == "http.response.start":
        status[0] = str(message["status"])
      await send(message)

    try:
      await self.app(scope, receive, tell)
    finally:
      path = scope.get("path", "")
      self.counter.labels(path if path in _ROUTES else "other", status[0]).inc()


@dataclasses.dataclass(frozen=True)
class _Job:
  """A validated request."""

  chat: bool
  prompt: list  # token ids
  sampling: SamplingParams
  stops: list  # stop strings
  tenant: str  # the tenant, salted with the request's cache_salt
  stream: bool
  include_usage: bool
  return_ids: bool


def _log_end(ticket: int, answer: "_Answer") -> None:
  """One line per request (``--verbosity=1``), with the engine's request id: the id of the
  engine's own lines about it (``request N``) and the response's ``id``."""
  logging.debug("request %d (%s): %s, %d prompt tokens (%d cached), %d generated", ticket,
                answer.id, answer.finish_reason or "abort", answer.prompt_tokens,
                answer.cached_tokens, len(answer.tokens))


class _Answer:
  """One request's answer as it arrives: tokens, the text so far (stop strings cut it),
  what has been streamed, usage."""

  def __init__(self, job: _Job, tokenizer, request_id: str):
    self.job, self.tokenizer = job, tokenizer
    # ``<this server's run>-<the engine's request id>``: the id the engine's log lines
    # carry, unique across the server's restarts and replicas.
    self.id = ("chatcmpl-" if job.chat else "cmpl-") + request_id
    self.created = int(time.time())
    self.tokens: list[int] = []
    self.text = ""
    self.finish_reason: str | None = None
    self.done_by_engine = False  # the engine ended it (else it is aborted on the way out)
    self.prompt_tokens = len(job.prompt)
    self.cached_tokens = 0
    self.sent_chars = 0
    self.sent_tokens = 0
    self.hold = max((len(s) for s in job.stops), default=1) - 1

  def take(self, delta: Delta) -> bool:
    """Adds a delta; True when the answer is complete."""
    if self.finish_reason is not None:
      return True
    self.cached_tokens = delta.cached_tokens
    if delta.finish_reason is not None:
      self.done_by_engine = True
    self.tokens.extend(delta.tokens)
    if self.tokenizer is not None:
      self.text = self.tokenizer.decode(self.tokens)
      # A character whose bytes have not all arrived decodes as U+FFFD for now: stop
      # strings are matched only on text that is complete (all of it at the end).
      whole = self.text if delta.finish_reason is not None else self.text.rstrip("\ufffd")
      for s in self.job.stops:
        at = whole.find(s, max(0, self.sent_chars - len(s)))
        if at >= 0:
          self.text, self.finish_reason = self.text[:at], "stop"
          return True
    if delta.finish_reason is not None:
      self.finish_reason = delta.finish_reason
      return True
    return False

  def flush(self, done: bool) -> tuple[str, list]:
    """The text and token ids not yet streamed (text held back while it may still turn
    into a stop string or ends inside a character)."""
    end = len(self.text)
    if not done:
      end = max(self.sent_chars, end - self.hold)
      while end > self.sent_chars and self.text[end - 1] == "\ufffd":
        end -= 1
    text = self.text[self.sent_chars:end]
    self.sent_chars = end
    ids = self.tokens[self.sent_tokens:]
    self.sent_tokens = len(self.tokens)
    return text, ids

  def usage(self) -> dict:
    n = len(self.tokens)
    return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

  def body(self, model: str, chat: bool) -> dict:
    choice = {"index": 0, "finish_reason": self.finish_reason, "logprobs": None}
    if chat:
      choice["message"] = {"role": "assistant", "content": self.text}
      kind = "chat.completion"
    else:
      choice["text"] = self.text
      kind = "text_completion"
    if self.job.return_ids:
      choice["token_ids"] = list(self.tokens)
    return {"id": self.id, "object": kind, "created": self.created, "model": model,
            "choices": [choice], "usage": self.usage()}

  def chunk(self, model: str, content, ids, finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "finish_reason": finish_reason, "logprobs": None}
    if self.job.chat:
      choice["delta"] = content if isinstance(content, dict) else (
          {"content": content} if content or finish_reason is None else {})
      kind = "chat.completion.chunk"
    else:
      choice["text"] = content
      kind = "text_completion"
    if self.job.return_ids and ids is not None:
      choice["token_ids"] = list(ids)
    out = {"id": self.id, "object": kind, "created": self.created, "model": model,
           "choices": [choice]}
    if self.job.include_usage:
      out["usage"] = None
    return out

  def usage_chunk(self, model: str) -> dict:
    return {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else
            "text_completion", "created": self.created, "model": model, "choices": [],
            "usage": self.usage()}


def _error_event(message: str, kind: str) -> str:
  return _sse({"error": {"message": message, "type": kind, "code": None, "param": None}})


def _sse(obj: dict) -> str:
  return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
