"""The one engine-client interface: its back-pressure (a value with no engine), engine
commands run where the engine runs (on its thread, or beside its loop for one that waits),
and ``request_id`` as the one name of a request (``ticket=`` still works, with a warning)."""

import dataclasses
import threading
from typing import ClassVar

import pytest

import helpers
import jaxkv
from jaxkv.serving import BackPressure, EngineClient, EngineFailed, EngineService, Overloaded
from jaxkv.serving.core import CoreClient


def test_back_pressure_admits_to_its_limit_and_lets_held_requests_in_first_come_first_in():
  gate = BackPressure(2, max_waiting=4, max_running_per_tenant=1, max_waiting_per_tenant=3)
  assert gate.admit(0, "a", "s0") is False  # in the engine
  assert [gate.admit(i, "a", f"s{i}") for i in (1, 2, 3)] == [True, True, True]  # held back
  with pytest.raises(Overloaded, match="tenant 'a' holds 4 requests"):
    gate.admit(9, "a", "s9")
  assert gate.admit(4, "b", "t4") is False
  assert gate.admit(5, "b", "t5") is True
  with pytest.raises(Overloaded, match=r"holds 6 requests, its limit \(rows \+ max_waiting = 6"):
    gate.admit(6, "c", "u6")
  assert gate.tenant_load() == {"a": (1, 3), "b": (1, 1)} and gate.outstanding == 6
  assert gate.held_back(2) and not gate.held_back(0) and not gate.held_back(9)
  # The one in the engine ends: the first held back enters.
  assert gate.release(0) == "s1" and not gate.held_back(1)
  # A held-back one ends (aborted before it entered): nothing enters in its place.
  assert gate.release(2) is None and gate.tenant_load()["a"] == (1, 1)
  assert gate.release(1) == "s3"
  assert gate.release(3) is None and gate.release(3) is None  # (ended once)
  assert gate.tenant_load() == {"b": (1, 1)} and gate.outstanding == 2


def test_the_core_client_is_an_engine_client_and_no_in_process_service():
  """The front over a core process implements the interface; it no longer subclasses the
  in-process service (and so cannot fall back on an engine it does not have)."""
  assert issubclass(CoreClient, EngineClient) and issubclass(EngineService, EngineClient)
  assert not issubclass(CoreClient, EngineService)
  assert not {"engine", "loop"} & set(vars(CoreClient))


@dataclasses.dataclass(frozen=True)
class _ThreadName:
  on_engine_thread: ClassVar[bool] = True

  def __call__(self, engine):
    return threading.current_thread().name


@dataclasses.dataclass(frozen=True)
class _WaitFor:
  """Waits for ``event`` (set when a request submitted after it finishes): it can only
  be set if the loop keeps stepping while this waits."""

  on_engine_thread: ClassVar[bool] = False
  event: threading.Event

  def __call__(self, engine):
    return threading.current_thread().name if self.event.wait(60) else "the loop was blocked"


@dataclasses.dataclass(frozen=True)
class _Raises:
  on_engine_thread: ClassVar[bool] = True

  def __call__(self, engine):
    raise LookupError("injected: the command's own error")


@pytest.fixture(scope="module")
def engine(mesh):
  return helpers.make_engine(mesh)


def _finished(service, prompt, max_new_tokens):
  """Submits a request; returns its id, the event set when it ends, and its deltas."""
  done, got = threading.Event(), []

  def sink(delta):
    got.append(delta)
    if delta.finish_reason is not None:
      done.set()

  request_id = service.submit(prompt, jaxkv.SamplingParams(max_new_tokens=max_new_tokens),
                              "default", sink)
  return request_id, done, got


def test_engine_commands_run_on_the_engines_thread_or_beside_its_loop_and_answer_by_future(engine):
  service = EngineService(engine).start()
  try:
    assert service.call(_ThreadName()).result(60) == "jaxkv-engine"
    # A command that waits runs beside the loop: a request sent after it still runs.
    event = threading.Event()
    waiting = service.call(_WaitFor(event))
    _, done, got = _finished(service, [3, 1, 4, 1, 5], 3)
    assert done.wait(60) and got[-1].finish_reason == "length"
    event.set()
    assert waiting.result(60).startswith("jaxkv-engine-aside")
    # A command's own error is its caller's; the engine goes on serving.
    with pytest.raises(LookupError, match="injected"):
      service.call(_Raises()).result(60)
    _, done, got = _finished(service, [2, 7, 1, 8], 2)
    assert done.wait(60) and len([t for d in got for t in d.tokens]) == 2
    assert not service.failed.is_set()
  finally:
    service.close()
  with pytest.raises(EngineFailed, match="before the command ran"):
    service.call(_ThreadName()).result(5)  # a stopped loop runs nothing: it says so
  helpers.no_refs(engine)


def test_a_request_id_is_aborted_by_the_old_keyword_ticket_with_a_warning(engine):
  service = EngineService(engine).start()
  try:
    request_id, done, got = _finished(service, [9, 9, 8, 7], 100)
    helpers.wait_for(lambda: got, 60, "the request's first tokens")
    with pytest.warns(DeprecationWarning, match=r"abort\(request_id=\.\.\.\)"):
      service.abort(ticket=request_id)
    assert done.wait(60) and got[-1].finish_reason == "abort"
    assert service.outstanding == 0 and service.counts["abort"] == 1
  finally:
    service.close()
  helpers.no_refs(engine)


def test_a_front_removes_the_socket_directories_of_fronts_that_are_gone(tmp_path, monkeypatch):
  """A front and its core killed together (SIGKILL to their group) leave their socket
  directory; the next front removes those whose front is gone, and nothing else."""
  import os
  import subprocess
  import sys
  import tempfile
  from jaxkv.serving import core

  gone = subprocess.Popen([sys.executable, "-c", "pass"])
  gone.wait()
  def wire(name, extra=()):
    d = tmp_path / name
    d.mkdir(mode=0o700)
    for f in ("commands", "events", *extra):
      (d / f).write_bytes(b"")
    return d
  stale = wire(f"jaxkv-core-{gone.pid}-a1")
  live = wire(f"jaxkv-core-{os.getpid()}-b2")  # a running front's: kept
  odd = wire(f"jaxkv-core-{gone.pid}-c3", extra=("notes",))  # holds more than a wire: kept
  victim = wire("elsewhere")
  (tmp_path / f"jaxkv-core-{gone.pid}-d4").symlink_to(victim)  # never followed
  unrelated = wire("jaxkv-core-notapid-e5")
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  process = core.CoreProcess()
  try:
    assert not stale.exists()
    assert live.exists() and (live / "commands").exists()
    assert odd.exists() and (odd / "notes").exists()
    assert (victim / "commands").exists() and (victim / "events").exists()
    assert unrelated.exists()
    assert os.path.basename(process.directory).startswith(f"jaxkv-core-{os.getpid()}-")
  finally:
    process.close()
  assert not os.path.exists(process.directory)
  assert core.remove_stale_sockets(str(tmp_path)) == 0  # (the live one is still there)
