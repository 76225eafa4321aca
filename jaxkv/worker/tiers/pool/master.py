"""A Mooncake master on this machine: for the tests, the bench and a single-node trial.

``LocalMaster`` starts the wheel's ``mooncake_master`` with its HTTP metadata server (and
its metrics server), each on a loopback port of its own, waits until both answer, and stops it with its whole
process group. ``restart`` brings it back on the same ports (what a crashed master's
supervisor does); the pool's contents do not survive it (the master keeps them in memory:
clients remount their segments and put again).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from jaxkv.worker.tiers.pool import native


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _answers(port: int) -> bool:
  try:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5):
      return True
  except OSError:
    return False


def master_argv(host: str, rpc_port: int, http_port: int, metrics_port: int | None = None,
                flags: tuple = ()) -> list[str]:
  """The command line of ``mooncake_master`` serving RPC and its HTTP metadata on
  ``host`` (its metrics there too, on ``metrics_port`` or the binary's default)."""
  return [native.master_binary(), f"--rpc_port={rpc_port}", f"--rpc_address={host}",
          "--enable_http_metadata_server=true", f"--http_metadata_server_port={http_port}",
          f"--http_metadata_server_host={host}", f"--metrics_host={host}",
          *([f"--metrics_port={metrics_port}"] if metrics_port is not None else []), *flags]


class LocalMaster:
  """``mooncake_master`` on loopback. ``address`` (``host:port``, for ``--pool``) and
  ``metadata`` (for ``--pool_metadata``). ``flags``: more master flags (``--key=value``)."""

  def __init__(self, *, log_path: str | None = None, lease_ms: int = 2000,
               flags: tuple = ()):
    self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
    self.log_path = log_path or os.devnull
    self.flags = (f"--default_kv_lease_ttl={lease_ms}", "--client_ttl=3", *flags)
    self.proc: subprocess.Popen | None = None

  @property
  def address(self) -> str:
    return f"127.0.0.1:{self.rpc_port}"

  @property
  def metadata(self) -> str:
    return f"http://127.0.0.1:{self.http_port}/metadata"

  def start(self, timeout_s: float = 30.0) -> "LocalMaster":
    native.fetch_libs()
    cmd = master_argv("127.0.0.1", self.rpc_port, self.http_port, self.metrics_port,
                      self.flags)
    with open(self.log_path, "ab") as log:
      self.proc = subprocess.Popen(cmd, env=native.master_env(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    t_end = time.monotonic() + timeout_s
    while not (_answers(self.rpc_port) and _answers(self.http_port)):
      if self.proc.poll() is not None:
        raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} at start "
                           f"(its log: {self.log_path})")
      if time.monotonic() > t_end:
        self.stop()
        raise RuntimeError(f"mooncake_master did not answer within {timeout_s:.0f} s "
                           f"(its log: {self.log_path})")
      time.sleep(0.05)
    return self

  def stop(self) -> None:
    """Kills the master and its process group (SIGKILL: what a crash looks like)."""
    if self.proc is None:
      return
    try:
      os.killpg(self.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    self.proc.wait(timeout=30)
    self.proc = None

  def restart(self, timeout_s: float = 30.0) -> None:
    self.stop()
    self.start(timeout_s)

  def __enter__(self) -> "LocalMaster":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()
