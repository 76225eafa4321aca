"""Runs a launch script as a multi-process JAX job on this machine (loopback, CPU devices
split among the processes), so a multi-host job can be tried without a cluster.

  python launch/multihost.py --num_processes=2 -- launch/serve.py --nocompare \
      --json_out=/tmp/serve.json          # writes /tmp/serve.p0.json and /tmp/serve.p1.json

Every process joins one jax.distributed job (gloo collectives) through the JAXKV_*
environment that jaxkv.distributed.initialize reads. The command exits non-zero if any
process fails, and stops the others when one does. SIGTERM is passed on to every
process (launch/server.py then drains through process 0).
"""

import os
import signal
import socket
import subprocess
import sys
import time

from absl import app, flags

from jaxkv.tools.env import child_env

_NUM = flags.DEFINE_integer("num_processes", 2, "Processes in the job.", lower_bound=1)
_DEVICES = flags.DEFINE_integer("devices", 8, "CPU devices in the whole job (split evenly).",
                                lower_bound=1)
_TIMEOUT = flags.DEFINE_float("timeout_s", 1800.0, "Stop every process after this long.")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _with_suffix(args: list[str], pid: int) -> list[str]:
  out = []
  for a in args:
    if a.startswith("--json_out=") and len(a) > len("--json_out="):
      root, ext = os.path.splitext(a[len("--json_out="):])
      a = f"--json_out={root}.p{pid}{ext or '.json'}"
    out.append(a)
  return out


def main(argv):
  script = argv[1:]
  if not script:
    raise app.UsageError("give the script to run after --, e.g. -- launch/serve.py --nocompare")
  n = _NUM.value
  if _DEVICES.value % n:
    raise app.UsageError(f"--devices={_DEVICES.value} must divide evenly among "
                         f"--num_processes={n}.")
  coordinator = f"127.0.0.1:{_free_port()}"
  procs = []
  for pid in range(n):
    env = child_env(device_count=_DEVICES.value // n, JAXKV_COORDINATOR=coordinator,
                    JAXKV_NUM_PROCESSES=str(n), JAXKV_PROCESS_ID=str(pid), JAX_PLATFORMS="cpu")
    procs.append(subprocess.Popen([sys.executable, *_with_suffix(script, pid)], env=env))
  # SIGTERM is passed on to every process, as a cluster would send it (a server drains
  # through process 0); Ctrl-C reaches them from the terminal itself. The job ends when
  # its processes do.
  def forward(sig, frame):
    del frame
    for p in procs:
      if p.poll() is None:
        p.send_signal(sig)
  signal.signal(signal.SIGTERM, forward)
  signal.signal(signal.SIGINT, lambda *_: None)
  deadline = time.monotonic() + _TIMEOUT.value
  codes = [None] * n
  stopped = []  # the processes this launcher killed: their status says nothing of their own
  while None in codes:
    for i, p in enumerate(procs):
      if codes[i] is None:
        codes[i] = p.poll()
    timed_out = time.monotonic() > deadline
    if any(c not in (None, 0) for c in codes) or timed_out:
      stopped = [i for i, c in enumerate(codes) if c is None]
      for i in stopped:  # one failed (or time is up): the job cannot finish, stop the rest
        procs[i].kill()
      codes = [p.wait() for p in procs]
      break
    time.sleep(0.2)
  failed = [i for i, c in enumerate(codes) if c != 0 and i not in stopped]
  if failed or stopped:
    print(f"error: {_failure(failed, stopped, codes, timed_out)}", file=sys.stderr)
    sys.exit(1)


def _failure(failed: list[int], stopped: list[int], codes: list[int], timed_out: bool) -> str:
  """One line: which processes ended the job and how (a signal by its name), and which
  the launcher stopped because of it."""
  def how(code: int) -> str:
    if code >= 0:
      return f"{code}"
    try:
      return f"{code} (killed by {signal.Signals(-code).name})"
    except ValueError:
      return f"{code} (killed by signal {-code})"
  parts = []
  if failed:
    parts.append(f"process(es) {failed} failed with exit status "
                 f"[{', '.join(how(codes[i]) for i in failed)}]")
  if timed_out and not failed:
    parts.append(f"the job ran past --timeout_s={_TIMEOUT.value:g}")
  if stopped:
    parts.append(f"stopped the other process(es) {stopped}" if failed
                 else f"stopped process(es) {stopped}")
  return "; ".join(parts)


if __name__ == "__main__":
  app.run(main)
