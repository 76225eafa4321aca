"""The engine as a service: its step loop on a thread of its own, requests in through a
thread-safe inbox, answers out through each request's own sink.

A server's handlers (``jaxkv.entrypoints.openai.server``) run on other threads (an asyncio event loop). They
never touch the engine: ``submit`` and ``abort`` put a command in the inbox and return at
once; the engine thread takes the inbox's commands between steps, runs the step, and hands
each request's new tokens to its ``sink`` as a ``Delta`` (a frozen value). A sink is called
on the engine thread and must not block (``loop.call_soon_threadsafe(queue.put_nowait, d)``
is the usual one): the loop never waits on the network.

Back-pressure: a request is accepted while fewer than ``rows + max_waiting`` are
outstanding (submitted, not yet finished; ``rows`` is the batch's rows over every data
shard); beyond that ``submit`` raises ``Overloaded``. After ``drain`` starts, ``submit``
raises ``Draining``.

Shares: with ``max_running_per_tenant`` (0: no limit) a tenant (``submit``'s ``quota``,
e.g. the API key's tenant whatever salt its requests carry) has at most that many
requests in the engine — running, or queued for a row — at once; its further requests wait
here, at most ``max_waiting_per_tenant`` of them (then ``Overloaded`` for that tenant
alone), and enter the engine as its earlier ones finish. So one tenant cannot hold every
row and every waiting slot while the others are served.

Failures: a request's own bad input (``InputError`` at submit) ends that request; a
callback of its own that raises ends it too (``Scheduler``). Anything else raised on the
engine thread — a step that fails (an ``InvariantError``, a device error, any bug) — is
an internal error: the loop stops, every outstanding request ends with
``finish_reason="error"``, ``failure`` says why, ``failed`` is set, and ``submit`` raises
``EngineFailed`` from then on. The server answers 503 with the reason and its launcher
exits non-zero, so a supervisor restarts it instead of it answering 503 forever.

Many processes (``jax.distributed``): process 0 takes the commands; before every step it
broadcasts them (``distributed.broadcast_bytes``), and every process applies the same
commands in the same order and runs the same step (``follow`` on the others), so request
ids, admissions and tokens agree. Only process 0's sinks see deltas.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import threading
import time
from collections.abc import Callable, Sequence

import jax
from absl import logging

from jaxkv.config import SamplingParams
from jaxkv.errors import InputError


@dataclasses.dataclass(frozen=True)
class Delta:
  """What one step gave one request: its new tokens and, on its last, why it ended.

  ``error`` is set when the request was refused before it ran (bad input: the message
  names the value and the fix); ``finish_reason`` is then ``"error"`` too."""

  tokens: tuple = ()
  finish_reason: str | None = None  # "stop", "length", "abort", "error" or None (more come)
  prompt_tokens: int = 0
  cached_tokens: int = 0  # prompt tokens reused from the cache
  error: str | None = None
  # With ``SamplingParams.logprobs``: one ``(logprob, ((id, logprob), ...))`` per token;
  # with ``prompt_logprobs``, on the delta of the first token: one per prompt token after
  # the first.
  logprobs: tuple | None = None
  prompt_logprobs: tuple | None = None


class Overloaded(Exception):
  """The service (or the tenant's share of it) holds as many requests as it takes; try
  again after ``retry_after_s``."""

  def __init__(self, message: str, retry_after_s: int = 1):
    super().__init__(f"{message}; retry after {retry_after_s} s.")
    self.retry_after_s = retry_after_s


class Draining(Exception):
  """The service is shutting down and takes no new requests."""


class EngineFailed(Exception):
  """The engine stopped on an internal error (``EngineService.failure`` says which); the
  process should be restarted."""


@dataclasses.dataclass(frozen=True)
class _Submit:
  ticket: int
  prompt: tuple
  sampling: SamplingParams
  tenant: str


@dataclasses.dataclass(frozen=True)
class _Abort:
  ticket: int


@dataclasses.dataclass(frozen=True)
class _Stop:
  pass


def _encode(commands: Sequence) -> bytes:
  out = []
  for c in commands:
    if isinstance(c, _Submit):
      out.append({"submit": c.ticket, "prompt": list(c.prompt), "tenant": c.tenant,
                  "sampling": dataclasses.asdict(c.sampling)})
    elif isinstance(c, _Abort):
      out.append({"abort": c.ticket})
    else:
      out.append({"stop": True})
  return json.dumps(out).encode()


def _decode(payload: bytes) -> list:
  commands = []
  for c in json.loads(payload.decode()) if payload else []:
    if "submit" in c:
      s = dict(c["sampling"], stop_token_ids=tuple(c["sampling"]["stop_token_ids"]))
      commands.append(_Submit(c["submit"], tuple(c["prompt"]), SamplingParams(**s), c["tenant"]))
    elif "abort" in c:
      commands.append(_Abort(c["abort"]))
    else:
      commands.append(_Stop())
  return commands


class EngineService:
  """Runs ``engine``'s step loop on a thread; ``submit``/``abort`` from any thread."""

  def __init__(self, engine, *, max_waiting: int = 64, idle_wait_s: float = 1.0,
               between_steps: Callable[[float], object] | None = None,
               max_running_per_tenant: int = 0, max_waiting_per_tenant: int | None = None,
               idle_work: Callable[[], bool] | None = None,
               default_sink: Callable[[int, Delta], None] | None = None,
               lockstep: bool | None = None):
    for name, value in (("max_waiting", max_waiting),
                        ("max_running_per_tenant", max_running_per_tenant),
                        ("max_waiting_per_tenant", max_waiting_per_tenant or 0)):
      if not isinstance(value, int) or value < 0:
        raise InputError(f"{name}={value!r} must be an integer >= 0 (max_waiting: requests "
                         "that may wait for a batch row beyond the running ones; "
                         "max_running_per_tenant: 0 for no per-tenant limit).")
    self.engine = engine
    self.rows = engine.config.max_seqs_per_shard * engine.cache.num_shards
    self.max_waiting = max_waiting
    self.max_running_per_tenant = max_running_per_tenant
    self.max_waiting_per_tenant = (max_waiting if max_waiting_per_tenant is None
                                   else max_waiting_per_tenant)
    self.idle_wait_s = idle_wait_s
    # Work that must run on the engine's thread between steps (a ``BlockServer``'s
    # ``poll``): called with how long it may wait, after every step and while idle.
    self.between_steps = between_steps
    # Work for the engine's thread while no request runs or waits, a piece per call (the
    # engine's step buckets left to compile): returns whether any is left. One process only.
    self.idle_work = idle_work
    # The sink of requests that arrive as commands (``accept``: an engine core's, sent by
    # its front), called with the ticket; None: their deltas are dropped (a follower's).
    self.default_sink = default_sink
    # Commands broadcast from process 0 (a front, which has no devices, says False).
    self.lockstep = jax.process_count() > 1 if lockstep is None else lockstep
    self._inbox: collections.deque = collections.deque()
    self._wake = threading.Condition()
    self._lock = threading.Lock()
    self._outstanding = 0
    self._accepting = True
    self._sinks: dict[int, Callable[[Delta], None] | None] = {}  # ticket -> sink (engine thread)
    self._handles: dict = {}  # ticket -> engine handle (engine thread)
    self._tickets: dict[int, int] = {}  # engine request id -> ticket (engine thread)
    # Per tenant (quota): requests outstanding, requests in the engine, and the ones
    # held back for the tenant's share (submit commands, in order).
    self._quota: dict[int, str] = {}  # ticket -> quota
    self._per_tenant: collections.Counter = collections.Counter()
    self._in_engine: collections.Counter = collections.Counter()
    self._held: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    self._entered: set[int] = set()  # tickets sent to the engine
    self._thread: threading.Thread | None = None
    self._stopped = threading.Event()
    self.failed = threading.Event()  # set when an internal error stopped the loop
    self.failure: str | None = None  # what it was, in one line
    self.counts = collections.Counter()  # requests by how they ended

  # ---- any thread -------------------------------------------------------------------------------
  @property
  def outstanding(self) -> int:
    """Requests submitted and not yet finished."""
    return self._outstanding

  def tenant_load(self) -> dict[str, tuple[int, int]]:
    """Per tenant (quota) with requests outstanding: (in the engine, held back for its
    share)."""
    with self._lock:
      return {q: (self._in_engine[q], len(self._held.get(q, ())))
              for q in sorted(self._per_tenant)}

  @property
  def accepting(self) -> bool:
    return self._accepting and not self._stopped.is_set()

  def submit(self, prompt: Sequence[int], sampling: SamplingParams, tenant: str,
             sink: Callable[[Delta], None], *, quota: str | None = None) -> int:
    """Queues a request; returns its ticket: the engine's request id (``handle.id``, the id
    every log line about it carries, and the server's response id's last part).
    ``sink(delta)`` is called on the engine
    thread for every step that gives it tokens, the last with ``finish_reason`` set.
    ``quota``: whose share it counts against (default ``tenant``). Raises ``EngineFailed``,
    ``Draining`` or ``Overloaded`` (nothing was queued)."""
    quota = tenant if quota is None else quota
    command = _Submit(-1, tuple(int(t) for t in prompt), sampling, tenant)
    with self._lock:
      if self.failed.is_set():
        raise EngineFailed(f"the engine stopped on an internal error ({self.failure}); the "
                           "server is restarting, retry on another replica or shortly.")
      if not self.accepting:
        raise Draining("the server is shutting down; send the request to another replica.")
      limit = self.rows + self.max_waiting
      if self._outstanding >= limit:
        raise Overloaded(f"the server holds {self._outstanding} requests, its limit (rows "
                         f"+ max_waiting = {limit})")
      share = self.max_running_per_tenant
      if share and self._per_tenant[quota] >= share + self.max_waiting_per_tenant:
        raise Overloaded(f"tenant {quota!r} holds {self._per_tenant[quota]} requests, its "
                         f"share (max_running_per_tenant={share} + max_waiting_per_tenant="
                         f"{self.max_waiting_per_tenant})")
      ticket = self.engine.new_request_id()  # the engine's id: one id end to end
      self._outstanding += 1
      self._sinks[ticket] = sink
      self._quota[ticket] = quota
      self._per_tenant[quota] += 1
      command = dataclasses.replace(command, ticket=ticket)
      held = share and self._in_engine[quota] >= share
      if held:
        self._held[quota].append(command)
      else:
        self._in_engine[quota] += 1
        self._entered.add(ticket)
    if not held:
      self._post(command)
    return ticket

  def abort(self, ticket: int) -> None:
    """Ends a request at the next step (its caller went away); its last delta says
    ``finish_reason="abort"`` unless it finished first."""
    self._post(_Abort(ticket))

  def accept(self, commands: Sequence) -> None:
    """Queues commands made elsewhere (an engine core's front made them with its own
    ``submit``/``abort``/``close``): applied between steps like this service's own."""
    with self._wake:
      self._inbox.extend(commands)
      self._wake.notify()

  def _held_back(self, ticket: int) -> bool:
    """Whether a request is still held back for its tenant's share (not in the engine)."""
    with self._lock:
      return ticket in self._sinks and ticket not in self._entered

  def _post(self, command) -> None:
    with self._wake:
      self._inbox.append(command)
      self._wake.notify()

  def start(self) -> EngineService:
    """Starts the engine thread (process 0 of a job; the others run ``follow``)."""
    if jax.process_index() != 0:
      raise RuntimeError("EngineService.start runs on process 0; the others call follow().")
    self._thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)
    self._thread.start()
    return self

  def drain(self, timeout_s: float) -> int:
    """Stops taking requests, waits up to ``timeout_s`` for the outstanding ones to finish,
    aborts the rest and waits for them to end. Returns how many were aborted."""
    with self._lock:
      self._accepting = False
    self._settle(timeout_s)
    with self._lock:
      left = list(self._sinks)
    for ticket in left:
      self.abort(ticket)
    self._settle(30.0)  # aborts end at the next step
    return len(left)

  def _settle(self, timeout_s: float) -> None:
    """Waits up to ``timeout_s`` until no request is outstanding (or the loop stopped)."""
    deadline = time.monotonic() + max(0.0, timeout_s)
    while self._outstanding and time.monotonic() < deadline and not self._stopped.is_set():
      time.sleep(0.01)

  def wait_stopped(self, timeout_s: float | None = None) -> bool:
    """Whether the loop has ended (a stop command, or an internal error) within
    ``timeout_s``."""
    return self._stopped.wait(timeout_s)

  def wait_failed(self, timeout_s: float) -> bool:
    """Whether an internal error stopped the loop within ``timeout_s``."""
    return self.failed.wait(timeout_s)

  def close(self, timeout_s: float = 60.0) -> None:
    """Ends the engine thread (and the followers' loops) after the inbox's commands."""
    with self._lock:
      self._accepting = False
    self._post(_Stop())
    if self._thread is not None:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        raise TimeoutError(f"the engine thread did not stop within {timeout_s} s.")

  # ---- the engine thread ------------------------------------------------------------------------
  def _take(self) -> list:
    """The inbox's commands; waits for one while the engine has nothing to run, at most
    ``idle_wait_s`` (with many processes an idle loop still broadcasts that often, so the
    others' wait in the broadcast is bounded too)."""
    if self.idle_work is not None and not self._inbox and not self.engine.has_unfinished():
      if not self.idle_work():
        self.idle_work = None
      with self._wake:  # no wait: what arrived meanwhile, or on to the next piece
        commands = list(self._inbox)
        self._inbox.clear()
      return commands
    deadline = time.monotonic() + self.idle_wait_s
    while self.between_steps is not None and not self._inbox and not (
        self.engine.has_unfinished()) and time.monotonic() < deadline:
      self.between_steps(0.01)
    with self._wake:
      if not self._inbox and not self.engine.has_unfinished():
        self._wake.wait(max(0.0, deadline - time.monotonic()))
      commands = list(self._inbox)
      self._inbox.clear()
    return commands

  def _run(self) -> None:
    try:
      while True:
        commands = self._take()
        if self.lockstep:
          from jaxkv import distributed
          commands = _decode(distributed.broadcast_bytes(_encode(commands)))
        if not self._apply(commands):
          return
        self._step()
        if self.between_steps is not None:
          self.between_steps(0.0)
    except Exception as e:  # an internal error: the loop stops and says why
      self._fail(e)
    finally:
      self._stopped.set()
      with self._lock:
        left = list(self._sinks)
      why = "error" if self.failed.is_set() else "abort"
      for ticket in left:  # a stopped loop answers every request left
        self._finish(ticket, Delta(finish_reason=why))

  def _fail(self, error: BaseException) -> None:
    logging.exception("the engine stopped on an internal error; every outstanding request "
                      "ends with finish_reason='error'")
    with self._lock:
      self.failure = f"{type(error).__name__}: {error}".splitlines()[0][:300]
      self._accepting = False
    self.failed.set()

  def follow(self) -> None:
    """The loop of a process other than 0: the commands process 0 broadcasts, the same
    steps, until process 0 closes its service."""
    from jaxkv import distributed
    try:
      while True:
        commands = _decode(distributed.broadcast_bytes(b""))
        if not self._apply(commands):
          return
        self._step()
    except Exception as e:
      self._fail(e)
      raise

  def _apply(self, commands) -> bool:
    for c in commands:
      if isinstance(c, _Stop):
        return False
      if isinstance(c, _Abort):
        handle = self._handles.get(c.ticket)
        if handle is not None:
          self.engine.abort(handle)
        elif self._held_back(c.ticket):  # never reached the engine
          self._finish(c.ticket, Delta(finish_reason="abort"))
        continue
      with self._lock:
        if c.ticket not in self._sinks:  # a follower's or a front's requests: counted
          self._sinks[c.ticket] = (None if self.default_sink is None
                                   else functools.partial(self.default_sink, c.ticket))
          self._outstanding += 1
      try:
        handle = self.engine.submit(list(c.prompt), c.sampling, c.tenant,
                                    request_id=c.ticket)
      except InputError as e:  # the request's own bad input: it alone is refused
        self._finish(c.ticket, Delta(finish_reason="error", prompt_tokens=len(c.prompt),
                                     error=str(e)))
        continue
      except Exception:  # a bug in checking it (nothing was queued): it alone fails
        logging.exception("submitting request %d failed", c.ticket)
        self._finish(c.ticket, Delta(finish_reason="error", prompt_tokens=len(c.prompt)))
        continue
      self._handles[c.ticket] = handle
      self._tickets[handle.id] = c.ticket
    return True

  def _step(self) -> None:
    if not self.engine.has_unfinished():
      return
    # A step that raises is an internal error (a request's own failures end that request
    # inside the step): it propagates and stops the loop (``_run``).
    outputs = self.engine.step()
    for out in outputs:
      ticket = self._tickets.get(out.handle.id)
      if ticket is None:
        continue  # a request of the engine's own (not this service's)
      delta = self._delta(out.handle, out.new_tokens)
      if out.finished:
        self._finish(ticket, delta)
      else:
        self._send(ticket, delta)

  @staticmethod
  def _delta(handle, tokens) -> Delta:
    n = len(tokens)
    first = n and len(handle.tokens) == n
    return Delta(tokens=tuple(tokens), finish_reason=handle.finish_reason,
                 prompt_tokens=len(handle.request.tokens), cached_tokens=handle.cached_tokens,
                 logprobs=(tuple(handle.logprobs[len(handle.logprobs) - n:])
                           if handle.logprobs is not None and n else None),
                 prompt_logprobs=(tuple(handle.prompt_logprobs)
                                  if handle.prompt_logprobs is not None and first else None))

  def _send(self, ticket: int, delta: Delta) -> None:
    sink = self._sinks.get(ticket)
    if sink is None:
      return
    try:
      sink(delta)
    except Exception:  # a sink that fails loses its own request, nothing else
      logging.exception("the sink of request %d failed; the request is aborted", ticket)
      with self._lock:
        if ticket in self._sinks:
          self._sinks[ticket] = None
      handle = self._handles.get(ticket)
      if handle is not None and not handle.finished:
        self.engine.abort(handle)

  def _finish(self, ticket: int, delta: Delta) -> None:
    self._send(ticket, delta)
    handle = self._handles.pop(ticket, None)
    if handle is not None:
      self._tickets.pop(handle.id, None)
    released = None
    with self._lock:
      if self._sinks.pop(ticket, "gone") != "gone":
        self.counts[delta.finish_reason] += 1
        self._outstanding -= 1
        quota = self._quota.pop(ticket, None)
        if quota is not None:
          released = self._release_share(ticket, quota)
    if released is not None:
      self._post(released)

  def _release_share(self, ticket: int, quota: str) -> _Submit | None:
    """A request of ``quota`` ended (under the lock): the tenant's counts go down, and the
    next request held back for its share, if any, is returned to enter the engine."""
    self._per_tenant[quota] -= 1
    if not self._per_tenant[quota]:
      del self._per_tenant[quota]
    held = self._held.get(quota, collections.deque())
    if ticket in self._entered:
      self._entered.discard(ticket)
      self._in_engine[quota] -= 1
    else:  # ended while held back (the loop stopped)
      for c in held:
        if c.ticket == ticket:
          held.remove(c)
          break
    released = None
    if held and self._in_engine[quota] < self.max_running_per_tenant:
      released = held.popleft()
      self._entered.add(released.ticket)
      self._in_engine[quota] += 1
    if not held:
      self._held.pop(quota, None)
    if not self._in_engine[quota]:
      del self._in_engine[quota]
    return released
