"""An OpenAI-compatible HTTP API over an ``EngineClient`` (FastAPI; run it with uvicorn).

  POST /v1/completions        prompt as text (with a tokenizer) or token ids
  POST /v1/chat/completions   messages through the checkpoint's chat template
  GET  /v1/models             the one model served
  GET  /health                200 once the engine takes requests, else 503; "warm": every
                              step bucket compiled (launch/server.py --warmup); "requests":
                              the requests this server holds for its engine
  GET  /metrics               jaxkv's Prometheus families + HTTP requests by route and status
                              + the requests held (jaxkv_server_requests)
  POST /tokenize, /detokenize, GET /tokenizer_info   the tokenizer, as vLLM names them

Handlers only parse, validate and wait: a request is validated here, its fields by
``protocol`` (every refusal is a 4xx with OpenAI's error JSON naming the field, the value
and the fix), submitted to the engine's client (``jaxkv.serving.EngineClient``: the engine
on a thread here or in a process of its own; the server cannot tell), and its answer read
from its own asyncio queue, fed by the client's delivering thread.
Parameters: ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``,
``top_k``, ``seed``, ``stop`` (strings, matched on the detokenized text; the answer ends
before the match), ``stop_token_ids``, ``ignore_eos``, ``n`` (each sample its own request,
seeded ``seed + j``; a completions ``prompt`` may also be a list of prompts),
``logprobs`` (completions: 0..20, with ``echo`` the prompt's too; chat: ``logprobs`` and
``top_logprobs``), ``stream`` (server-sent events) with ``stream_options.include_usage``, ``cache_salt`` (sharing only with requests
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
import json
import threading
import time
import uuid
from collections.abc import Mapping

from absl import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxkv.entrypoints.openai import auth, disagg
from jaxkv.entrypoints.openai.protocol import (
    MAX_BODY_BYTES, MAX_CHOICES, PARSE_ON_LOOP_BYTES, Answer, ApiError, Job, answer_body,
    bad_request, bool_field, chat_messages, check_answer_size, check_supported, clip_text,
    error_event, int_field, logprobs_fields, make_job, max_tokens_field, parse_body, read_body,
    read_json, sse_event, stop_strings_field, stop_token_ids_field, token_ids_field)
from jaxkv.errors import InputError
from jaxkv.serving.client import Delta, Draining, EngineClient, EngineFailed, Overloaded


class OpenAIServer:
  """The routes' logic over one engine client, ``service`` (the FastAPI app is ``app``)."""

  def __init__(self, service: EngineClient, *, model_name: str, tokenizer=None,
               api_keys: Mapping[str, str] | None = None, registry: CollectorRegistry
               | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               request_timeout_s: float = 600.0, metrics_tenants=(), role: str = "both",
               core_metrics=None, hand_off_address: tuple[str, int] | None = None):
    """``core_metrics``: () -> bytes, the engine's Prometheus text when the engine runs in
    a process of its own (``jaxkv.serving.core``): /metrics serves it before this
    process's HTTP families."""
    self.service, self.model_name, self.tokenizer = service, model_name, tokenizer
    self.core_metrics = core_metrics
    if role not in disagg.ROLES:
      raise InputError(f"role={role!r} must be one of {disagg.ROLES}.")
    if role != "both" and not service.info.has_pool:
      raise InputError(f"--role={role} hands KV over through the pool: give --pool=HOST:PORT "
                       "(a Mooncake master) too.")
    self.role = role
    # (host, port) a prefill's kv_transfer_params name: this server's own address (a launcher
    # that binds port 0 sets it once the port is known), never a client's Host header.
    self.hand_off_address = hand_off_address
    self.keys = auth.ApiKeys(api_keys)  # kept by digest (``auth``)
    self.api_keys = self.keys.digests
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
    info = service.info
    self.vocab_size = info.vocab_size
    self.max_seq_len = info.cache_config.max_seq_len
    # The longest sequence (prompt + max_tokens - 1) served: a device pool's, or with a
    # StreamConfig what the host tier can hold beside the pages kept on device. Longer
    # ones are refused here, before a stream starts, naming the limit.
    stream = info.stream
    self.max_context = self.max_seq_len
    if stream is not None:
      cold = min(stream.max_cold_pages, info.tiers.host_pages_per_shard)
      self.max_context = (stream.sink_pages + stream.window_pages + cold) * (
          info.cache_config.page_size)
    self.reader = _Reader(model_name=model_name, tokenizer=tokenizer,
                          vocab_size=self.vocab_size, max_context=self.max_context,
                          max_seq_len=self.max_seq_len, cache_config=info.cache_config,
                          stream=stream, tiers=info.tiers)
    self.registry = registry or CollectorRegistry(auto_describe=True)
    self.http_requests = Counter("jaxkv_http_requests", "HTTP requests by route and status.",
                                 ["route", "status"], registry=self.registry)
    # Counted by this process, not the engine's: it answers while the engine core is busy
    # compiling, or stuck (the core's gauges then time out).
    Gauge("jaxkv_server_requests", "Requests this server holds for its engine: admitted "
          "and not yet finished (running or waiting in it).",
          registry=self.registry).set_function(lambda: self.service.outstanding)
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
      # Step buckets compiled (the rest compile while the engine is idle).
      done, total = self.service.warm_progress()
      return {"status": "ok", "warm": done == total, "compiled_buckets": done,
              "buckets": total, "requests": self.service.outstanding}

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
      text = generate_latest(self.registry)
      if self.core_metrics is not None:
        text = await asyncio.to_thread(self.core_metrics) + text
      return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(request: Request):
      return await self._serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
      return await self._serve(request, chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request):
      return await self._tokens(request, self.reader.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
      return await self._tokens(request, self.reader.detokenize)

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
      return await self._tokens(request, None)

    return app

  # ---- the tokenizer's routes (vLLM's names: what lm-eval's remote tokenizer asks) ------------
  async def _tokens(self, request: Request, handler):
    try:
      self._tenant(request)
      tok = self.tokenizer
      if tok is None:
        raise bad_request("this server has no tokenizer (started without --model_dir); send and "
                          "read token ids.")
      if handler is None:
        return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
                "eos_token": tok.eos_token, "pad_token": None,
                "chat_template": tok.chat_template, "model_max_length": self.max_context,
                "vocab_size": tok.vocab_size, "eos_token_ids": list(tok.eos_token_ids)}
      body = await read_json(request, self.max_body_bytes)
      model = body.get("model")
      if model is not None and model != self.model_name:
        raise ApiError(404, f"model {model!r} is not served here; this server serves "
                       f"{self.model_name!r}.", "not_found_error", code="model_not_found",
                       param="model")
      return await asyncio.to_thread(handler, tok, body)
    except ApiError as e:
      return e.response()

  def _tenant(self, request: Request) -> str:
    return self.keys.tenant(request.headers.get("authorization"))

  # ---- a generation request ---------------------------------------------------------------------
  async def _serve(self, request: Request, *, chat: bool):
    try:
      tenant = self._tenant(request)
      if not self.ready:
        raise ApiError(503, "the engine is warming up; retry when /health says ok.",
                       "service_unavailable", headers={"Retry-After": "5"})
      raw = await read_body(request, self.max_body_bytes)
      body = await parse_body(raw)
      try:
        hand_off, transfer = disagg.read_params(body, self.role)
      except disagg.Refused as e:
        raise bad_request(str(e), e.param) from None
      if hand_off and not self.service.info.has_pool:
        raise bad_request("kv_transfer_params.do_remote_decode: this server has no pool to "
                          "hand the prompt's KV over (start it with --pool=HOST:PORT).",
                          "kv_transfer_params")
      # A template or tokenizer runs, or a large body's token ids are checked one by one:
      # not on the event loop, which every other client's request waits for.
      if chat or _has_text(body.get("prompt")) or len(raw) > PARSE_ON_LOOP_BYTES:
        jobs = await asyncio.to_thread(self.reader.parse, body, chat, tenant)
      else:
        jobs = self.reader.parse(body, chat, tenant)
      choices = [(job, j) for job in jobs for j in range(job.n)]
      # A hand-off is of one prompt computed once; a decode node's n choices of it share
      # the blocks it brings.
      if hand_off and len(choices) > 1:
        raise bad_request(f"kv_transfer_params.do_remote_decode goes with one prompt and n=1 "
                          f"(this request has {len(choices)} choices): the prefill node "
                          "computes the prompt once; send n to the decode node.",
                          "kv_transfer_params")
      if transfer is not None and len(jobs) > 1:
        raise bad_request(f"kv_transfer_params go with one prompt (this request has "
                          f"{len(jobs)}); send its prompts as separate requests.",
                          "kv_transfer_params")
      queue: asyncio.Queue = asyncio.Queue()
      box, request_ids = self._mailbox(), []
      try:
        for i, (job, j) in enumerate(choices):
          request_ids.append(self.service.submit(job.prompt, job.sample(j), job.tenant,
                                             functools.partial(box.post, queue, i),
                                             quota=tenant))
      except Overloaded as e:
        raise ApiError(429, str(e), "rate_limit_error", code="rate_limit_exceeded",
                       headers={"Retry-After": str(e.retry_after_s)}) from None
      except (Draining, EngineFailed) as e:
        raise ApiError(503, str(e), "service_unavailable") from None
      finally:
        if len(request_ids) < len(choices):  # refused part-way: the others end too
          for request_id in request_ids:
            self.service.abort(request_id)
    except ApiError as e:
      return e.response()
    job = jobs[0]
    rid = f"{self.run_id}-{request_ids[0]}"
    answers = [Answer(job, self.tokenizer, rid, index=i, sample=j)
               for i, (job, j) in enumerate(choices)]
    if transfer is not None and self.service.info.has_pool:  # counted by the engine
      self.service.call(disagg.Received(len(transfer.get("remote_block_ids", []))))
    waiter = _Waiter(queue, request, self.request_timeout_s,
                     functools.partial(self._abort_all, request_ids))
    if job.stream:  # the headers go at once; what the engine says comes as events
      return StreamingResponse(self._events(job, answers, request_ids, waiter),
                               media_type="text/event-stream",
                               headers={"Cache-Control": "no-cache"})
    try:
      left = set(range(len(answers)))
      while left:
        item = await waiter.next()
        if item is None:  # the client left
          return Response(status_code=499)
        i, delta = item
        if delta.error is not None:
          return bad_request(delta.error).response()
        if answers[i].take(delta):
          left.discard(i)
    except ApiError as e:
      return e.response()
    finally:
      waiter.close()
      self._end(request_ids, answers)
    if any(a.finish_reason == "error" for a in answers):
      return ApiError(500, "the engine failed while generating this answer (see the server "
                      "log); retry the request.", "server_error").response()
    out = (await asyncio.to_thread(answer_body, answers, self.model_name) if _large(answers)
           else answer_body(answers, self.model_name))
    if hand_off:  # the blocks placed within its own deadline are promised, no more
      try:
        out["kv_transfer_params"] = await self._hand_off(job)
      except ApiError as e:
        return e.response()
    return (JSONResponse(out) if not _large(answers) else Response(
        await asyncio.to_thread(_json_bytes, out), media_type="application/json"))

  async def _hand_off(self, job) -> dict:
    """The prefill's ``kv_transfer_params``: the engine runs the hand-off (it alone holds
    the pool), in its own process if it has one."""
    host, port = self.hand_off_address or (None, None)
    deadline_s = min(disagg.HAND_OFF_DEADLINE_S, self.request_timeout_s)
    command = disagg.HandOff(prompt=tuple(job.prompt), tenant=job.tenant,
                             engine_id=self.run_id, host=host, port=port, deadline_s=deadline_s)
    try:  # (the command keeps its own deadline; this one bounds a stuck engine)
      return await asyncio.wait_for(asyncio.wrap_future(self.service.call(command)),
                                    deadline_s + 30.0)
    except EngineFailed as e:
      raise ApiError(503, str(e), "service_unavailable") from None
    except TimeoutError:
      raise ApiError(503, "the engine did not hand the prompt's KV over within "
                     f"{deadline_s + 30.0:g} s; retry the request.",
                     "service_unavailable") from None

  def _abort_all(self, request_ids) -> None:
    for request_id in request_ids:
      self.service.abort(request_id)

  def _end(self, request_ids, answers) -> None:
    """A response is over: choices the engine did not end (a stop string, a closed
    stream, the deadline, another choice's error) are aborted; one log line each."""
    for request_id, answer in zip(request_ids, answers):
      if not answer.done_by_engine:
        self.service.abort(request_id)
      _log_end(request_id, answer)

  def _mailbox(self) -> _Mailbox:
    loop = asyncio.get_running_loop()
    if self._box is None or self._box.loop is not loop:
      self._box = _Mailbox(loop)
    return self._box

  async def _events(self, job, answers, request_ids, waiter):
    """The server-sent events of a streamed answer; a closed stream aborts the request.
    Deltas that queued up while the client read are sent as one event per choice."""
    try:
      if job.chat:
        for a in answers:
          yield sse_event(a.chunk(self.model_name, {"role": "assistant", "content": ""}, None))
      left = set(range(len(answers)))
      while left:
        try:
          item = await waiter.next()
        except ApiError as e:
          yield error_event(e.message, e.kind)
          break
        if item is None:
          return
        i, delta = item
        if delta.error is not None:  # refused by the engine (a capacity it checks)
          yield error_event(delta.error, "invalid_request_error")
          break
        touched = {i: answers[i].take(delta)}
        while (more := waiter.ready()) is not None:
          k, d = more
          touched[k] = answers[k].take(d) or touched.get(k, False)
        failed = False
        for k, done in touched.items():
          if k not in left:
            continue
          a = answers[k]
          text, ids = a.flush(done)
          if done and a.finish_reason == "error":
            failed = True
            break
          if text or ids or done:
            reason = a.finish_reason if done else None
            if a.job.echo and a.job.logprobs is not None and not a.sent_prompt:
              # The chunk leads with the whole prompt's log-probabilities: built off the loop.
              yield await asyncio.to_thread(
                  lambda: sse_event(a.chunk(self.model_name, text, ids, reason)))  # noqa: B023
            else:
              yield sse_event(a.chunk(self.model_name, text, ids, reason))
          if done:
            left.discard(k)
        if failed:
          yield error_event("the engine failed while generating this answer; retry the "
                            "request.", "server_error")
          break
        if not left and job.include_usage:
          yield sse_event(answers[0].usage_chunk(self.model_name, answers))
      yield "data: [DONE]\n\n"
    finally:
      waiter.close()
      self._end(request_ids, answers)


class _Reader:
  """Reads a request's fields into jobs, with what that needs of the server: the model's
  name, the tokenizer, the vocabulary and the longest sequence served (its numbers, for
  the refusal)."""

  def __init__(self, *, model_name: str, tokenizer, vocab_size: int, max_context: int,
               max_seq_len: int, cache_config, stream, tiers):
    self.model_name, self.tokenizer, self.vocab_size = model_name, tokenizer, vocab_size
    self.max_context, self.max_seq_len = max_context, max_seq_len
    self.cache_config, self.stream, self.tiers = cache_config, stream, tiers

  def parse(self, body: dict, chat: bool, tenant: str) -> list[Job]:
    """The request's fields in the order they are checked (what needs no server state is
    read by ``protocol``): one job per prompt (completions may send a list of them)."""
    model = body.get("model")
    if not isinstance(model, str):
      raise bad_request(f"model={model!r}: give the model's name, {self.model_name!r} "
                        "(GET /v1/models).", "model")
    if model != self.model_name:
      raise ApiError(404, f"model {model!r} is not served here; this server serves "
                     f"{self.model_name!r}.", "not_found_error", code="model_not_found",
                     param="model")
    check_supported(body)
    if chat and body.get("echo") not in (None, False):
      raise bad_request("echo is a field of /v1/completions; leave it out of chat requests.",
                        "echo")
    tok = self.tokenizer
    if chat:
      prompts = [(self._chat_prompt(body.get("messages")), None)]
    else:
      prompts = self._text_prompts(body.get("prompt"))
    n = int_field(body, "n", default=1, low=1, high=MAX_CHOICES)
    if n * len(prompts) > MAX_CHOICES:
      raise bad_request(f"{len(prompts)} prompts x n={n} make {n * len(prompts)} choices; this "
                        f"server answers at most {MAX_CHOICES} per request: send fewer, or several "
                        "requests.", "n")
    logprobs, echo = logprobs_fields(body, chat)
    max_tokens = max_tokens_field(body)
    stops = stop_strings_field(body)
    if stops and tok is None:
      raise bad_request("stop strings need a tokenizer (start the server with --model_dir); send "
                        "stop_token_ids instead.", "stop")
    stop_ids = stop_token_ids_field(body, self.vocab_size)
    if tok is not None and not bool_field(body, "ignore_eos"):
      stop_ids = stop_ids + [t for t in tok.eos_token_ids if t not in stop_ids]
    if max_tokens is None:  # chat (one prompt): up to the context; completions: OpenAI's 16
      max_tokens = max(1, self.max_context - len(prompts[0][0])) if chat else 16
    for index, (prompt, _) in enumerate(prompts):
      self.check_length(prompt, max_tokens, index if len(prompts) > 1 else None)
    check_answer_size([len(p) for p, _ in prompts], max_tokens=max_tokens, n=n,
                      logprobs=logprobs, echo=echo)
    # One job read from the body (one sampling, one seed), one per prompt from it.
    job = make_job(body, chat=chat, prompt=prompts[0][0], max_tokens=max_tokens, stops=stops,
                   stop_ids=stop_ids, tenant=tenant, vocab_size=self.vocab_size,
                   ids_only=tok is None, n=n, logprobs=logprobs, echo=echo)
    return [dataclasses.replace(job, prompt=prompt, prompt_text=text, index=index)
            for index, (prompt, text) in enumerate(prompts)]

  def check_length(self, prompt: list[int], max_tokens: int, index: int | None) -> None:
    total = len(prompt) + max_tokens - 1
    if total <= self.max_context:
      return
    c, stream = self.cache_config, self.stream
    which = "prompt's" if index is None else f"prompt[{index}]'s"
    if stream is None:
      limit = (f"more than a sequence holds here (max_pages_per_seq={c.max_pages_per_seq} x "
               f"page_size={c.page_size} = {self.max_seq_len}); shorten the prompt or lower "
               "max_tokens (or start the server with --stream_long_contexts and "
               "--host_pages to stream longer ones from host memory)")
    else:
      tiers = self.tiers
      limit = (f"more than this server streams ({self.max_context} tokens: sink_pages="
               f"{stream.sink_pages} + window_pages={stream.window_pages} on device + "
               f"min(max_cold_pages={stream.max_cold_pages}, host_pages_per_shard="
               f"{tiers.host_pages_per_shard}) in host memory, x page_size={c.page_size}); "
               "shorten the prompt or lower max_tokens")
    raise bad_request(f"the {which} {len(prompt)} tokens + max_tokens={max_tokens} need KV for "
                      f"{total} tokens, {limit}.", "max_tokens")

  def _text_prompts(self, prompt) -> list[tuple[list[int], str | None]]:
    """Completions' ``prompt``: text, token ids, or a list of either (a batch of prompts,
    each its own choices). Returns ``(token ids, the text as sent or None)`` per prompt."""
    batch = (isinstance(prompt, list) and prompt
             and all(isinstance(p, (str, list)) for p in prompt))
    prompts = prompt if batch else [prompt]
    if len(prompts) > MAX_CHOICES:
      raise bad_request(f"prompt is a batch of {len(prompts)} prompts; this server answers at "
                        f"most {MAX_CHOICES} per request.", "prompt")
    return [self._text_prompt(p, f"prompt[{i}]" if batch and len(prompts) > 1 else "prompt")
            for i, p in enumerate(prompts)]

  def _text_prompt(self, prompt, name: str = "prompt") -> tuple[list[int], str | None]:
    if isinstance(prompt, str):
      if self.tokenizer is None:
        raise bad_request("this server has no tokenizer (started without --model_dir): send the "
                          "prompt as a list of token ids.", "prompt")
      ids, text = self.tokenizer.encode(prompt), prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
      ids, text = token_ids_field(prompt, "prompt", self.vocab_size), None
    else:
      raise bad_request(f"{name} must be a string or a non-empty list of token ids (or a list of "
                        "those: a batch of prompts).", "prompt")
    if not ids:
      raise bad_request(f"{name} is empty; send at least one token.", "prompt")
    return ids, text

  def _chat_prompt(self, messages) -> list[int]:
    if self.tokenizer is None:
      raise bad_request("chat needs a tokenizer and chat template: start the server with "
                        "--model_dir, or use /v1/completions with token ids.", "messages")
    plain = chat_messages(messages)
    try:
      return self.tokenizer.encode_chat(plain)
    except InputError as e:
      raise bad_request(str(e), "messages") from None


  def tokenize(self, tok, body: dict) -> dict:
    """``{"prompt": text}`` or ``{"messages": [...]}`` -> the token ids the completions and
    chat routes would run."""
    if body.get("messages") is not None:
      add = body.get("add_generation_prompt", True)
      if not isinstance(add, bool):
        raise bad_request(f"add_generation_prompt={add!r} must be true or false.",
                          "add_generation_prompt")
      try:
        ids = tok.encode_chat(chat_messages(body["messages"]), add_generation_prompt=add)
      except InputError as e:
        raise bad_request(str(e), "messages") from None
    else:
      prompt = body.get("prompt")
      if not isinstance(prompt, str):
        raise bad_request(f"prompt={clip_text(repr(prompt))} must be a string (or send messages).",
                          "prompt")
      special = body.get("add_special_tokens", True)
      if not isinstance(special, bool):
        raise bad_request(f"add_special_tokens={special!r} must be true or false.",
                          "add_special_tokens")
      ids = tok.encode(prompt, add_special_tokens=special)
    return {"count": len(ids), "max_model_len": self.max_context, "tokens": ids,
            "token_strs": ([tok.token_text(i) for i in ids]
                           if bool_field(body, "return_token_strs") else None)}

  def detokenize(self, tok, body: dict) -> dict:
    ids = token_ids_field(body.get("tokens"), "tokens", self.vocab_size)
    return {"prompt": tok.decode(ids)}


_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
           "/tokenize", "/detokenize", "/tokenizer_info")


class _Mailbox:
  """Hands deltas from the engine thread to the event loop: one wake-up of the loop per
  batch of deltas (a step's), not one per token of every request."""

  def __init__(self, loop: asyncio.AbstractEventLoop):
    self.loop = loop
    self._items: list = []
    self._lock = threading.Lock()

  def post(self, queue: asyncio.Queue, index: int, delta: Delta) -> None:
    """Puts ``(index, delta)`` in ``queue``: the delta of a response's choice ``index``."""
    with self._lock:
      self._items.append((queue, (index, delta)))
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

  async def next(self) -> tuple[int, Delta] | None:
    item = self.queue.get_nowait() if not self.queue.empty() else await self.queue.get()
    if item is _GONE:
      return None
    if item is _LATE:
      raise ApiError(504, f"no answer within the server's request timeout "
                     f"({self.timeout_s:g} s); send a shorter request or retry.",
                     "timeout_error", code="request_timeout")
    return item

  def ready(self) -> tuple[int, Delta] | None:
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


# An answer with more positions than this (with log-probabilities: entries) across its
# choices is built and encoded in a worker thread: a few milliseconds on the loop at most.
_BUILD_ON_LOOP_POSITIONS = 4096


def _large(answers) -> bool:
  """Whether building ``answers``' JSON is worth a worker thread (see above)."""
  positions = 0
  for a in answers:
    n = len(a.tokens) + (a.prompt_tokens if a.job.echo else 0)
    positions += n * (a.job.logprobs + 2 if a.job.logprobs is not None else 1)
  return positions > _BUILD_ON_LOOP_POSITIONS


def _json_bytes(obj: dict) -> bytes:
  """``obj`` encoded as ``JSONResponse`` encodes it."""
  return json.dumps(obj, ensure_ascii=False, allow_nan=False, indent=None,
                    separators=(",", ":")).encode("utf-8")


def _has_text(prompt) -> bool:
  """Whether a completions prompt holds text (tokenized off the event loop)."""
  return isinstance(prompt, str) or (isinstance(prompt, list)
                                     and any(isinstance(p, str) for p in prompt))


def _log_end(request_id: int, answer: Answer) -> None:
  """One line per request (``--verbosity=1``), with the engine's request id: the id of the
  engine's own lines about it (``request N``) and the response's ``id``."""
  logging.debug("request %d (%s): %s, %d prompt tokens (%d cached), %d generated", request_id,
                answer.id, answer.finish_reason or "abort", answer.prompt_tokens,
                answer.cached_tokens, len(answer.tokens))

