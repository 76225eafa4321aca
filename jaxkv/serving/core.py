"""The engine core in a process of its own, behind ZeroMQ: the server's process (the front)
parses, authenticates, tokenizes, detokenizes and streams; the core runs the step loop.
Neither waits on the other's GIL.

The front is a ``CoreClient``: an ``EngineService`` without an engine. What is decided
when a request arrives stays in the front, unchanged: tickets (the engine's request ids),
back-pressure (``Overloaded``), tenants' shares (requests held back), ``Draining``. What
it lets through goes to the core as the same commands a multi-host job broadcasts
(``_Submit``, ``_Abort``, ``_Stop``); the core's ``EngineService`` applies them between
steps and sends each request's ``Delta`` back, which the front hands to the request's
sink. A request held back for its tenant's share never reaches the core, and is aborted
in the front.

The wire: two ZeroMQ PUSH/PULL pairs over ``ipc://`` sockets in a directory only this
user can open (mode 0700), both bound by the front, messages pickled (both ends are this
package, in processes of one user on one host; the sockets are not reachable from
elsewhere). Front to core: ``("commands", [command, ...])``, ``("metrics", n)``. Core to
front: ``("info", engine_info)`` once its engine is built, ``("ready", (done, total))``
once warm and serving, ``("warm", (done, total))`` as buckets compile, ``("delta",
ticket, Delta)``, ``("metrics", n, text)``, ``("failed", why)``; a core that stopped as
asked simply exits 0.

Failures: an internal error in the core ends every outstanding request with
``finish_reason="error"`` (the core's loop does that) and tells the front ``failed``; a
core that dies (a signal, the OOM killer) is seen by the front's watch of its process
within 0.1 s: the front then ends every outstanding request with ``"error"`` itself, and
``failed`` is set either way, so the server answers 503 and its launcher exits non-zero.
A core whose front is gone (its parent process changed) stops.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time

import zmq
from absl import logging

from jaxkv.serving.service import Delta, EngineFailed, EngineService, _Abort, _Stop

__all__ = ["CoreClient", "CoreLink", "CoreProcess", "EngineInfo", "core_argv", "engine_info"]


FRONT_PID_ENV = "JAXKV_FRONT_PID"  # the core's parent, as the front started it


def _addresses(directory: str) -> tuple[str, str]:
  return f"ipc://{directory}/commands", f"ipc://{directory}/events"


# ---- the front's view of the engine ------------------------------------------------------------
@dataclasses.dataclass
class _CacheInfo:
  config: object  # CacheConfig
  tiers: object  # TierConfig
  num_shards: int
  pool: None = None  # (a server with a pool keeps its engine in its own process)


class _Warm:
  def __init__(self):
    self.done, self.total = 0, 1

  def warm_progress(self) -> tuple[int, int]:
    return self.done, self.total


class EngineInfo:
  """What the front reads of the core's engine: its configs and sizes (sent once, when it
  is ready), its warm-up progress (sent as it changes), and the request ids it hands out."""

  def __init__(self, info: dict):
    self.config = info["engine_config"]
    self.cache = _CacheInfo(info["cache_config"], info["tiers"], info["num_shards"])
    self.vocab_size = info["vocab_size"]
    self.stream = info["stream"]
    self.runner = _Warm()
    self._next_id = 0
    self._lock = threading.Lock()

  def new_request_id(self) -> int:
    with self._lock:
      self._next_id += 1
      return self._next_id - 1


def engine_info(engine) -> dict:
  """The core's half of ``EngineInfo``."""
  return {"engine_config": engine.config, "cache_config": engine.cache.config,
          "tiers": engine.cache.tiers, "num_shards": engine.cache.num_shards,
          "vocab_size": engine.vocab_size, "stream": engine.stream}


# ---- the core's end ------------------------------------------------------------------------------
class CoreLink:
  """The core process's end of the wire: commands in (a thread of their own feeds them to
  the service), deltas and news out. ``send`` may be called from any thread."""

  def __init__(self, directory: str):
    commands, events = _addresses(directory)
    self._ctx = zmq.Context()
    self._in = self._ctx.socket(zmq.PULL)
    self._in.connect(commands)
    self._out = self._ctx.socket(zmq.PUSH)
    self._out.setsockopt(zmq.LINGER, 5000)
    # Never block the engine's thread on a send: a slow front queues (a gone one is
    # noticed below and the core stops).
    self._out.setsockopt(zmq.SNDHWM, 0)
    self._out.connect(events)
    self._lock = threading.Lock()
    # The front that started it (told at start: it may be gone before this line runs).
    self._parent = int(os.environ.get(FRONT_PID_ENV, os.getppid()))
    self.service: EngineService | None = None
    self.metrics = None  # () -> bytes: the engine's exposition text
    threading.Thread(target=self._watch_parent, name="jaxkv-core-parent", daemon=True).start()

  def _watch_parent(self) -> None:
    """Before the loop serves (building, compiling, restoring): a core whose front is gone
    has no one to serve and nothing to save; it exits at once. (Once it serves, the
    commands' thread stops the loop instead, so the tiers are flushed.)"""
    while self.service is None:
      if os.getppid() != self._parent:
        logging.error("the server's front process is gone while the engine core started; "
                      "it exits")
        os._exit(1)
      time.sleep(0.2)

  def send(self, *message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with self._lock:
      self._out.send(data)

  def sink(self, ticket: int, delta: Delta) -> None:
    """The sink of every request the core runs (``EngineService(default_sink=...)``)."""
    self.send("delta", ticket, delta)

  def serve(self, service: EngineService) -> threading.Thread:
    """Feeds the front's commands to ``service`` on a thread of its own, until a stop
    command, or until the front is gone (then the service is stopped)."""
    self.service = service
    thread = threading.Thread(target=self._receive, name="jaxkv-core-commands", daemon=True)
    thread.start()
    return thread

  def _receive(self) -> None:
    poller = zmq.Poller()
    poller.register(self._in, zmq.POLLIN)
    while True:
      if not poller.poll(100):
        if os.getppid() != self._parent:  # the front died: nothing will ask for answers
          logging.error("the server's front process is gone; the engine core stops")
          self.service.accept([_Stop()])
          return
        continue
      kind, *rest = pickle.loads(self._in.recv())
      if kind == "commands":
        self.service.accept(rest[0])
        if any(isinstance(c, _Stop) for c in rest[0]):
          return
      elif kind == "metrics":
        self.send("metrics", rest[0], self.metrics() if self.metrics else b"")

  def close(self) -> None:
    self._in.close(0)
    self._out.close()
    self._ctx.term()


# ---- the front's end -----------------------------------------------------------------------------
class CoreProcess:
  """The front's end of the wire before the service exists: the sockets (bound in a
  directory of its own) and the core's process. ``start(argv)``, then ``wait_info`` for
  the core's ``EngineInfo`` (sent once its engine is built, before it compiles)."""

  def __init__(self):
    self.directory = tempfile.mkdtemp(prefix="jaxkv-core-")  # 0700: this user's alone
    commands, events = _addresses(self.directory)
    self.ctx = zmq.Context()
    self.out = self.ctx.socket(zmq.PUSH)
    self.out.setsockopt(zmq.LINGER, 1000)
    self.out.bind(commands)
    self.events = self.ctx.socket(zmq.PULL)
    self.events.bind(events)
    self.proc: subprocess.Popen | None = None

  def start(self, argv: list[str]) -> None:
    self.proc = subprocess.Popen(argv, env={**os.environ, FRONT_PID_ENV: str(os.getpid())})

  def wait_info(self, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
      if self.events.poll(100):
        kind, *rest = pickle.loads(self.events.recv())
        if kind == "info":
          return rest[0]
        continue
      if self.proc.poll() is not None:
        raise EngineFailed(f"the engine core exited with status {self.proc.returncode} "
                           "while starting; its log is above.")
      if time.monotonic() > deadline:
        self.kill()
        raise EngineFailed(f"the engine core built no engine within {timeout_s:g} s.")

  def kill(self) -> None:
    if self.proc is not None and self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()

  def close(self) -> None:
    self.out.close(0)
    self.events.close(0)
    self.ctx.term()
    for name in ("commands", "events"):
      try:
        os.unlink(os.path.join(self.directory, name))
      except OSError:
        pass
    os.rmdir(self.directory)


class CoreClient(EngineService):
  """The front's ``EngineService``: the same ``submit``/``abort``/``drain``/``close`` and
  failure semantics, over the engine core of ``process`` (started, its info received)."""

  def __init__(self, process: CoreProcess, info: dict, *, max_waiting: int = 64,
               max_running_per_tenant: int = 0, max_waiting_per_tenant: int | None = None):
    super().__init__(EngineInfo(info), max_waiting=max_waiting,
                     max_running_per_tenant=max_running_per_tenant,
                     max_waiting_per_tenant=max_waiting_per_tenant, lockstep=False)
    self.process = process
    self._send_lock = threading.Lock()
    self._ready = threading.Event()
    self._metrics: dict[int, list] = {}
    self._metrics_id = 0
    self.exit_status: int | None = None
    self._receiver = threading.Thread(target=self._receive, name="jaxkv-core-events",
                                      daemon=True)
    self._receiver.start()

  def wait_ready(self, timeout_s: float | None) -> bool:
    """Waits until the core has compiled and runs its loop; False if it stopped first or
    is not ready within ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not self._ready.wait(0.1):
      if self._stopped.is_set() or (deadline is not None and time.monotonic() > deadline):
        return False
    return True

  def start(self) -> CoreClient:
    return self  # the loop runs in the core's process

  # ---- commands out ----------------------------------------------------------------------------
  def _post(self, command) -> None:
    self._command("commands", [command])

  def _command(self, *message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with self._send_lock:
      self.process.out.send(data)

  def abort(self, ticket: int) -> None:
    with self._lock:
      held = ticket in self._sinks and ticket not in self._entered
    if held:  # held back for its tenant's share, never sent: it ends here
      self._finish(ticket, Delta(finish_reason="abort"))
    else:
      self._post(_Abort(ticket))

  def metrics_text(self, timeout_s: float = 5.0) -> bytes:
    """The core's Prometheus exposition (its engine's families); b"" past the deadline."""
    with self._lock:
      self._metrics_id += 1
      ask = self._metrics_id
      box = self._metrics[ask] = []
    self._command("metrics", ask)
    deadline = time.monotonic() + timeout_s
    while not box and time.monotonic() < deadline and not self._stopped.is_set():
      time.sleep(0.005)
    with self._lock:
      self._metrics.pop(ask, None)
    return box[0] if box else b""

  # ---- news in ---------------------------------------------------------------------------------
  def _receive(self) -> None:
    try:
      self._receive_until_exit()
    except BaseException as e:  # a bug here would leave every request waiting: fail loudly
      logging.exception("the front's reader of the engine core failed")
      with self._lock:
        self.failure = f"the front's reader of the engine core failed ({e!r})"[:300]
        self._accepting = False
      self.failed.set()
      self.process.kill()
      self._core_exited(-1)

  def _receive_until_exit(self) -> None:
    events, proc = self.process.events, self.process.proc
    while True:
      if not events.poll(100):
        if proc.poll() is not None:
          self._core_exited(proc.returncode)
          return
        continue
      kind, *rest = pickle.loads(events.recv())
      if kind == "delta":
        ticket, delta = rest
        if delta.finish_reason is not None:
          self._finish(ticket, delta)
        else:
          self._send(ticket, delta)
      elif kind == "ready":
        self.engine.runner.done, self.engine.runner.total = rest[0]
        self._ready.set()
      elif kind == "warm":
        self.engine.runner.done, self.engine.runner.total = rest[0]
      elif kind == "metrics":
        with self._lock:
          box = self._metrics.get(rest[0])
        if box is not None:
          box.append(rest[1])
      elif kind == "failed":
        with self._lock:
          self.failure = rest[0]
          self._accepting = False
        self.failed.set()

  def _core_exited(self, status: int) -> None:
    """The core process ended: every request still outstanding ends here ("error" unless
    the core stopped as asked)."""
    self.exit_status = status
    if status != 0 and not self.failed.is_set():
      with self._lock:
        self.failure = f"the engine core process exited with status {status}"
        self._accepting = False
      logging.error("%s; every outstanding request ends with finish_reason='error'",
                    self.failure)
      self.failed.set()
    self._stopped.set()
    with self._lock:
      left = list(self._sinks)
    why = "error" if self.failed.is_set() else "abort"
    for ticket in left:
      self._finish(ticket, Delta(finish_reason=why))

  # ---- the end ---------------------------------------------------------------------------------
  def close(self, timeout_s: float = 600.0) -> None:
    """Stops the core after the commands sent (it flushes its tiers and saves its
    checkpoint first) and waits for its process; raises ``TimeoutError`` past the deadline
    (the core is then killed)."""
    with self._lock:
      self._accepting = False
    proc = self.process.proc
    if proc.poll() is None:
      self._post(_Stop())
      try:
        proc.wait(timeout_s)
      except subprocess.TimeoutExpired:
        self.process.kill()
        raise TimeoutError(f"the engine core did not stop within {timeout_s} s; it was "
                           "killed.") from None
    self._receiver.join(5)
    self.process.close()


def core_argv(directory: str) -> list[str]:
  """This program's command line with ``--core_dir``: the core parses the same flags. As
  it was first run when that was a script (a wrapper script that patches the engine stays
  in it); run from code (``-c``, ``-m``: a test driving ``main``), the script's own
  arguments."""
  orig = sys.orig_argv
  script = next((a for a in orig[1:] if not a.startswith("-") or a in ("-c", "-m")), "")
  if script.endswith(".py") and os.path.isfile(script):
    base = list(orig)
  else:
    base = [sys.executable, *sys.argv]
  return [*base, f"--core_dir={directory}"]
