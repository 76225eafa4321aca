"""Starting ``launch/server.py`` as a real process on a loopback port, for tests.

The process gets its own session (process group): every path out of a test kills the
whole group. A server that does not become ready in time, or exits first, is an error
naming its log's tail, never a skip.
"""

import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProcess:
  def __init__(self, args, workdir, *, script="launch/server.py", prefix=(), timeout_s=600.0):
    os.makedirs(workdir, exist_ok=True)
    self.ready_file = os.path.join(workdir, f"ready-{time.monotonic_ns()}.json")
    self.log_path = os.path.join(workdir, f"server-{time.monotonic_ns()}.log")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    self._log = open(self.log_path, "w")
    self.proc = subprocess.Popen(
        [sys.executable, *prefix, script, "--port=0", f"--ready_file={self.ready_file}", *args],
        cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(self.ready_file):
      if self.proc.poll() is not None:
        raise RuntimeError(f"the server exited with {self.proc.returncode} before it was "
                           f"ready:\n{self.log()[-4000:]}")
      if time.monotonic() > deadline:
        self.kill()
        raise RuntimeError(f"the server was not ready within {timeout_s} s:\n"
                           f"{self.log()[-4000:]}")
      time.sleep(0.2)
    with open(self.ready_file) as f:  # written aside and renamed: whole
      self.port = json.load(f)["port"]
    self.url = f"http://127.0.0.1:{self.port}"

  def log(self) -> str:
    with open(self.log_path) as f:
      return f.read()

  def terminate(self, timeout_s: float = 120.0) -> int:
    """SIGTERM to the server alone (a graceful stop); its exit status."""
    self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
      self.kill()
      raise RuntimeError(f"the server did not stop within {timeout_s} s of SIGTERM:\n"
                         f"{self.log()[-4000:]}") from None

  def kill(self) -> None:
    if self.proc.poll() is None:
      try:
        os.killpg(self.proc.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      self.proc.wait(30)
    self._log.close()
