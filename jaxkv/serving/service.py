"""The engine's step loop on a thread of its own (``EngineLoop``), and the in-process
``EngineClient`` over it (``EngineService``).

A server's handlers (``jaxkv.entrypoints.openai.server``) run on other threads (an asyncio
event loop). They never touch the engine: ``submit`` and ``abort`` put a command in the
loop's inbox and return at once; the engine thread takes the inbox's commands between
steps, runs the step, and hands each request's new tokens to the client as a ``Delta`` (a
frozen value), which gives it to the request's ``sink``. A sink is called on the engine
thread and must not block (``loop.call_soon_threadsafe(queue.put_nowait, d)`` is the usual
one): the loop never waits on the network.

Back-pressure, tenants' shares, ``Draining`` and the request ids are the client's
(``jaxkv.serving.client``): the loop takes what it is sent. The same loop runs in an
engine core's process behind ZeroMQ (``jaxkv.serving.core``), where the core's wire
delivers its deltas.

Engine commands (``EngineClient.call``): a command the loop takes runs on the engine
thread between steps, or, when it may wait, on a thread beside the loop; its value goes
to the caller's future. They are this process's alone (never broadcast).

Failures: a request's own bad input (``InputError`` at submit) ends that request; a
callback of its own that raises ends it too (``Scheduler``). Anything else raised on the
engine thread — a step that fails (an ``InvariantError``, a device error, any bug) — is
an internal error: the loop stops, ``failure`` says why, ``failed`` is set; the client
then ends every outstanding request with ``finish_reason="error"`` and ``submit`` raises
``EngineFailed``. The server answers 503 with the reason and its launcher exits non-zero,
so a supervisor restarts it instead of it answering 503 forever.

Many processes (``jax.distributed``): process 0 takes the commands; before every step it
broadcasts them (``distributed.broadcast_bytes``), and every process applies the same
commands in the same order and runs the same step (``follow`` on the others), so request
ids, admissions and tokens agree. Only process 0 delivers deltas.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
from absl import logging

from jaxkv.config import SamplingParams
from jaxkv.errors import InputError
from jaxkv.serving.client import (Abort, Delta, Draining, EngineClient, EngineCommand,
                                  EngineFailed, EngineInfo, Overloaded, Submit)

__all__ = ["Delta", "Draining", "EngineFailed", "EngineLoop", "EngineService", "Overloaded",
           "Stop"]


@dataclasses.dataclass(frozen=True)
class Stop:
  """Ends the loop after the commands before it."""


@dataclasses.dataclass(frozen=True)
class Call:
  """An engine command and the future its value goes to (this process's alone)."""

  command: EngineCommand
  future: Future


def _encode(commands: Sequence) -> bytes:
  out = []
  for c in commands:
    if isinstance(c, Submit):
      out.append({"submit": c.request_id, "prompt": list(c.prompt), "tenant": c.tenant,
                  "sampling": dataclasses.asdict(c.sampling)})
    elif isinstance(c, Abort):
      out.append({"abort": c.request_id})
    else:
      out.append({"stop": True})
  return json.dumps(out).encode()


def _decode(payload: bytes) -> list:
  commands = []
  for c in json.loads(payload.decode()) if payload else []:
    if "submit" in c:
      s = dict(c["sampling"], stop_token_ids=tuple(c["sampling"]["stop_token_ids"]))
      commands.append(Submit(c["submit"], tuple(c["prompt"]), SamplingParams(**s), c["tenant"]))
    elif "abort" in c:
      commands.append(Abort(c["abort"]))
    else:
      commands.append(Stop())
  return commands


def run_command(command: EngineCommand, engine, future: Future) -> None:
  """Runs ``command`` with ``engine``; its value or exception goes to ``future``."""
  if not future.set_running_or_notify_cancel():
    return
  try:
    future.set_result(command(engine))
  except BaseException as e:  # the caller's to see, not the loop's
    future.set_exception(e)


class EngineLoop:
  """``engine``'s step loop: commands in (``post``, any thread), deltas out
  (``deliver(request_id, delta)``, on the engine thread; None: dropped, as a follower's)."""

  def __init__(self, engine, *, deliver: Callable[[int, Delta], None] | None,
               idle_wait_s: float = 1.0, between_steps: Callable[[float], object] | None = None,
               idle_work: Callable[[], bool] | None = None, lockstep: bool | None = None):
    self.engine = engine
    self.deliver = deliver
    self.idle_wait_s = idle_wait_s
    # Work that must run on the engine's thread between steps (a ``BlockServer``'s
    # ``poll``): called with how long it may wait, after every step and while idle.
    self.between_steps = between_steps
    # Work for the engine's thread while no request runs or waits, a piece per call (the
    # engine's step buckets left to compile): returns whether any is left. One process only.
    self.idle_work = idle_work
    # Commands broadcast from process 0 (an engine core, one process, says False).
    self.lockstep = jax.process_count() > 1 if lockstep is None else lockstep
    self._inbox: collections.deque = collections.deque()
    self._wake = threading.Condition()
    self._handles: dict = {}  # request id -> the engine's handle (engine thread)
    self._aside: ThreadPoolExecutor | None = None  # commands that may wait
    self._calls: list[Future] = []  # futures of commands beside the loop
    self._thread: threading.Thread | None = None
    self._stopped = threading.Event()
    self.failed = threading.Event()
    self.failure: str | None = None

  def post(self, *commands) -> None:
    """Queues commands (``Submit``, ``Abort``, ``Call``, ``Stop``) for the next step."""
    with self._wake:
      late = self._stopped.is_set()
      if not late:
        self._inbox.extend(commands)
        self._wake.notify()
    if late:  # the loop is over: nothing runs them
      self._refuse(commands)

  @property
  def stopped(self) -> bool:
    return self._stopped.is_set()

  def wait_stopped(self, timeout_s: float | None = None) -> bool:
    return self._stopped.wait(timeout_s)

  def start(self, after: Callable[[], None] | None = None) -> EngineLoop:
    """Runs the loop on a thread of its own (process 0 of a job; the others ``follow``);
    ``after()`` runs on it once the loop has ended."""
    if jax.process_index() != 0:
      raise RuntimeError("EngineLoop.start runs on process 0; the others call follow().")

    def run():
      self.run()
      if after is not None:
        after()

    self._thread = threading.Thread(target=run, name="jaxkv-engine", daemon=True)
    self._thread.start()
    return self

  def join(self, timeout_s: float) -> None:
    if self._thread is not None:
      self._thread.join(timeout_s)
      if self._thread.is_alive():
        raise TimeoutError(f"the engine thread did not stop within {timeout_s} s.")

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

  def run(self) -> None:
    """The loop on this thread, until a ``Stop`` or an internal error."""
    try:
      while True:
        commands = self._take()
        if self.lockstep:  # engine commands are this process's; the rest every process's
          from jaxkv import distributed
          calls = [c for c in commands if isinstance(c, Call)]
          shared = _decode(distributed.broadcast_bytes(_encode(
              [c for c in commands if not isinstance(c, Call)])))
          commands = calls + shared
        if not self._apply(commands):
          return
        self._step()
        if self.between_steps is not None:
          self.between_steps(0.0)
    except Exception as e:  # an internal error: the loop stops and says why
      self._fail(e)
    finally:
      self._end()

  def follow(self) -> None:
    """The loop of a process other than 0: the commands process 0 broadcasts, the same
    steps, until process 0 stops its loop."""
    from jaxkv import distributed
    try:
      while True:
        if not self._apply(_decode(distributed.broadcast_bytes(b""))):
          return
        self._step()
    except Exception as e:
      self._fail(e)
      raise
    finally:
      self._end()

  def _fail(self, error: BaseException) -> None:
    logging.exception("the engine stopped on an internal error; every outstanding request "
                      "ends with finish_reason='error'")
    self.failure = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    self.failed.set()

  def _end(self) -> None:
    """The loop is over: commands left in the inbox never run (their futures say so)."""
    with self._wake:
      self._stopped.set()
      left, self._inbox = list(self._inbox), collections.deque()
    self._refuse(left)
    if self._aside is not None:
      self._aside.shutdown(wait=False)

  def _refuse(self, commands) -> None:
    """Commands that arrived after the loop: their callers hear that it stopped."""
    why = f"the engine stopped ({self.failure or 'closed'}) before the command ran."
    for c in commands:
      if isinstance(c, Call) and c.future.set_running_or_notify_cancel():
        c.future.set_exception(EngineFailed(why))

  def _apply(self, commands) -> bool:
    for c in commands:
      if isinstance(c, Stop):
        return False
      if isinstance(c, Call):
        self._call(c)
      elif isinstance(c, Abort):
        handle = self._handles.get(c.request_id)
        if handle is not None:
          self.engine.abort(handle)
      else:
        self._submit(c)
    return True

  def _call(self, c: Call) -> None:
    if getattr(c.command, "on_engine_thread", True):
      run_command(c.command, self.engine, c.future)
      return
    if self._aside is None:
      self._aside = ThreadPoolExecutor(max_workers=4, thread_name_prefix="jaxkv-engine-aside")
    self._aside.submit(run_command, c.command, self.engine, c.future)

  def _submit(self, c: Submit) -> None:
    try:
      handle = self.engine.submit(list(c.prompt), c.sampling, c.tenant,
                                  request_id=c.request_id)
    except InputError as e:  # the request's own bad input: it alone is refused
      self._send(c.request_id, Delta(finish_reason="error", prompt_tokens=len(c.prompt),
                                     error=str(e)))
      return
    except Exception:  # a bug in checking it (nothing was queued): it alone fails
      logging.exception("submitting request %d failed", c.request_id)
      self._send(c.request_id, Delta(finish_reason="error", prompt_tokens=len(c.prompt)))
      return
    self._handles[c.request_id] = handle

  def _step(self) -> None:
    if not self.engine.has_unfinished():
      return
    # A step that raises is an internal error (a request's own failures end that request
    # inside the step): it propagates and stops the loop (``run``).
    for out in self.engine.step():
      request_id = out.handle.id
      if self._handles.get(request_id) is not out.handle:
        continue  # a request of the engine's own (not a client's)
      if out.finished:
        del self._handles[request_id]
      self._send(request_id, self._delta(out.handle, out.new_tokens))

  def _send(self, request_id: int, delta: Delta) -> None:
    if self.deliver is not None:
      self.deliver(request_id, delta)

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


class EngineService(EngineClient):
  """The in-process ``EngineClient``: ``engine``'s loop on a thread of this process;
  ``submit``/``abort``/``call`` from any thread."""

  def __init__(self, engine, *, max_waiting: int = 64, idle_wait_s: float = 1.0,
               between_steps: Callable[[float], object] | None = None,
               max_running_per_tenant: int = 0, max_waiting_per_tenant: int | None = None,
               idle_work: Callable[[], bool] | None = None, lockstep: bool | None = None):
    super().__init__(EngineInfo.of(engine), max_waiting=max_waiting,
                     max_running_per_tenant=max_running_per_tenant,
                     max_waiting_per_tenant=max_waiting_per_tenant)
    self.engine = engine
    self.loop = EngineLoop(engine, deliver=self._deliver, idle_wait_s=idle_wait_s,
                           between_steps=between_steps, idle_work=idle_work, lockstep=lockstep)

  def start(self) -> EngineService:
    """Starts the engine thread (process 0 of a job; the others run ``follow``)."""
    self.loop.start(after=self._loop_ended)
    return self

  def follow(self) -> None:
    """A process other than 0 of a job: process 0's steps, until it closes its service."""
    self.loop.follow()

  def _loop_ended(self) -> None:
    if self.loop.failed.is_set():
      self._fail(self.loop.failure)
    self._end_all()

  def _new_request_id(self) -> int:
    return self.engine.new_request_id()  # the engine's id: one id end to end

  def _send(self, command) -> None:
    self.loop.post(command)

  def call(self, command: EngineCommand) -> Future:
    future: Future = Future()
    self.loop.post(Call(command, future))
    return future

  def warm_progress(self) -> tuple[int, int]:
    return self.engine.runner.warm_progress()

  def close(self, timeout_s: float = 60.0) -> None:
    """Ends the engine thread (and the followers' loops) after the inbox's commands."""
    with self._lock:
      self._accepting = False
    self.loop.post(Stop())
    self.loop.join(timeout_s)
