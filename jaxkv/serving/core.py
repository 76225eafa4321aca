"""The engine core in a process of its own, behind ZeroMQ: the server's process (the front)
parses, authenticates, tokenizes, detokenizes and streams; the core runs the step loop.
Neither waits on the other's GIL.

The front's ``CoreClient`` is an ``EngineClient`` (``jaxkv.serving.client``), as the
in-process ``EngineService`` is: what is decided when a request arrives stays in the
front (request ids, ``BackPressure``, tenants' shares, ``Draining``); what it lets through
goes to the core as the commands an ``EngineLoop`` takes (``Submit``, ``Abort``,
``Stop``), and engine commands (``EngineClient.call``: the P/D hand-off) as calls the
core's process carries out and answers. The core's ``EngineLoop`` applies them between
steps and sends each request's ``Delta`` back, which the front hands to the request's
sink. A request held back for its tenant's share never reaches the core.

The wire: two ZeroMQ PUSH/PULL pairs over ``ipc://`` sockets in a directory only this
user can open (mode 0700), both bound by the front, messages pickled (both ends are this
package, in processes of one user on one host; the sockets are not reachable from
elsewhere). Front to core: ``("commands", [command, ...])``, ``("call", call_id,
command)``, ``("metrics", n)``. Core to front: ``("info", {"engine": EngineInfo, ...})``
once its engine is built, ``("ready", (done, total))`` once warm and serving, ``("warm",
(done, total))`` as buckets compile, ``("delta", request_id, Delta)``, ``("result",
call_id, ok, value)``, ``("metrics", n, text)``, ``("failed", why)``; a core that stopped
as asked simply exits 0.

Failures: an internal error in the core stops its loop and tells the front ``failed``; a
core that dies (a signal, the OOM killer) is seen by the front's watch of its process
within 0.1 s. Either way the front ends every outstanding request with
``finish_reason="error"`` and every call waiting with ``EngineFailed``, ``failed`` is set,
so the server answers 503 and its launcher exits non-zero. A core whose front is gone
(its parent process changed) stops.
"""

from __future__ import annotations

import itertools
import os
import pickle
import stat
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

import zmq
from absl import logging

from jaxkv.pids import pid_alive
from jaxkv.serving.client import Delta, EngineClient, EngineCommand, EngineFailed, EngineInfo
from jaxkv.serving.service import Call, EngineLoop, Stop

__all__ = ["CoreClient", "CoreLink", "CoreProcess", "core_argv"]


FRONT_PID_ENV = "JAXKV_FRONT_PID"  # the core's parent, as the front started it


def _addresses(directory: str) -> tuple[str, str]:
  return f"ipc://{directory}/commands", f"ipc://{directory}/events"


def _outcome(future: Future) -> tuple[bool, object]:
  """``(ok, value or exception)`` of a finished call, as the wire carries it."""
  error = future.exception()
  if error is None:
    return True, future.result()
  try:
    pickle.dumps(error)
  except Exception:  # an exception that does not cross: its words do
    error = RuntimeError(f"{type(error).__name__}: {error}")
  return False, error


# The front's socket directory: ``jaxkv-core-<front pid>-<random>`` in the temporary
# directory. A front and its core killed together (SIGKILL to their process group, as a
# supervisor's or a test's timeout does) remove nothing; the next front removes the
# directories whose front is gone (``remove_stale_sockets``).
SOCKETS_PREFIX = "jaxkv-core-"


def remove_stale_sockets(parent: str | None = None) -> int:
  """Removes the socket directories (this user's) of fronts that no longer run, in
  ``parent`` (the temporary directory); returns how many. A directory whose front's pid is
  alive is left, even when the pid was reused: a leftover, never a live front's wire. (Pids
  are this PID namespace's: containers that share one temporary directory should each set
  their own ``TMPDIR``, or a front in one would take another's fronts for gone.)"""
  parent = parent or tempfile.gettempdir()
  removed = 0
  try:
    names = os.listdir(parent)
  except OSError:
    return 0
  for name in names:
    pid = name[len(SOCKETS_PREFIX):].split("-", 1)[0]
    if not name.startswith(SOCKETS_PREFIX) or not pid.isdigit() or pid_alive(int(pid)):
      continue
    path = os.path.join(parent, name)
    try:
      st = os.lstat(path)
    except OSError:
      continue
    if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():  # (not a link: lstat)
      remove_sockets(path)
      removed += not os.path.exists(path)
  return removed


def remove_sockets(directory: str) -> None:
  """Removes the wire's sockets and their directory (``CoreProcess`` made it): by the front
  when it closes, by the core when its front died without closing (SIGKILL)."""
  for name in ("commands", "events"):
    try:
      os.unlink(os.path.join(directory, name))
    except OSError:
      pass
  try:
    os.rmdir(directory)
  except OSError:
    pass


# ---- the core's end ------------------------------------------------------------------------------
class CoreLink:
  """The core process's end of the wire: commands in (a thread of their own feeds them to
  the loop), deltas, call results and news out. ``send`` may be called from any thread."""

  def __init__(self, directory: str):
    commands, events = _addresses(directory)
    self._directory = directory
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
    self.loop: EngineLoop | None = None
    self.metrics = None  # () -> bytes: the engine's exposition text
    threading.Thread(target=self._watch_parent, name="jaxkv-core-parent", daemon=True).start()

  def _watch_parent(self) -> None:
    """Before the loop serves (building, compiling, restoring): a core whose front is gone
    has no one to serve and nothing to save; it exits at once. (Once it serves, the
    commands' thread stops the loop instead, so the tiers are flushed.)"""
    while self.loop is None:
      if os.getppid() != self._parent:
        logging.error("the server's front process is gone while the engine core started; "
                      "it exits")
        remove_sockets(self._directory)  # (the front could not)
        os._exit(1)
      time.sleep(0.2)

  def send(self, *message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with self._lock:
      self._out.send(data)

  def deliver(self, request_id: int, delta: Delta) -> None:
    """The deliver of the core's loop (``EngineLoop(deliver=...)``)."""
    self.send("delta", request_id, delta)

  def serve(self, loop: EngineLoop) -> threading.Thread:
    """Feeds the front's commands to ``loop`` on a thread of its own, until a stop
    command, or until the front is gone (then the loop is stopped)."""
    self.loop = loop
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
          remove_sockets(self._directory)  # (the front could not)
          self.loop.post(Stop())
          return
        continue
      kind, *rest = pickle.loads(self._in.recv())
      if kind == "commands":
        self.loop.post(*rest[0])
        if any(isinstance(c, Stop) for c in rest[0]):
          return
      elif kind == "call":
        call_id, command = rest
        future: Future = Future()
        future.add_done_callback(
            lambda f, call_id=call_id: self.send("result", call_id, *_outcome(f)))
        self.loop.post(Call(command, future))
      elif kind == "metrics":
        self.send("metrics", rest[0], self.metrics() if self.metrics else b"")

  def close(self) -> None:
    self._in.close(0)
    self._out.close()
    self._ctx.term()


# ---- the front's end -----------------------------------------------------------------------------
class CoreProcess:
  """The front's end of the wire before its client exists: the sockets (bound in a
  directory of its own) and the core's process. ``start(argv)``, then ``wait_info`` for
  what the core says of its engine (sent once its engine is built, before it compiles)."""

  def __init__(self):
    remove_stale_sockets()
    # 0700: this user's alone
    self.directory = tempfile.mkdtemp(prefix=f"{SOCKETS_PREFIX}{os.getpid()}-")
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
    """``{"engine": EngineInfo, ...}`` (the launcher's fields beside it)."""
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
    remove_sockets(self.directory)


class CoreClient(EngineClient):
  """The ``EngineClient`` over the engine core of ``process`` (started, its info
  received): the same ``submit``/``abort``/``call``/``drain``/``close`` and failure
  semantics as the in-process ``EngineService``."""

  def __init__(self, process: CoreProcess, info: EngineInfo, *, max_waiting: int = 64,
               max_running_per_tenant: int = 0, max_waiting_per_tenant: int | None = None):
    super().__init__(info, max_waiting=max_waiting,
                     max_running_per_tenant=max_running_per_tenant,
                     max_waiting_per_tenant=max_waiting_per_tenant)
    self.process = process
    self._send_lock = threading.Lock()
    self._ready = threading.Event()
    self._progress = (0, 1)
    self._ids = itertools.count()  # request ids (the core's engine takes them as given)
    self._calls: dict[int, Future] = {}  # call id -> its caller's future
    self._call_ids = itertools.count()
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

  def warm_progress(self) -> tuple[int, int]:
    return self._progress

  def _new_request_id(self) -> int:
    return next(self._ids)

  # ---- commands out ----------------------------------------------------------------------------
  def _send(self, command) -> None:
    self._command("commands", [command])

  def _command(self, *message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with self._send_lock:
      self.process.out.send(data)

  def call(self, command: EngineCommand) -> Future:
    future: Future = Future()
    with self._lock:
      if self._stopped.is_set():
        future.set_exception(EngineFailed(f"the engine core has stopped "
                                          f"({self.failure or 'closed'})."))
        return future
      call_id = next(self._call_ids)
      self._calls[call_id] = future
    self._command("call", call_id, command)
    return future

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
      self._fail(f"the front's reader of the engine core failed ({e!r})"[:300])
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
        self._deliver(*rest)
      elif kind == "result":
        call_id, ok, value = rest
        with self._lock:
          future = self._calls.pop(call_id, None)
        if future is not None and future.set_running_or_notify_cancel():
          future.set_result(value) if ok else future.set_exception(value)
      elif kind in ("ready", "warm"):
        self._progress = tuple(rest[0])
        if kind == "ready":
          self._ready.set()
      elif kind == "metrics":
        with self._lock:
          box = self._metrics.get(rest[0])
        if box is not None:
          box.append(rest[1])
      elif kind == "failed":
        self._fail(rest[0])
        self._end_all()

  def _core_exited(self, status: int) -> None:
    """The core process ended: every request still outstanding ends here ("error" unless
    the core stopped as asked), every call waiting fails."""
    self.exit_status = status
    if status != 0 and not self.failed.is_set():
      self._fail(f"the engine core process exited with status {status}")
      logging.error("%s; every outstanding request ends with finish_reason='error'",
                    self.failure)
    with self._lock:
      self._stopped.set()
      calls, self._calls = list(self._calls.values()), {}
    why = f"the engine core stopped ({self.failure or 'closed'}) before it answered."
    for future in calls:
      if future.set_running_or_notify_cancel():
        future.set_exception(EngineFailed(why))
    self._end_all()

  # ---- the end ---------------------------------------------------------------------------------
  def close(self, timeout_s: float = 600.0) -> None:
    """Stops the core after the commands sent (it flushes its tiers and saves its
    checkpoint first) and waits for its process; raises ``TimeoutError`` past the deadline
    (the core is then killed)."""
    with self._lock:
      self._accepting = False
    proc = self.process.proc
    try:
      if proc.poll() is None:
        self._send(Stop())
        try:
          proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
          self.process.kill()
          raise TimeoutError(f"the engine core did not stop within {timeout_s} s; it was "
                             "killed.") from None
      self._receiver.join(5)
    finally:
      self.process.close()  # (the sockets and their directory, on every path)


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
