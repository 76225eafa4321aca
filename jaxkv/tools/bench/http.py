"""Multi-turn chats over real HTTP against any OpenAI-compatible server, and suite ``http``.

The load (``run_load``; ``launch/load.py`` is its command line). ``users`` users hold one
conversation each. Each user's first request arrives by a Poisson process of ``rate``
users per second; each later one arrives a think time (exponential, mean ``think_s``)
after its previous answer ended. A user's next prompt is its whole conversation so far
(earlier prompt, the answer, a new message), so every turn after the first shares its
prefix with the turn before: a server with a prefix cache reports those tokens as
``usage.prompt_tokens_details.cached_tokens``. A conversation speaks one of two ways:
- ``TokenChat``: token ids to ``/completions``, the prompts of a ``jaxkv.tools.workloads``
  workload; the answer's ``token_ids`` (streamed, ``return_token_ids``) join it. Needs no
  tokenizer: it drives ``launch/server.py`` on its random-weight default.
- ``TextChat``: text messages to ``/chat/completions``; the answer's text joins the
  conversation as the assistant's message.

Every answer is streamed (server-sent events) with ``stream_options.include_usage``, so
the last event carries usage. Per request, counted from its arrival (a request that
waited for the event loop or was told to retry carries that wait): TTFT to the first
event carrying a token, the gaps between events carrying tokens (inter-token latency),
and usage. A 429 is retried after its ``Retry-After``; a request's attempts together
have a deadline, ``request_timeout_s`` after its arrival. A user whose request failed
sends no more: its conversation has no answer to go on from.

Same arrivals as ``jaxkv.tools.online``: the first arrivals are the same draws from ``seed``
(``first_arrivals``), and with ``think_s=0`` each later turn arrives when the previous
answer ends, in both. With think time the law is the same but not the draws
(``jaxkv.tools.online`` draws them in finish order, this module per user and turn).

Suite ``http`` (``run``): ``launch/server.py`` on the tiny default config in a child
process (its own process group, killed on every path), against an engine built from the
same config in this process driven by ``jaxkv.tools.online.run``: the same prompts and arrival
times, interleaved (in process then HTTP, then HTTP then in process, ...: drift cancels),
medians of the repetitions after a warm-up run of each. Two load points: ``light`` (a
quarter as many users as batch rows, so no request waits for a row and few share a step:
TTFT is the request's own path, not a queue) gives ``http_ttft_overhead_ms_p50``;
``saturated`` (twice as many users as rows, all at once: the batch stays full) gives
``http_tokens_per_s_vs_in_process``. Both sides answer greedily, so their tokens must be
equal (``outputs_identical``). Server and client share this machine's cores: the HTTP
figures include the client's parsing and the server's event loop, as a deployment's
would; ``client_cpu_s`` and ``server_cpu_s`` say what each used.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import json
import os
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np

from jaxkv.errors import InputError
from jaxkv.metrics import percentile
from jaxkv.progress import Progress
from jaxkv.tools.bench.common import medians_by_key
from jaxkv.tools.env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---- the requests ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
  """Where the requests go and how they are sampled.

  ``url``: the API's base, e.g. ``http://127.0.0.1:8000/v1`` (``/completions`` and
  ``/chat/completions`` are under it). ``temperature`` 0 is greedy. ``ignore_eos``: ask
  for all ``max_tokens`` of every answer (jaxkv's and vLLM's parameter, not OpenAI's:
  leave it off for servers that refuse unknown fields).
  """

  url: str
  model: str
  api_key: str | None = None
  request_timeout_s: float = 120.0
  temperature: float = 0.0
  ignore_eos: bool = False

  def __post_init__(self):
    if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
      raise InputError(f"url={self.url!r} must start with http:// or https://; give the "
                       "API's base, e.g. http://127.0.0.1:8000/v1.")
    if not isinstance(self.model, str) or not self.model:
      raise InputError(f"model={self.model!r} must be a served model's name (GET "
                       f"{self.url.rstrip('/')}/models lists them).")
    if not self.request_timeout_s > 0:
      raise InputError(f"request_timeout_s={self.request_timeout_s!r} must be > 0 (seconds "
                       "from a request's arrival to its last event).")
    if not 0 <= self.temperature <= 2:
      raise InputError(f"temperature={self.temperature!r} must be in [0, 2] (0 = greedy).")


@dataclasses.dataclass(frozen=True)
class Result:
  """One request of a run, as its last attempt ended (times in seconds from the run's start).

  ``status``: the last attempt's HTTP status, or what ended it without one ("timeout",
  an httpx error's name). ``ok``: status 200, no error event, and ``data: [DONE]`` last."""

  user: int
  turn: int
  arrival_s: float
  status: int | str
  finish_s: float
  first_token_s: float | None = None
  gaps_s: tuple = ()  # between successive events that carried tokens
  tokens_streamed: int = 0  # token ids in the events (events with text, where none carry ids)
  token_ids: tuple = ()
  text: str = ""
  finish_reason: str | None = None
  done: bool = False  # the stream ended with data: [DONE]
  usage: dict | None = None
  rejected_429: int = 0  # attempts answered 429 (each retried while the deadline allowed)
  error: str | None = None

  @property
  def ok(self) -> bool:
    return self.status == 200 and self.done and self.error is None

  @property
  def failure(self) -> str | None:
    """What ended a failed request: its status, or for a 200 what was wrong with it."""
    if self.ok:
      return None
    if self.status != 200:
      return str(self.status)
    return "stream_error" if self.error else "incomplete_stream"

  @property
  def ttft_s(self) -> float | None:
    return None if self.first_token_s is None else self.first_token_s - self.arrival_s

  @property
  def completion_tokens(self) -> int:
    """The server's count (usage) where it gave one, else the tokens streamed."""
    return self.usage["completion_tokens"] if self.usage else self.tokens_streamed

  @property
  def cached_tokens(self) -> int:
    details = (self.usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


# ---- the conversations -------------------------------------------------------------------------
class TokenChat:
  """Token-id conversations to ``/completions``: a ``jaxkv.tools.workloads`` workload's prompts
  (``user_request``) and the answers' streamed ``token_ids`` fed back (``user_record``)."""

  path = "/completions"

  def __init__(self, workload):
    self.workload = workload
    self.users, self.turns = workload.users, workload.turns_per_user

  def body(self, user: int, turn: int) -> dict:
    prompt, sampling = self.workload.user_request(user, turn)
    return {"prompt": list(prompt), "max_tokens": sampling.max_new_tokens,
            "return_token_ids": True}

  def learn(self, user: int, turn: int, result: Result) -> None:
    if result.completion_tokens and not result.token_ids:
      raise InputError("the server streamed an answer without token_ids, so a token-id "
                       "conversation cannot go on; use text chat (launch/load.py "
                       "--mode=chat) with this server, or one that honours return_token_ids.")
    self.workload.user_record(user, turn, list(result.token_ids))


# Words for text messages: common, short, one token each in most vocabularies.
_WORDS = ("the", "cache", "keeps", "keys", "and", "values", "of", "every", "page", "a", "model",
          "reads", "them", "again", "when", "prompt", "shares", "its", "prefix", "with", "one",
          "before", "time", "first", "token", "fast", "slow", "host", "disk", "device", "block",
          "hash", "chain", "batch", "row", "step", "queue", "answer", "question", "user", "turn",
          "long", "short", "story", "about", "river", "stone", "light", "window", "morning",
          "night", "city", "road", "tree", "small", "large", "old", "new", "open", "close",
          "write", "read", "move", "stay")


class TextChat:
  """Text conversations to ``/chat/completions``: a shared system prompt of
  ``system_words`` words, then per turn a user message of ``message_words = (low, high)``
  words (inclusive) drawn from ``seed``; the answer's text joins as the assistant's."""

  path = "/chat/completions"

  def __init__(self, *, users: int, turns: int, system_words: int = 64,
               message_words: tuple[int, int] = (16, 48), max_tokens: int = 16, seed: int = 0):
    for name, v in (("users", users), ("turns", turns), ("max_tokens", max_tokens)):
      if not isinstance(v, int) or v <= 0:
        raise InputError(f"TextChat {name}={v!r} must be a positive integer.")
    lo, hi = message_words
    if not 1 <= lo <= hi or system_words < 0:
      raise InputError(f"TextChat message_words={message_words} must satisfy 1 <= low <= high "
                       f"and system_words={system_words} must be >= 0.")
    self.users, self.turns, self.max_tokens = users, turns, max_tokens
    self.message_words, self.seed = (lo, hi), seed
    system = self._words(np.random.default_rng([seed, 0]), system_words)
    self.history = [[{"role": "system", "content": system}] if system_words else []
                    for _ in range(users)]

  @staticmethod
  def _words(rng, n: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), n))

  def _message(self, user: int, turn: int) -> dict:
    rng = np.random.default_rng([self.seed, user + 1, turn + 1])
    n = int(rng.integers(self.message_words[0], self.message_words[1] + 1))
    return {"role": "user", "content": self._words(rng, n)}

  def body(self, user: int, turn: int) -> dict:
    return {"messages": self.history[user] + [self._message(user, turn)],
            "max_completion_tokens": self.max_tokens}

  def learn(self, user: int, turn: int, result: Result) -> None:
    self.history[user] = self.body(user, turn)["messages"] + [
        {"role": "assistant", "content": result.text}]


# ---- a run -------------------------------------------------------------------------------------
def first_arrivals(users: int, rate: float, seed: int) -> list[float]:
  """Seconds from the start at which each user's first request arrives: a Poisson process
  of ``rate`` users per second, the same draws ``jaxkv.tools.online.run`` makes from ``seed``."""
  rng = np.random.default_rng(seed)
  return np.cumsum(rng.exponential(1.0 / rate, users)).tolist()


def run_load(target: Target, conversations, *, rate: float, think_s: float = 0.0,
             seed: int = 0, transport: httpx.AsyncBaseTransport | None = None
             ) -> tuple[list[Result], float]:
  """Runs every user's conversation against ``target`` as its turns arrive.

  ``conversations``: a ``TokenChat`` or ``TextChat``. Returns the results (ordered by
  turn, then user, as ``jaxkv.tools.online.run`` orders its records; a user that stopped after
  a failure has fewer) and the makespan in seconds. ``transport``: an httpx transport in
  place of the network (tests). Every wait ends by a deadline: a request's attempts by
  ``request_timeout_s`` from its arrival, so a run takes at most about
  ``turns * (request_timeout_s + think time)`` after the last user arrives."""
  if not rate > 0:
    raise InputError(f"rate={rate!r} must be a positive number of users per second.")
  if not think_s >= 0:
    raise InputError(f"think_s={think_s!r} must be a number of seconds >= 0.")
  first = first_arrivals(conversations.users, rate, seed)
  results, makespan = asyncio.run(_run(target, conversations, first, think_s, seed, transport))
  return [results[u, t] for t, u in sorted((t, u) for u, t in results)], makespan


async def _run(target, conversations, first, think_s, seed, transport):
  headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
  limits = httpx.Limits(max_connections=conversations.users,
                        max_keepalive_connections=conversations.users)
  url = target.url.rstrip("/") + conversations.path
  results: dict = {}
  progress = Progress("http requests finished", conversations.users * conversations.turns)
  t0 = time.perf_counter()
  clock = lambda: time.perf_counter() - t0

  async def user(u: int, client: httpx.AsyncClient) -> None:
    at = first[u]
    for turn in range(conversations.turns):
      await asyncio.sleep(max(0.0, at - clock()))
      body = {"model": target.model, **conversations.body(u, turn), "stream": True,
              "stream_options": {"include_usage": True}, "temperature": target.temperature}
      if target.ignore_eos:
        body["ignore_eos"] = True
      if target.temperature > 0:  # reproducible sampling where the server takes a seed
        body["seed"] = int(np.random.default_rng([seed, 1, u, turn]).integers(2**31))
      result = await _request(client, url, body, (u, turn, at), target.request_timeout_s, clock)
      results[u, turn] = result
      progress.advance(detail=result.failure or "ok")
      if not result.ok:
        return
      conversations.learn(u, turn, result)
      think = np.random.default_rng([seed, 2, u, turn]).exponential(think_s) if think_s else 0.0
      at = result.finish_s + float(think)

  async with httpx.AsyncClient(headers=headers, limits=limits, transport=transport,
                               timeout=target.request_timeout_s) as client:
    await asyncio.gather(*(user(u, client) for u in range(conversations.users)))
    makespan = clock()
  return results, makespan


async def _request(client, url: str, body: dict, who: tuple, timeout_s: float,
                   clock) -> Result:
  """One request, retried after each 429 until ``timeout_s`` after its arrival."""
  user, turn, arrival_s = who
  deadline = arrival_s + timeout_s
  rejected = 0
  while True:
    left = deadline - clock()
    which = dict(user=user, turn=turn, arrival_s=arrival_s, rejected_429=rejected)
    if left <= 0:
      return Result(**which, status=429 if rejected else "timeout", finish_s=clock(),
                    error=f"no answer within request_timeout_s={timeout_s} of its arrival")
    try:
      status, retry_after_s, got = await asyncio.wait_for(_attempt(client, url, body, clock),
                                                          left)
    except asyncio.TimeoutError:
      return Result(**which, status="timeout", finish_s=clock(),
                    error=f"no complete answer within request_timeout_s={timeout_s} of its "
                    "arrival")
    except httpx.HTTPError as e:
      return Result(**which, status=type(e).__name__, finish_s=clock(), error=str(e))
    if status == 429:
      rejected += 1
      await asyncio.sleep(min(max(retry_after_s, 0.05), max(0.0, deadline - clock())))
      continue
    if status != 200:
      return Result(**which, status=status, finish_s=clock(), error=got)
    return Result(**which, status=200, **got)


async def _attempt(client, url: str, body: dict, clock):
  """(status, Retry-After seconds, the stream's ``Result`` fields or the error's message)."""
  async with client.stream("POST", url, json=body) as response:
    if response.status_code != 200:
      raw = await response.aread()
      return response.status_code, _retry_after(response.headers), _error_message(raw)
    stream = _Stream(clock)
    async for line in response.aiter_lines():
      stream.feed(line)
    return 200, 0.0, stream.fields(clock())


class _Stream:
  """Reads one streamed answer's events as they arrive (``feed`` each line)."""

  def __init__(self, clock):
    self.clock = clock
    self.first = self.last = None
    self.gaps, self.ids, self.text = [], [], []
    self.count = 0  # tokens: ids in the events, or events with text where none carry ids
    self.finish_reason = self.usage = self.error = None
    self.done = False

  def feed(self, line: str) -> None:
    if not line.startswith("data:"):
      return  # blank separators, comments (":"), event names
    payload = line[5:].strip()
    if payload == "[DONE]":
      self.done = True
      return
    now = self.clock()
    try:
      event = json.loads(payload)
    except ValueError:
      self.error = f"an event is not JSON: {payload[:200]!r}"
      return
    if not isinstance(event, dict):
      self.error = f"an event is not a JSON object: {payload[:200]!r}"
      return
    error = event.get("error")
    if error:
      self.error = str(error.get("message", error) if isinstance(error, dict) else error)
    if event.get("usage"):
      self.usage = event["usage"]
    for choice in event.get("choices") or ():
      ids = choice.get("token_ids") or []
      text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
      self.finish_reason = choice.get("finish_reason") or self.finish_reason
      if not ids and not text:
        continue  # a role-only or empty event carries no token
      if self.first is None:
        self.first = now
      else:
        self.gaps.append(now - self.last)
      self.last = now
      self.ids.extend(ids)
      self.text.append(text)
      self.count += len(ids) if ids else 1

  def fields(self, now: float) -> dict:
    return dict(finish_s=now, first_token_s=self.first, gaps_s=tuple(self.gaps),
                tokens_streamed=self.count, token_ids=tuple(self.ids), text="".join(self.text),
                finish_reason=self.finish_reason, done=self.done, usage=self.usage,
                error=self.error)


def _retry_after(headers) -> float:
  try:
    return float(headers.get("retry-after", "1"))
  except ValueError:  # an HTTP date: wait a second and ask again
    return 1.0


def _error_message(raw: bytes) -> str:
  try:
    return str(json.loads(raw)["error"]["message"])
  except (ValueError, KeyError, TypeError):
    return raw.decode("utf-8", "replace")[:500]


def served_models(url: str, api_key: str | None = None, timeout_s: float = 30.0) -> list[str]:
  """The model names ``GET {url}/models`` lists."""
  headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
  try:
    r = httpx.get(url.rstrip("/") + "/models", headers=headers, timeout=timeout_s)
    r.raise_for_status()
    names = [m["id"] for m in r.json()["data"]]
  except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
    raise InputError(f"GET {url.rstrip('/')}/models did not list the models ({e}); check the "
                     "URL (the API's base, e.g. http://127.0.0.1:8000/v1) and key, or name "
                     "the model.") from None
  if not names:
    raise InputError(f"GET {url.rstrip('/')}/models lists no model; name the model to ask.")
  return names


def summary(results: list[Result], makespan_s: float, *, planned: int | None = None) -> dict:
  """A run's figures (seconds, tokens): TTFT and inter-token latency percentiles over the
  requests answered in full, throughput, prefix-cache share, and failures by kind.

  ``errors_by_status``: "429" counts every answer that said retry (retried or not); every
  other key counts failed requests by ``Result.failure``. ``planned``: the requests the
  run meant to send (users x turns), for ``requests_not_sent``."""
  ok = [r for r in results if r.ok]
  nan = float("nan")
  pct = lambda values, q: percentile(values, q) if values else nan
  ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
  gaps = [g for r in ok for g in r.gaps_s]
  with_usage = [r for r in ok if r.usage]
  prompt = sum(int(r.usage["prompt_tokens"]) for r in with_usage)
  cached = sum(r.cached_tokens for r in with_usage)
  completion = sum(r.completion_tokens for r in ok)
  errors = collections.Counter()
  examples = {}
  for r in results:
    if r.rejected_429:
      errors["429"] += r.rejected_429
    if r.failure and r.failure != "429":
      errors[r.failure] += 1
    if r.failure:
      examples.setdefault(r.failure, r.error)
  out = {
      "requests": len(results), "requests_ok": len(ok), "requests_failed": len(results) - len(ok),
      "requests_not_sent": (planned - len(results)) if planned is not None else 0,
      "errors_by_status": dict(sorted(errors.items())), "error_examples": examples,
      "makespan_s": makespan_s, "completion_tokens": completion, "prompt_tokens": prompt,
      "cached_tokens": cached, "cached_token_share": cached / prompt if prompt else nan,
      "requests_without_usage": len(ok) - len(with_usage),
      "tokens_per_s": completion / makespan_s, "requests_per_s": len(ok) / makespan_s,
      # Requests in flight on average (arrival to last event): at least the batch's rows
      # while the server is saturated.
      "mean_in_flight": sum(r.finish_s - r.arrival_s for r in ok) / makespan_s,
  }
  for q in (50, 90, 99):
    out[f"ttft_p{q}_s"] = pct(ttft, q / 100)
  for q in (50, 90):
    out[f"itl_p{q}_s"] = pct(gaps, q / 100)
  by_turn = []
  for turn in sorted({r.turn for r in results}):
    rs = [r for r in ok if r.turn == turn and r.usage]
    p = sum(int(r.usage["prompt_tokens"]) for r in rs)
    by_turn.append({"turn": turn, "requests_ok": sum(r.turn == turn for r in ok),
                    "ttft_p50_s": pct([r.ttft_s for r in ok if r.turn == turn], 0.5),
                    "cached_token_share": sum(r.cached_tokens for r in rs) / p if p else nan})
  out["by_turn"] = by_turn
  return out


# ---- launch/server.py in a child process -------------------------------------------------------
class ServerProcess:
  """``launch/server.py --port=0 --ready_file=...`` in a child process of its own process
  group (its log in a temporary file); ``with`` it, or call ``close``, on every path.

      with ServerProcess(["--config.cache.max_pages_per_seq=16"]) as server:
        ...                      # the server compiles meanwhile
        server.wait_ready(300)   # then server.url is the API's base

  The child does not inherit the virtual device count (its config sets its own); other
  ``XLA_FLAGS`` flags pass on."""

  def __init__(self, flags=(), *, script: str = os.path.join("launch", "server.py"),
               prefix=(), workdir: str | None = None):
    self._dir = tempfile.TemporaryDirectory(prefix="jaxkv-server-", dir=workdir)
    self.ready_file = os.path.join(self._dir.name, "ready.json")
    self.log_path = os.path.join(self._dir.name, "server.log")
    self.flags = list(flags)
    self.port = self.url = self.base = None
    self.core_pid = None  # the engine core's process, when it runs in its own
    env = child_env()
    command = [*prefix, script, "--port=0", f"--ready_file={self.ready_file}", *self.flags]
    if sys.platform == "linux":  # dies with this process, even one killed without cleanup
      command = ["-c", _DIE_WITH_PARENT, str(os.getpid()), *command]
    self._log = open(self.log_path, "wb")
    self.proc = subprocess.Popen([sys.executable, *command], cwd=ROOT, env=env,
                                 stdout=self._log, stderr=subprocess.STDOUT,
                                 start_new_session=True)

  def wait_ready(self, timeout_s: float) -> str:
    """Waits for the ready file and GET /health = 200; returns the API's base URL. A
    server that exits first, or is not ready by the deadline, raises with its log's tail."""
    deadline = time.monotonic() + timeout_s
    while True:
      if self.proc.poll() is not None:
        raise RuntimeError(f"launch/server.py exited with status {self.proc.returncode} "
                           f"before it was ready; its log ends:\n{self.log_tail()}")
      if time.monotonic() > deadline:
        raise TimeoutError(f"launch/server.py was not ready within {timeout_s} s; its log "
                           f"ends:\n{self.log_tail()}")
      if self.port is None:
        try:
          with open(self.ready_file) as f:
            ready = json.load(f)
          self.port, self.core_pid = int(ready["port"]), ready.get("core_pid")
        except (OSError, ValueError, KeyError, TypeError):
          pass  # not there yet, or still being written
      if self.port is not None:
        try:
          if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5.0).status_code == 200:
            self.base = f"http://127.0.0.1:{self.port}"
            self.url = self.base + "/v1"
            return self.url
        except httpx.HTTPError:
          pass
      time.sleep(0.2)

  def cpu_s(self) -> float:
    """CPU seconds the server has used: its process and its engine core's."""
    pids = [self.proc.pid] + ([self.core_pid] if self.core_pid else [])
    return sum(_process_cpu_s(p) for p in pids)

  def log_tail(self, chars: int = 4000) -> str:
    self._log.flush()
    with open(self.log_path, "rb") as f:
      return f.read().decode("utf-8", "replace")[-chars:]

  def terminate(self, timeout_s: float = 120.0) -> int:
    """SIGTERM to the server's process alone (launch/multihost.py passes it on to its
    processes); waits for it and returns its exit status. Raises if it does not exit in
    time (the group is then killed)."""
    self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self.close(0)
      raise TimeoutError(f"the server did not exit within {timeout_s} s of SIGTERM; its log "
                         f"ends:\n{self.log_tail()}") from None

  def close(self, timeout_s: float = 30.0) -> int:
    """SIGTERM to the server's group (it drains and exits), SIGKILL to whatever of the
    group is left after ``timeout_s``; returns the server's exit status (-9: killed)."""
    if self.proc.poll() is None:
      _signal_group(self.proc.pid, signal.SIGTERM)
      try:
        self.proc.wait(timeout_s)
      except subprocess.TimeoutExpired:
        pass
    _signal_group(self.proc.pid, signal.SIGKILL)  # the leader if it hung, and any child
    status = self.proc.wait(30)
    self._log.close()
    return status

  def __enter__(self) -> ServerProcess:
    return self

  def __exit__(self, *exc) -> None:
    self.close()
    self._dir.cleanup()


# Run before the server's script, in its process: SIGKILL when the parent (the process that
# started it) exits (prctl PR_SET_PDEATHSIG, kept across exec), then exec the script.
# Without it a parent killed by SIGKILL (a CI timeout) would leave the server running.
_DIE_WITH_PARENT = ("import ctypes, os, signal, sys\n"
                    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
                    "if os.getppid() != int(sys.argv[1]): sys.exit(1)  # the parent died first\n"
                    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n")


def _signal_group(pgid: int, sig: int) -> None:
  try:
    os.killpg(pgid, sig)
  except ProcessLookupError:  # the group is gone already
    pass


# ---- suite http --------------------------------------------------------------------------------
def _points(rows: int, quick: bool) -> dict:
  """The load points (think time 0): users, turns each, users arriving per second.
  ``rows``: the batch's rows (max_seqs_per_shard x data shards). ``light`` has few users, so
  requests seldom share a step and a request's TTFT is mostly its own path. A quick run
  keeps two turns at each point (a later turn reuses the conversation's cached prefix)."""
  return {"light": dict(users=max(1, rows // 4), turns=2 if quick else 8, rate=2.0),
          "saturated": dict(users=2 * rows, turns=2 if quick else 3, rate=1000.0)}


# Fewer step shapes to compile, and a long context of 512 tokens (4 x 8 pages of 16): the
# quick chat below fits in 8 pages (32 + 2 turns x (24 + 8) = 96 tokens).
_QUICK_OVERRIDES = {"cache.max_pages_per_seq": 8}


def _config(overrides: dict):
  cfg = runpy.run_path(os.path.join(ROOT, "configs", "cpu_tiny.py"))["get_config"]()
  for dotted, value in overrides.items():
    section, name = dotted.split(".")
    setattr(cfg[section], name, value)
  return cfg


# Long contexts: sequences past the device budget stream from the host tier, on both sides.
_STREAM_OVERRIDES = {"tiers.host_pages_per_shard": 320, "stream.enabled": True}


def run(*, quick: bool = False, reps: int = 5) -> dict:
  from jaxkv.tools import builder, online, workloads
  overrides = {**(_QUICK_OVERRIDES if quick else {}), **_STREAM_OVERRIDES}
  cfg = _config(overrides)
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  rows = cfg.engine.max_seqs_per_shard * cfg.mesh.data
  chat = dict(system_prompt_tokens=32 if quick else 128,
              user_tokens=(8, 24) if quick else (32, 96),
              max_new_tokens=8 if quick else 16, vocab_size=cfg.model.vocab_size)
  points = _points(rows, quick)

  def spec(point: dict, seed: int):
    return workloads.ChatSpec(users=point["users"], turns=point["turns"], seed=seed, **chat)

  # The server as it runs by default (its engine core in a process of its own) and, but
  # in a quick run, with the engine on a thread of the server's process, as before.
  with contextlib.ExitStack() as stack:  # the servers compile while this process does
    servers = {"http": stack.enter_context(ServerProcess(flags))}
    if not quick:
      servers["http_one_process"] = stack.enter_context(
          ServerProcess([*flags, "--noengine_process"]))
    server = servers["http"]
    t0 = time.perf_counter()
    engine = builder.build_engine(cfg)
    engine.warmup()
    warmup_s = time.perf_counter() - t0
    for s in servers.values():
      s.wait_ready(600.0)
    ready_s = time.perf_counter() - t0
    targets = {side: (s, Target(url=s.url, model=cfg.model.name, request_timeout_s=300.0,
                                ignore_eos=True)) for side, s in servers.items()}

    # Each side returns its figures and, per (user, turn), (arrival_s, ttft_s, tokens).
    def in_process(point, seed):
      cpu = time.process_time()
      records, makespan = online.run(engine, workloads.Chat(spec(point, seed)),
                                     rate=point["rate"], seed=seed, timeout_s=600.0)
      fig = online.summary(records, makespan)
      fig["cpu_s"] = time.process_time() - cpu
      fig["mean_in_flight"] = sum(r.finish_s - r.arrival_s for r in records) / makespan
      return fig, {(r.user, r.turn): (r.arrival_s, r.ttft_s, list(r.tokens)) for r in records}

    def over_http(point, seed, which="http"):
      server, target = targets[which]
      work = TokenChat(workloads.Chat(spec(point, seed)))
      cpu, server_cpu = time.process_time(), server.cpu_s()
      results, makespan = run_load(target, work, rate=point["rate"], seed=seed)
      fig = summary(results, makespan, planned=work.users * work.turns)
      fig["client_cpu_s"] = time.process_time() - cpu
      fig["server_cpu_s"] = server.cpu_s() - server_cpu
      if fig["requests_ok"] != work.users * work.turns:
        raise RuntimeError(f"over HTTP, {fig['requests_failed']} requests failed and "
                           f"{fig['requests_not_sent']} were not sent ({fig['error_examples']});"
                           f" the server's log ends:\n{server.log_tail()}")
      return fig, {(r.user, r.turn): (r.arrival_s, r.ttft_s, list(r.token_ids))
                   for r in results}

    # First, while both sides are fresh: on this 2-core machine the 4 x 2 mesh's
    # all-reduces of a streamed 4,096-token context stalled past XLA:CPU's 40 s rendezvous
    # timeout after the load below had run (in process and over HTTP alike).
    long_context = _long_context(engine, server, cfg, reps=1 if quick else 3)
    sides = {"in_process": in_process, "http": over_http}
    if "http_one_process" in servers:
      sides["http_one_process"] = functools.partial(over_http, which="http_one_process")
    if not quick:  # (a smoke run's figures include first use)
      for name, point in points.items():  # warm-up: connections, first-use paths, both sides
        for side in sides.values():
          side(point, 1000 + len(name))
    figures = {side: {name: [] for name in points} for side in sides}
    paired_ms = []  # light: HTTP minus in-process TTFT of the same request
    same_tokens = same_arrivals = True
    progress = Progress("http suite: in process vs over HTTP", reps * len(points))
    for rep in range(reps):
      for i, (name, point) in enumerate(points.items()):
        seed = 1 + rep + 100 * i  # new prompts every repetition, the same on both sides
        order = list(sides) if rep % 2 == 0 else list(sides)[::-1]  # A B, then B A
        out = {}
        for side in order:
          fig, out[side] = sides[side](point, seed)
          figures[side][name].append(fig)
        a, b = out["in_process"], out["http"]
        same_tokens &= all(sorted(a) == sorted(o) and all(a[k][2] == o[k][2] for k in a)
                           for side, o in out.items() if side != "in_process")
        first = first_arrivals(point["users"], point["rate"], seed)
        same_arrivals &= all(a[u, 0][0] == b[u, 0][0] == first[u]
                             for u in range(point["users"]))
        if name == "light":
          paired_ms += [1e3 * (b[k][1] - a[k][1]) for k in sorted(a)]
        progress.advance(detail=f"{name}, repetition {rep + 1}")
  # Figures per repetition (its two runs saw the same machine), then medians over them.
  overhead_ms = [1e3 * (h["ttft_p50_s"] - i["ttft_p50_s"]) for i, h in
                 zip(figures["in_process"]["light"], figures["http"]["light"])]
  tps_ratio = [h["tokens_per_s"] / i["tokens_per_s"] for i, h in
               zip(figures["in_process"]["saturated"], figures["http"]["saturated"])]
  one = figures.get("http_one_process", {"light": [], "saturated": []})
  one_overhead_ms = [1e3 * (h["ttft_p50_s"] - i["ttft_p50_s"]) for i, h in zip(
      figures["in_process"]["light"], one["light"])]
  one_tps_ratio = [h["tokens_per_s"] / i["tokens_per_s"] for i, h in zip(
      figures["in_process"]["saturated"], one["saturated"])]
  keys = {"in_process": ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tokens_per_s",
                         "requests_per_s", "makespan_s", "mean_in_flight", "cpu_s"),
          "http": ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s",
                   "tokens_per_s", "requests_per_s", "makespan_s", "mean_in_flight",
                   "cached_token_share", "client_cpu_s", "server_cpu_s")}
  keys["http_one_process"] = keys["http"]
  table = {side: {name: medians_by_key(runs, keys[side]) for name, runs in by_point.items()}
           for side, by_point in figures.items()}
  errors = collections.Counter()
  for fig in figures["http"]["light"] + figures["http"]["saturated"]:
    errors.update(fig["errors_by_status"])
  light, sat = table["http"]["light"], table["http"]["saturated"]
  return {
      "http_ttft_overhead_ms_p50": statistics.median(overhead_ms),
      "http_ttft_overhead_ms_p50_min": min(overhead_ms),
      "http_ttft_overhead_ms_p50_max": max(overhead_ms),
      # The same request's TTFT over HTTP minus in process, over every light request: the
      # prompt's own length cancels out, so this spreads less than the difference of p50s.
      "http_ttft_overhead_ms_paired": {"median": statistics.median(paired_ms),
                                       "p10": percentile(paired_ms, 0.1),
                                       "p90": percentile(paired_ms, 0.9),
                                       "requests": len(paired_ms)},
      "http_tokens_per_s_vs_in_process": statistics.median(tps_ratio),
      "http_tokens_per_s_vs_in_process_min": min(tps_ratio),
      "http_tokens_per_s_vs_in_process_max": max(tps_ratio),
      # The same, with the engine on a thread of the server's process (--noengine_process).
      "http_one_process_ttft_overhead_ms_p50": (statistics.median(one_overhead_ms)
                                                if one_overhead_ms else None),
      "http_one_process_tokens_per_s_vs_in_process": (statistics.median(one_tps_ratio)
                                                      if one_tps_ratio else None),
      **long_context,
      "cached_token_share": light["cached_token_share"]["median"],
      "in_process_ttft_p50_ms": 1e3 * table["in_process"]["light"]["ttft_p50_s"]["median"],
      "http_ttft_p50_ms": 1e3 * light["ttft_p50_s"]["median"],
      "in_process_tokens_per_s": table["in_process"]["saturated"]["tokens_per_s"]["median"],
      "http_tokens_per_s": sat["tokens_per_s"]["median"],
      "per_rep": {"http_ttft_overhead_ms_p50": overhead_ms,
                  "http_tokens_per_s_vs_in_process": tps_ratio,
                  "http_one_process_ttft_overhead_ms_p50": one_overhead_ms,
                  "http_one_process_tokens_per_s_vs_in_process": one_tps_ratio},
      "figures": table,
      "points": {name: {**p, "requests": p["users"] * p["turns"], "think_s": 0.0, **chat}
                 for name, p in points.items()},
      "batch_rows": rows, "reps": reps, "outputs_identical": same_tokens,
      "arrivals_identical": same_arrivals, "errors_by_status": dict(errors),
      "config": cfg.name, "server_flags": flags, "warmup_s": warmup_s,
      "server_ready_s": ready_s,
      "goals": {"http_ttft_overhead_ms_p50": "<= 5", "http_tokens_per_s_vs_in_process": ">= 0.9"},
      **detok_figures(reps=1 if quick else 3),
  }


def _long_context(engine, server: ServerProcess, cfg, *, reps: int) -> dict:
  """A prompt 4x a sequence's device budget (max_pages_per_seq x page_size), streamed
  from host memory: its TTFT (the answer of ``max_tokens=1``) over HTTP and in process,
  interleaved, new prompts each repetition (a streamed sequence reuses no block)."""
  c = engine.cache.config
  n = 4 * c.max_seq_len
  rng = np.random.default_rng(7)
  ttft = {"in_process": [], "http": []}
  for rep in range(reps + 1):  # the first: both sides' first use (compiles), not counted
    prompt = rng.integers(1, cfg.model.vocab_size, n).tolist()
    for side in (("in_process", "http") if rep % 2 == 0 else ("http", "in_process")):
      t0 = time.perf_counter()
      if side == "in_process":
        engine.generate([prompt], 1)
      else:
        r = httpx.post(server.url + "/completions", timeout=600.0, json={
            "model": cfg.model.name, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        if r.status_code != 200:
          raise RuntimeError(f"a {n}-token prompt over HTTP got {r.status_code}: {r.text}")
      if rep:
        ttft[side].append(time.perf_counter() - t0)
  ratios = [h / i for i, h in zip(ttft["in_process"], ttft["http"])]
  return {"long_context_ttft_vs_in_process": statistics.median(ratios),
          "long_context_prompt_tokens": n, "long_context_device_budget_tokens": c.max_seq_len,
          "long_context_ttft_s": {k: statistics.median(v) for k, v in ttft.items()}}


def detok_figures(reps: int = 3) -> dict:
  """Detokenizing a streamed answer one token per delta, microseconds per token, for a
  64- and a 4,096-token answer: what the server does per delta (``Answer.take`` and
  ``flush``: the incremental decoder, a stop string's search, the text to send;
  ``detok_us_per_token_at_64``, ``_at_4k``) and decoding the whole answer at every delta
  as the server once did (``whole_decode_us_per_token_at_*``). The tokenizer is a
  byte-level BPE of 1,000 tokens trained here on the bench's words; best of ``reps``."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from jaxkv.entrypoints.openai.protocol import Answer, Job
  from jaxkv.entrypoints.openai.tokenizer import IncrementalDecoder
  rng = np.random.default_rng(0)
  words = [" ".join(rng.choice(_WORDS, 12)) + (" café 🙂." if i % 7 == 0 else ".")
           for i in range(400)]
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(words, trainers.BpeTrainer(
      vocab_size=1000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      show_progress=False))
  ids = [t for w in words for t in tok.encode(w).ids]
  ids = (ids * (4096 // len(ids) + 1))[:4096]
  decode = lambda x: tok.decode(x, skip_special_tokens=True)

  class Shim:  # the tokenizer as an answer asks for it
    def decoder(self):
      return IncrementalDecoder(decode)

  from jaxkv.config import SamplingParams
  from jaxkv.serving.service import Delta
  job = Job(chat=False, prompt=[1], sampling=SamplingParams(), stops=["\n\n"],
            tenant="bench", stream=True, include_usage=False, return_ids=False)

  def per_token(n: int, incremental: bool) -> float:
    best = float("inf")
    for _ in range(reps):
      answer, seen = Answer(job, Shim(), "bench"), []
      t0 = time.perf_counter()
      for t in ids[:n]:
        if incremental:  # what the server does per streamed delta: decode, stops, flush
          answer.take(Delta(tokens=(t,)))
          answer.flush(False)
        else:
          seen.append(t)
          decode(seen)
      best = min(best, (time.perf_counter() - t0) / n)
    return 1e6 * best

  out = {f"{k}_at_{label}": per_token(n, k == "detok_us_per_token")
         for k in ("detok_us_per_token", "whole_decode_us_per_token")
         for label, n in (("64", 64), ("4k", 4096))}
  out["detok_4k_vs_64"] = out["detok_us_per_token_at_4k"] / out["detok_us_per_token_at_64"]
  return out


def _process_cpu_s(pid: int) -> float:
  """CPU seconds (user + system, every thread) process ``pid`` has used; NaN off Linux."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
  except (OSError, ValueError, IndexError):
    return float("nan")
