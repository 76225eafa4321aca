"""One interface to an engine, whichever process runs it: ``EngineClient``.

A server (``jaxkv.entrypoints.openai.server``) talks to an engine only through an
``EngineClient``: ``submit`` a request with a sink for its answers, ``abort`` it by its
``request_id``, ``call`` an ``EngineCommand`` that the engine itself carries out, ``drain``,
``close``, and read ``info`` (the engine's sizes and configs, fixed once it is built),
``warm_progress``, ``failed``/``failure``. Two implementations:

* ``jaxkv.serving.service.EngineService``: the engine's step loop on a thread of this process.
* ``jaxkv.serving.core.CoreClient``: the loop in a process of its own, over ZeroMQ.

What is decided when a request arrives is the client's, the same in both: the request id
(the engine's id for it, end to end), ``BackPressure`` (how many requests it holds, and each
tenant's share: requests beyond a share are held back here and never reach the engine
until an earlier one of the tenant ends), ``Draining`` after ``drain``, ``EngineFailed``
after an internal error. The engine's side (``EngineLoop``) takes what it is sent.

An ``EngineCommand`` is work that needs the engine's state (its cache, its tiers): the
client never touches those; it sends the command, and the engine's process runs it (on
the engine's thread between steps, or, for one that waits, on a thread beside the loop)
and hands its value back through a ``concurrent.futures.Future``. The prefill -> decode
hand-off is one (``jaxkv.entrypoints.openai.disagg.HandOff``).
"""

from __future__ import annotations

import abc
import collections
import dataclasses
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

from absl import logging

from jaxkv.config import SamplingParams
from jaxkv.errors import InputError

__all__ = ["BackPressure", "Delta", "Draining", "EngineClient", "EngineCommand", "EngineFailed",
           "EngineInfo", "Overloaded"]


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
  """The client (or the tenant's share of it) holds as many requests as it takes; try
  again after ``retry_after_s``."""

  def __init__(self, message: str, retry_after_s: int = 1):
    super().__init__(f"{message}; retry after {retry_after_s} s.")
    self.retry_after_s = retry_after_s


class Draining(Exception):
  """The client is shutting down and takes no new requests."""


class EngineFailed(Exception):
  """The engine stopped on an internal error (``EngineClient.failure`` says which); the
  process should be restarted."""


class EngineCommand(Protocol):
  """Work the engine's process carries out with the engine, asked by ``EngineClient.call``.

  ``on_engine_thread``: True runs it between steps on the engine's thread (it must not
  wait: every request waits for it); False runs it on a thread beside the loop, in the
  engine's process, where it may wait but must use only verbs that are safe from another
  thread. A command crosses processes pickled: a frozen dataclass of a module-level class."""

  on_engine_thread: bool

  def __call__(self, engine) -> object: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineInfo:
  """What a client knows of its engine, fixed once the engine is built."""

  engine_config: object  # EngineConfig
  cache_config: object  # CacheConfig
  tiers: object  # TierConfig
  num_shards: int
  vocab_size: int
  stream: object | None  # StreamConfig or None

  @classmethod
  def of(cls, engine) -> EngineInfo:
    cache = engine.cache
    return cls(engine_config=engine.config, cache_config=cache.config, tiers=cache.tiers,
               num_shards=cache.num_shards, vocab_size=engine.vocab_size, stream=engine.stream)

  @property
  def rows(self) -> int:
    """Batch rows over every data shard."""
    return self.engine_config.max_seqs_per_shard * self.num_shards

  @property
  def has_pool(self) -> bool:
    return bool(self.tiers.pool_enabled)


class BackPressure:
  """How many requests a client holds, and each tenant's share (under the client's lock).

  A request is admitted while fewer than ``rows + max_waiting`` are outstanding. With
  ``max_running_per_tenant`` (0: no limit) a tenant (``quota``) has at most that many in
  the engine at once; its further ones are held back here, at most
  ``max_waiting_per_tenant`` (then ``Overloaded`` for that tenant alone), and enter the
  engine, in order, as its earlier ones end. Held-back items are whatever the client
  will send when they enter (its submit command)."""

  def __init__(self, rows: int, *, max_waiting: int = 64, max_running_per_tenant: int = 0,
               max_waiting_per_tenant: int | None = None):
    for name, value in (("max_waiting", max_waiting),
                        ("max_running_per_tenant", max_running_per_tenant),
                        ("max_waiting_per_tenant", max_waiting_per_tenant or 0)):
      if not isinstance(value, int) or value < 0:
        raise InputError(f"{name}={value!r} must be an integer >= 0 (max_waiting: requests "
                         "that may wait for a batch row beyond the running ones; "
                         "max_running_per_tenant: 0 for no per-tenant limit).")
    self.rows, self.max_waiting = rows, max_waiting
    self.max_running_per_tenant = max_running_per_tenant
    self.max_waiting_per_tenant = (max_waiting if max_waiting_per_tenant is None
                                   else max_waiting_per_tenant)
    self.outstanding = 0
    self._quota: dict[int, str] = {}  # request id -> quota
    self._per_tenant: collections.Counter = collections.Counter()  # outstanding
    self._in_engine: collections.Counter = collections.Counter()
    self._held: dict[str, collections.OrderedDict] = {}  # quota -> request id -> item
    self._entered: set[int] = set()

  def admit(self, request_id: int, quota: str, item) -> bool:
    """Counts a request in; returns whether it is held back (``item`` kept until it
    enters). Raises ``Overloaded`` (nothing counted)."""
    limit = self.rows + self.max_waiting
    if self.outstanding >= limit:
      raise Overloaded(f"the server holds {self.outstanding} requests, its limit (rows "
                       f"+ max_waiting = {limit})")
    share = self.max_running_per_tenant
    if share and self._per_tenant[quota] >= share + self.max_waiting_per_tenant:
      raise Overloaded(f"tenant {quota!r} holds {self._per_tenant[quota]} requests, its "
                       f"share (max_running_per_tenant={share} + max_waiting_per_tenant="
                       f"{self.max_waiting_per_tenant})")
    self.outstanding += 1
    self._quota[request_id] = quota
    self._per_tenant[quota] += 1
    if share and self._in_engine[quota] >= share:
      self._held.setdefault(quota, collections.OrderedDict())[request_id] = item
      return True
    self._in_engine[quota] += 1
    self._entered.add(request_id)
    return False

  def held_back(self, request_id: int) -> bool:
    """Whether ``request_id`` is outstanding and still held back (not in the engine)."""
    return request_id in self._quota and request_id not in self._entered

  def release(self, request_id: int):
    """``request_id`` ended: its counts go down. Returns the item of the tenant's next
    held-back request, which enters the engine now (None if none)."""
    quota = self._quota.pop(request_id, None)
    if quota is None:
      return None
    self.outstanding -= 1
    self._per_tenant[quota] -= 1
    if not self._per_tenant[quota]:
      del self._per_tenant[quota]
    held = self._held.get(quota, collections.OrderedDict())
    if request_id in self._entered:
      self._entered.discard(request_id)
      self._in_engine[quota] -= 1
    else:
      held.pop(request_id, None)
    released = None
    if held and self._in_engine[quota] < self.max_running_per_tenant:
      rid, released = held.popitem(last=False)
      self._entered.add(rid)
      self._in_engine[quota] += 1
    if not held:
      self._held.pop(quota, None)
    if not self._in_engine[quota]:
      del self._in_engine[quota]
    return released

  def tenant_load(self) -> dict[str, tuple[int, int]]:
    """Per tenant with requests outstanding: (in the engine, held back for its share)."""
    return {q: (self._in_engine[q], len(self._held.get(q, ()))) for q in sorted(self._per_tenant)}

  def outstanding_ids(self) -> list[int]:
    return list(self._quota)


@dataclasses.dataclass(frozen=True)
class Submit:
  """A request entering the engine (the command a client sends its loop)."""

  request_id: int
  prompt: tuple
  sampling: SamplingParams
  tenant: str

  @property
  def ticket(self) -> int:  # the old name
    warnings.warn("Submit.ticket is now Submit.request_id", DeprecationWarning, stacklevel=2)
    return self.request_id


@dataclasses.dataclass(frozen=True)
class Abort:
  """Ends a request at the next step."""

  request_id: int


def _request_id(request_id: int | None, ticket: int | None, where: str) -> int:
  """``request_id``, or the old keyword ``ticket`` (deprecated)."""
  if ticket is not None:
    warnings.warn(f"{where}(ticket=...) is now {where}(request_id=...)", DeprecationWarning,
                  stacklevel=3)
    if request_id is not None and request_id != ticket:
      raise InputError(f"{where}: give request_id={request_id} or ticket={ticket}, not both.")
    return ticket
  if request_id is None:
    raise InputError(f"{where} needs the request_id that submit returned.")
  return request_id


class EngineClient(abc.ABC):
  """A server's one way to an engine (the module's docstring); any thread may call it.

  Sinks: ``submit``'s ``sink(delta)`` is called for every step that gives the request
  tokens, the last with ``finish_reason`` set, on the thread that delivers answers (the
  engine's, or the client's reader of the engine's process); it must not block."""

  def __init__(self, info: EngineInfo, *, max_waiting: int = 64,
               max_running_per_tenant: int = 0, max_waiting_per_tenant: int | None = None):
    self.info = info
    self.back_pressure = BackPressure(info.rows, max_waiting=max_waiting,
                                      max_running_per_tenant=max_running_per_tenant,
                                      max_waiting_per_tenant=max_waiting_per_tenant)
    self._lock = threading.Lock()
    self._sinks: dict[int, Callable[[Delta], None] | None] = {}  # request id -> sink
    self._accepting = True
    self._stopped = threading.Event()
    self.failed = threading.Event()  # set when an internal error stopped the engine
    self.failure: str | None = None  # what it was, in one line
    self.counts = collections.Counter()  # requests by how they ended

  # ---- what each implementation provides -------------------------------------------------------
  @abc.abstractmethod
  def start(self) -> EngineClient:
    """Starts serving (the loop's thread, or nothing where the engine's process runs it)."""

  @abc.abstractmethod
  def close(self, timeout_s: float = 60.0) -> None:
    """Stops the engine after the commands sent; raises ``TimeoutError`` past the deadline."""

  @abc.abstractmethod
  def call(self, command: EngineCommand) -> Future:
    """Has the engine's process carry out ``command``; its value (or its exception, or
    ``EngineFailed`` when the engine stops first) comes in the returned future."""

  @abc.abstractmethod
  def warm_progress(self) -> tuple[int, int]:
    """``(step buckets compiled, buckets)``."""

  @abc.abstractmethod
  def _new_request_id(self) -> int:
    """A request id the engine will take (under the client's lock)."""

  @abc.abstractmethod
  def _send(self, command) -> None:
    """Hands a ``Submit`` or ``Abort`` to the engine's loop."""

  # ---- requests ---------------------------------------------------------------------------------
  @property
  def rows(self) -> int:
    """The engine's batch rows over every data shard."""
    return self.info.rows

  @property
  def max_waiting(self) -> int:
    """Requests that may wait for a row beyond the running ones (then ``Overloaded``)."""
    return self.back_pressure.max_waiting

  @property
  def outstanding(self) -> int:
    """Requests submitted and not yet finished."""
    return self.back_pressure.outstanding

  def tenant_load(self) -> dict[str, tuple[int, int]]:
    """Per tenant (quota) with requests outstanding: (in the engine, held back)."""
    with self._lock:
      return self.back_pressure.tenant_load()

  @property
  def accepting(self) -> bool:
    return self._accepting and not self._stopped.is_set()

  def submit(self, prompt: Sequence[int], sampling: SamplingParams, tenant: str,
             sink: Callable[[Delta], None], *, quota: str | None = None) -> int:
    """Queues a request; returns its ``request_id``: the engine's id for it (``handle.id``,
    the id every log line about it carries, and the server's response id's last part).
    ``quota``: whose share it counts against (default ``tenant``). Raises
    ``EngineFailed``, ``Draining`` or ``Overloaded`` (nothing was queued)."""
    quota = tenant if quota is None else quota
    prompt = tuple(int(t) for t in prompt)
    with self._lock:
      if self.failed.is_set():
        raise EngineFailed(f"the engine stopped on an internal error ({self.failure}); the "
                           "server is restarting, retry on another replica or shortly.")
      if not self.accepting:
        raise Draining("the server is shutting down; send the request to another replica.")
      request_id = self._new_request_id()
      command = Submit(request_id, prompt, sampling, tenant)
      held = self.back_pressure.admit(request_id, quota, command)
      self._sinks[request_id] = sink
    if not held:
      self._send(command)
    return request_id

  def abort(self, request_id: int | None = None, *, ticket: int | None = None) -> None:
    """Ends a request at the next step (its caller went away); its last delta says
    ``finish_reason="abort"`` unless it finished first. (``ticket=``: the old keyword.)"""
    request_id = _request_id(request_id, ticket, "abort")
    with self._lock:
      held = self.back_pressure.held_back(request_id)
    if held:  # never sent: it ends here
      self._finish(request_id, Delta(finish_reason="abort"))
    else:
      self._send(Abort(request_id))

  def drain(self, timeout_s: float) -> int:
    """Stops taking requests, waits up to ``timeout_s`` for the outstanding ones to finish,
    aborts the rest and waits for them to end. Returns how many were aborted."""
    with self._lock:
      self._accepting = False
    self._settle(timeout_s)
    with self._lock:
      left = list(self._sinks)
    for request_id in left:
      self.abort(request_id)
    self._settle(30.0)  # aborts end at the next step
    return len(left)

  def _settle(self, timeout_s: float) -> None:
    deadline = time.monotonic() + max(0.0, timeout_s)
    while self.outstanding and time.monotonic() < deadline and not self._stopped.is_set():
      time.sleep(0.01)

  def wait_stopped(self, timeout_s: float | None = None) -> bool:
    """Whether the engine has stopped (closed, or an internal error) within ``timeout_s``."""
    return self._stopped.wait(timeout_s)

  def wait_failed(self, timeout_s: float | None) -> bool:
    """Whether an internal error stopped the engine within ``timeout_s``."""
    return self.failed.wait(timeout_s)

  # ---- answers ---------------------------------------------------------------------------------
  def _deliver(self, request_id: int, delta: Delta) -> None:
    """A delta from the engine's loop: to the request's sink; the last ends it."""
    if delta.finish_reason is not None:
      self._finish(request_id, delta)
    else:
      self._to_sink(request_id, delta)

  def _to_sink(self, request_id: int, delta: Delta) -> None:
    sink = self._sinks.get(request_id)
    if sink is None:
      return
    try:
      sink(delta)
    except Exception:  # a sink that fails loses its own request, nothing else
      logging.exception("the sink of request %d failed; the request is aborted", request_id)
      with self._lock:
        if request_id in self._sinks:
          self._sinks[request_id] = None
      if delta.finish_reason is None:
        self._send(Abort(request_id))

  def _finish(self, request_id: int, delta: Delta) -> None:
    self._to_sink(request_id, delta)
    with self._lock:
      if self._sinks.pop(request_id, "gone") == "gone":
        return
      self.counts[delta.finish_reason] += 1
      released = self.back_pressure.release(request_id)
    if released is not None:
      self._send(released)

  def _fail(self, why: str) -> None:
    """The engine stopped on an internal error: refuse from now on, say why."""
    with self._lock:
      if self.failure is None:
        self.failure = why
      self._accepting = False
    self.failed.set()

  def _end_all(self) -> None:
    """The engine stopped: every request still outstanding ends here ("error" after an
    internal error, else "abort"), the held-back ones too."""
    self._stopped.set()
    why = "error" if self.failed.is_set() else "abort"
    while True:
      with self._lock:
        left = list(self._sinks)
      if not left:
        return
      for request_id in left:
        self._finish(request_id, Delta(finish_reason=why))
