"""The OpenAI API's wire format as this server speaks it: what a request body may hold and
how it becomes a validated ``Job``, what an answer looks like (``Answer``: the JSON body,
the streamed chunks, usage), and the errors (``ApiError``: a status and OpenAI's error JSON
naming the field, the value and the fix).

Everything here reads values and builds values: no server state, no I/O. ``server.py``
reads the body off the connection and calls these in the order a request's fields are
checked (``OpenAIServer._parse``); what needs the server (the model's name, the
tokenizer, the vocabulary and context sizes) it passes in.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import secrets
import time
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from jaxkv.config import MAX_LOGPROB_ENTRIES, MAX_LOGPROBS, SamplingParams
from jaxkv.errors import InputError, check_text

if TYPE_CHECKING:
  from jaxkv.serving.service import Delta


MAX_BODY_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 32  # a request's JSON nests a few levels; deeper is refused before use
# A body up to this size is parsed on the event loop (a few milliseconds at most); a larger
# one in a worker thread, so that one client's 4 MiB token list stalls no other client.
PARSE_ON_LOOP_BYTES = 64 * 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
TENANT_SEPARATOR = "\x1f"  # tenant names may not hold it: (tenant, salt) pairs stay distinct


def request_tenant(tenant: str, cache_salt: str | None) -> str:
  """The tenant string a request's blocks are keyed under: its key's tenant, narrowed by its
  ``cache_salt`` (the router maps a request's token ids under the same string)."""
  return tenant if cache_salt is None else f"{tenant}{TENANT_SEPARATOR}{cache_salt}"


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


def bad_request(message: str, param: str | None = None) -> ApiError:
  return ApiError(400, message, param=param)


# ---- reading a request off the connection ----------------------------------------------------
async def read_json(request, limit: int) -> dict:
  """The request's body as a JSON object (``read_body``, then ``parse_body``).
  Every front door (the API server, the router, the P/D proxy) reads bodies with this."""
  return await parse_body(await read_body(request, limit))


async def parse_body(raw: bytes) -> dict:
  """``parse_json(raw)``, in a worker thread when ``raw`` is over ``PARSE_ON_LOOP_BYTES``
  (off the event loop: one client's big token list stalls no other client)."""
  if len(raw) > PARSE_ON_LOOP_BYTES:
    return await asyncio.to_thread(parse_json, raw)
  return parse_json(raw)


async def read_body(request, limit: int) -> bytes:
  """The request's body, refused (``ApiError`` 413) before it is read whole when its
  ``content-length`` is over ``limit`` bytes, and as soon as more than ``limit`` bytes
  arrived otherwise (a chunked body); 400 when the client left before it ended."""
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
  return b"".join(chunks)


def parse_json(raw: bytes) -> dict:
  """``raw`` as a JSON object whose strings are all text, else ``ApiError`` 400."""
  try:
    body = json.loads(raw)
  except RecursionError:
    raise bad_request(f"the body nests deeper than this server parses; send at most "
                      f"{MAX_JSON_DEPTH} levels.") from None
  except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
    raise bad_request(f"the body is not valid JSON ({clip_text(str(e))}); send a JSON "
                      "object.") from None
  if not isinstance(body, dict):
    raise bad_request(f"the body is a JSON {type(body).__name__}; send a JSON object.")
  _check_json(body)
  return body


# ---- reading a request's fields ---------------------------------------------------------------
def clip_text(text: str, n: int = 200) -> str:
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
      raise bad_request(f"{clip_text(path.encode('utf-8', 'backslashreplace').decode(), 80)} nests deeper than {MAX_JSON_DEPTH} levels; send a "
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
            raise bad_request(f"{clip_text(shown, 80)} holds {text[e.start]!r} at character "
                              f"{e.start}, a lone surrogate (not a Unicode character); send "
                              "valid UTF-8 text.",
                              top) from None
      if isinstance(item, (dict, list)):
        stack.append((item, where, top, depth + 1))


def int_field(body, name, *, default=None, low=None, high=None):
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, int) or isinstance(value, bool):
    raise bad_request(f"{name}={clip_text(repr(value))} must be an integer.", name)
  if (low is not None and value < low) or (high is not None and value > high):
    rule = (f">= {low}" if high is None else f"<= {high}" if low is None
            else f"in [{low}, {high}]")
    raise bad_request(f"{name}={clip_text(str(value))} must be {rule}.", name)
  return value


def _number(body, name, *, default, low, high, low_open=False):
  value = body.get(name, default)
  if value is None:
    return default
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise bad_request(f"{name}={clip_text(repr(value))} must be a number.", name)
  try:
    finite = math.isfinite(value)
  except OverflowError:  # an integer beyond any float
    finite = False
  if not finite:
    raise bad_request(f"{name}={clip_text(repr(value))} must be a finite number.", name)
  if value > high or value < low or (low_open and value == low):
    raise bad_request(f"{name}={value} must be in {'(' if low_open else '['}{low}, {high}].", name)
  return float(value)


def bool_field(body, name) -> bool:
  value = body.get(name, False)
  if value is None:
    return False
  if not isinstance(value, bool):
    raise bad_request(f"{name}={value!r} must be true or false.", name)
  return value


def token_ids_field(value, name: str, vocab_size: int) -> list[int]:
  if not isinstance(value, list) or not all(
      isinstance(t, int) and not isinstance(t, bool) for t in value):
    raise bad_request(f"{name} must be a list of integer token ids.", name)
  bad = [t for t in value if not 0 <= t < vocab_size]
  if bad:
    raise bad_request(f"{name} holds token id {bad[0]}, outside the vocabulary [0, {vocab_size}).",
                      name)
  return value


_UNSUPPORTED = {"best_of": 1, "suffix": "", "tools": ()}
MAX_CHOICES = 64  # prompts x n of one request: each choice is a request of the engine's


def check_supported(body: dict) -> None:
  """None of the fields this server does not implement."""
  for name, default in _UNSUPPORTED.items():
    if body.get(name) not in (None, default, []):
      raise bad_request(f"{name}={clip_text(repr(body[name]))} is not supported by this "
                        "server; leave it out.", name)


def logprobs_fields(body: dict, chat: bool) -> tuple[int | None, bool]:
  """``(top alternatives per generated token, or None for no log-probabilities, echo)``:
  completions' ``logprobs: k`` and ``echo``; chat's ``logprobs: true`` with
  ``top_logprobs: k``."""
  if chat:
    want = bool_field(body, "logprobs")
    k = int_field(body, "top_logprobs", low=0, high=MAX_LOGPROBS)
    if k and not want:
      raise bad_request(f"top_logprobs={k} needs logprobs=true.", "top_logprobs")
    return (k or 0) if want else None, False
  return int_field(body, "logprobs", low=0, high=MAX_LOGPROBS), bool_field(body, "echo")


def check_answer_size(prompt_lengths: list[int], *, max_tokens: int, n: int,
                      logprobs: int | None, echo: bool,
                      limit: int = MAX_LOGPROB_ENTRIES) -> None:
  """Refuses (400, before any work) a request whose answer would hold more than ``limit``
  log-probability entries: per prompt, its echoed tokens once (only a prompt's first
  sample carries them) and ``max_tokens`` per choice, each position ``logprobs + 1``
  entries (the token and its alternatives). Without log-probabilities an answer is its
  tokens' text, bounded by ``max_tokens`` and the choices."""
  if logprobs is None:
    return
  per = logprobs + 1
  entries = sum((length if echo else 0) + max_tokens * n for length in prompt_lengths) * per
  if entries <= limit:
    return
  what = (f"{len(prompt_lengths)} prompt(s) of {sum(prompt_lengths)} tokens (echoed) and "
          if echo else f"{len(prompt_lengths)} prompt(s) x ")
  # The largest max_tokens that fits (chat's default is the whole context: name it).
  fits = (limit // per - (sum(prompt_lengths) if echo else 0)) // (n * len(prompt_lengths))
  hint = f" (max_tokens <= {fits} fits)" if 1 <= fits < max_tokens else ""
  raise bad_request(f"logprobs={logprobs} over {what}n={n} x max_tokens={max_tokens} ask for "
                    f"{entries} log-probability entries; this server answers at most {limit} per "
                    f"request: send fewer prompts per request, or lower logprobs, n or max_tokens"
                    f"{hint}.", "logprobs")


def chat_messages(messages) -> list[dict]:
  """``messages`` as ``{"role", "content"}`` dicts of strings (text parts joined)."""
  if not isinstance(messages, list) or not messages:
    raise bad_request("messages must be a non-empty list of {'role', 'content'} objects.",
                      "messages")
  plain = []
  for i, m in enumerate(messages):
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
      raise bad_request(f"messages[{i}] must be an object with a string 'role'.", "messages")
    content = m.get("content")
    if isinstance(content, list):  # content parts: text only
      if not all(isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text"), str) for p in content):
        raise bad_request(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': "
                          "...}}) are supported.", "messages")
      content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
      raise bad_request(f"messages[{i}].content must be a string or a list of text parts.",
                        "messages")
    plain.append({"role": m["role"], "content": content})
  return plain


def max_tokens_field(body: dict) -> int | None:
  """``max_completion_tokens``, else ``max_tokens``; None when neither is given."""
  max_tokens = int_field(body, "max_completion_tokens", low=1, high=2**31 - 1)
  if max_tokens is None:
    max_tokens = int_field(body, "max_tokens", low=1, high=2**31 - 1)
  return max_tokens


def stop_strings_field(body: dict) -> list[str]:
  stop = body.get("stop")
  stops = [stop] if isinstance(stop, str) else stop if stop is not None else []
  if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
    raise bad_request(f"stop={stop!r} must be a non-empty string or a list of them.", "stop")
  if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
    raise bad_request(f"stop has {len(stops)} strings (longest {max(map(len, stops))} characters); "
                      f"this server takes at most {MAX_STOP_STRINGS} of at most {MAX_STOP_CHARS} "
                      "characters.", "stop")
  return stops


def stop_token_ids_field(body: dict, vocab_size: int) -> list[int]:
  stop_ids = token_ids_field(body.get("stop_token_ids") or [], "stop_token_ids", vocab_size)
  if len(stop_ids) > 1024:
    raise bad_request(f"stop_token_ids has {len(stop_ids)} ids; at most 1024.", "stop_token_ids")
  return stop_ids


# ---- the validated request ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Job:
  """A validated request."""

  chat: bool
  prompt: list  # token ids
  sampling: SamplingParams
  stops: list  # stop strings
  tenant: str  # the tenant, salted with the request's cache_salt
  stream: bool
  include_usage: bool
  return_ids: bool
  n: int = 1  # samples of this prompt, each its own engine request
  logprobs: int | None = None  # top alternatives per generated token (None: no logprobs)
  echo: bool = False  # the prompt leads the text (and its log-probabilities, with logprobs)
  prompt_text: str | None = None  # the prompt as the client sent it, when it was text
  index: int = 0  # the prompt's place in a batch of prompts

  def sample(self, j: int) -> SamplingParams:
    """The sampling of sample ``j``: seed + j (so each sample is reproducible alone: a
    request with that seed and n=1 gives it), the prompt's log-probabilities only once."""
    if j == 0:
      return self.sampling
    return dataclasses.replace(self.sampling, seed=(self.sampling.seed + j) % 2**32,
                               prompt_logprobs=None)


def make_job(body: dict, *, chat: bool, prompt: list[int], max_tokens: int, stops: list[str],
             stop_ids: list[int], tenant: str, vocab_size: int, ids_only: bool, n: int = 1,
             logprobs: int | None = None, echo: bool = False) -> Job:
  """The request's last fields (sampling, ``cache_salt``, streaming), read after its
  prompt, length and stops, with those: the validated job. ``ids_only``: the server has no
  tokenizer, so every choice carries its token ids."""
  temperature = _number(body, "temperature", default=1.0, low=0.0, high=2.0)
  top_p = _number(body, "top_p", default=1.0, low=0.0, high=1.0, low_open=True)
  top_k = int_field(body, "top_k", default=0, low=-1, high=vocab_size)
  seed = int_field(body, "seed", low=0, high=2**32 - 1)
  if seed is None:
    seed = secrets.randbelow(2**32)
  salt = body.get("cache_salt")
  if salt is not None:
    try:
      check_text(salt, "cache_salt", max_chars=256)
    except InputError as e:
      raise bad_request(str(e), "cache_salt") from None
  stream = bool_field(body, "stream")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict):
    raise bad_request(f"stream_options={options!r} must be an object.", "stream_options")
  try:
    sampling = SamplingParams(max_new_tokens=max_tokens, temperature=temperature,
                              top_k=max(top_k, 0), top_p=top_p, seed=seed,
                              stop_token_ids=tuple(stop_ids), logprobs=logprobs,
                              prompt_logprobs=logprobs if echo else None)
  except InputError as e:
    raise bad_request(str(e)) from None
  return Job(chat=chat, prompt=prompt, sampling=sampling, stops=stops,
             tenant=request_tenant(tenant, salt),
             stream=stream, include_usage=bool_field(options, "include_usage"),
             return_ids=bool_field(body, "return_token_ids") or ids_only, n=n,
             logprobs=logprobs, echo=echo)


# ---- the answer -------------------------------------------------------------------------------
class Answer:
  """One choice's answer as it arrives: tokens, the text so far (stop strings cut it),
  what has been streamed, log-probabilities, usage."""

  def __init__(self, job: Job, tokenizer, request_id: str, index: int = 0,
               sample: int = 0):
    """``index``: the choice's place in the response; ``sample``: which of its prompt's
    ``n`` samples it is."""
    self.job, self.tokenizer, self.index, self.sample = job, tokenizer, index, sample
    # ``<this server's run>-<the engine's request id>``: the id the engine's log lines
    # carry, unique across the server's restarts and replicas.
    self.id = ("chatcmpl-" if job.chat else "cmpl-") + request_id
    self.created = int(time.time())
    self.tokens: list[int] = []
    # The text so far: ``_parts`` (sent, and past any stop string's reach) + ``_buf``, the
    # rest from character ``_buf_at`` on. A delta touches only ``_buf``: its cost does not
    # grow with the answer.
    self._parts: list[str] = []
    self._buf, self._buf_at = "", 0
    self.finish_reason: str | None = None
    self.done_by_engine = False  # the engine ended it (else it is aborted on the way out)
    self.prompt_tokens = len(job.prompt)
    self.cached_tokens = 0
    self.sent_chars = 0
    self.sent_tokens = 0
    self.sent_prompt = False  # the echoed prompt went out (streaming)
    self.hold = max((len(s) for s in job.stops), default=1) - 1
    # The text of every token so far, each delta decoding only a window of tokens.
    self._decoder = tokenizer.decoder() if tokenizer is not None else None
    self.logprobs: list = []  # per generated token: (logprob, ((id, logprob), ...))
    self.prompt_logprobs: tuple | None = None  # per prompt token after the first
    self._starts = [0]  # each generated token's first character in the generated text
    self.prompt_text = ""
    if job.echo:
      self.prompt_text = (job.prompt_text if job.prompt_text is not None
                          else tokenizer.decode(job.prompt) if tokenizer is not None else "")

  def take(self, delta: Delta) -> bool:
    """Adds a delta; True when the answer is complete."""
    if self.finish_reason is not None:
      return True
    self.cached_tokens = delta.cached_tokens
    if delta.finish_reason is not None:
      self.done_by_engine = True
    self.tokens.extend(delta.tokens)
    if delta.logprobs is not None:
      self.logprobs.extend(delta.logprobs)
    if delta.prompt_logprobs is not None:
      self.prompt_logprobs = delta.prompt_logprobs
    if self._decoder is not None:
      at, piece = self._decoder.extend(delta.tokens)
      self._buf = self._buf[:at - self._buf_at] + piece
      # A character whose bytes have not all arrived decodes as U+FFFD for now: stop
      # strings are matched only on text that is complete (all of it at the end).
      buf = self._buf if delta.finish_reason is not None else self._buf.rstrip("\ufffd")
      for s in self.job.stops:
        found = buf.find(s, max(0, self.sent_chars - len(s) - self._buf_at))
        if found >= 0:
          self._buf, self.finish_reason = self._buf[:found], "stop"
          return True
    if delta.finish_reason is not None:
      self.finish_reason = delta.finish_reason
      return True
    return False

  def flush(self, done: bool) -> tuple[str, list]:
    """The text and token ids not yet streamed (text held back while it may still turn
    into a stop string or ends inside a character)."""
    base, buf = self._buf_at, self._buf
    end = base + len(buf)
    if not done:
      end = max(self.sent_chars, end - self.hold)
      while end > self.sent_chars and buf[end - 1 - base] == "\ufffd":
        end -= 1
    text = buf[self.sent_chars - base:end - base]
    self.sent_chars = end
    # Text a stop string can no longer reach leaves the buffer.
    keep = max((len(s) for s in self.job.stops), default=0)
    cut = max(0, self.sent_chars - keep - base)
    if cut > 256:  # (in pieces, not a character at a time)
      self._parts.append(buf[:cut])
      self._buf, self._buf_at = buf[cut:], base + cut
    ids = self.tokens[self.sent_tokens:]
    self.sent_tokens = len(self.tokens)
    return text, ids

  @property
  def text(self) -> str:
    """The answer's text so far (joined: read it once, at the end)."""
    return "".join(self._parts) + self._buf

  # ---- log-probabilities in OpenAI's layouts ---------------------------------------------------
  def _token_text(self, token: int) -> str:
    if self.tokenizer is None:
      return f"token_id:{token}"
    return self.tokenizer.token_text(token)

  def _completion_logprobs(self, start: int, stop: int, *, with_prompt: bool,
                           offset: int = 0) -> dict:
    """Completions' ``logprobs`` of generated tokens ``[start, stop)`` (led by every prompt
    token's with ``with_prompt``: the first one's ``null``): ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (the most likely tokens asked for, and the token
    itself) and ``text_offset`` (each token's start in the choice's text, from
    ``offset``)."""
    entries = []
    if with_prompt:
      prompt = self.prompt_logprobs or ()
      entries += [(self.job.prompt[0], None)] + list(zip(self.job.prompt[1:], prompt))
    entries += list(zip(self.tokens[start:stop], self.logprobs[start:stop]))
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in entries:
      text = self._token_text(token)
      out["tokens"].append(text)
      out["text_offset"].append(offset)
      offset += len(text)
      if entry is None:
        out["token_logprobs"].append(None)
        out["top_logprobs"].append(None)
        continue
      lp, top = entry
      alternatives = {}
      for i, v in top:  # highest first: a text two ids share keeps the higher
        alternatives.setdefault(self._token_text(i), v)
      alternatives.setdefault(text, lp)
      out["token_logprobs"].append(lp)
      out["top_logprobs"].append(alternatives)
    return out

  def _chat_logprobs(self, start: int, stop: int) -> dict:
    """Chat's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def item(token, lp):
      text = self._token_text(token)
      return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    content = []
    for token, (lp, top) in zip(self.tokens[start:stop], self.logprobs[start:stop]):
      content.append({**item(token, lp), "top_logprobs": [item(i, v) for i, v in top]})
    return {"content": content}

  @functools.cached_property
  def _prompt_chars(self) -> int:
    """Characters the echoed prompt's tokens take (offsets count each token's own text,
    special tokens included, as ``tokens`` lists them)."""
    if not self.job.echo:
      return 0
    return sum(len(self._token_text(t)) for t in self.job.prompt)

  def _logprobs_of(self, start: int, stop: int, *, with_prompt: bool) -> dict | None:
    if self.job.logprobs is None:
      return None
    if self.job.chat:
      return self._chat_logprobs(start, stop)
    if with_prompt:
      offset = 0
    else:  # where token ``start`` begins in the choice's text
      while len(self._starts) <= start:
        self._starts.append(self._starts[-1] + len(self._token_text(
            self.tokens[len(self._starts) - 1])))
      offset = self._prompt_chars + self._starts[start]
    return self._completion_logprobs(start, stop, with_prompt=with_prompt, offset=offset)

  # ---- the answer's JSON -----------------------------------------------------------------------
  def choice(self) -> dict:
    """This choice of a (not streamed) answer's ``choices``."""
    choice = {"index": self.index, "finish_reason": self.finish_reason,
              "logprobs": self._logprobs_of(0, len(self.tokens), with_prompt=self.job.echo)}
    if self.job.chat:
      choice["message"] = {"role": "assistant", "content": self.text}
    else:
      choice["text"] = self.prompt_text + self.text
    if self.job.return_ids:
      choice["token_ids"] = list(self.tokens)
      if self.job.echo:
        choice["prompt_token_ids"] = list(self.job.prompt)
    return choice

  def chunk(self, model: str, content, ids, finish_reason: str | None = None) -> dict:
    """A streamed chunk of this choice: ``content`` (text, or chat's opening delta dict)
    and the token ids it covers (their log-probabilities go with them; the first chunk
    of an echoed completion leads with the prompt)."""
    with_prompt = self.job.echo and not self.sent_prompt
    choice = {"index": self.index, "finish_reason": finish_reason, "logprobs": None}
    if ids is not None:
      stop = self.sent_tokens
      choice["logprobs"] = self._logprobs_of(stop - len(ids), stop, with_prompt=with_prompt)
    if self.job.chat:
      choice["delta"] = content if isinstance(content, dict) else (
          {"content": content} if content or finish_reason is None else {})
      kind = "chat.completion.chunk"
    else:
      choice["text"] = (self.prompt_text if with_prompt else "") + content
      self.sent_prompt = True
      kind = "text_completion"
    if self.job.return_ids and ids is not None:
      choice["token_ids"] = list(ids)
    out = {"id": self.id, "object": kind, "created": self.created, "model": model,
           "choices": [choice]}
    if self.job.include_usage:
      out["usage"] = None
    return out

  def usage_chunk(self, model: str, answers) -> dict:
    """The stream's last chunk: the usage of every choice (``answers``)."""
    return {"id": self.id, "object": "chat.completion.chunk" if self.job.chat else
            "text_completion", "created": self.created, "model": model, "choices": [],
            "usage": _usage(answers)}


def _usage(answers) -> dict:
  """Usage of a request's choices: each prompt counted once (its samples share it), with
  the prompt tokens its first sample reused; every choice's generated tokens."""
  firsts = [a for a in answers if a.sample == 0]
  prompt = sum(a.prompt_tokens for a in firsts)
  completion = sum(len(a.tokens) for a in answers)
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion,
          "prompt_tokens_details": {"cached_tokens": sum(a.cached_tokens for a in firsts)}}


def answer_body(answers, model: str) -> dict:
  """A whole (not streamed) answer over its choices."""
  first = answers[0]
  return {"id": first.id, "object": "chat.completion" if first.job.chat else
          "text_completion", "created": first.created, "model": model,
          "choices": [a.choice() for a in answers], "usage": _usage(answers)}


def error_event(message: str, kind: str, code: str | None = None) -> str:
  """A streamed answer's error: OpenAI's error object as one event (``[DONE]`` follows)."""
  return sse_event({"error": {"message": message, "type": kind, "code": code, "param": None}})


def sse_event(obj: dict) -> str:
  return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
