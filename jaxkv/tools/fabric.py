"""Real links on one machine: nodes in network namespaces, each node's link shaped to a rate.

A ``Fabric`` builds N nodes, each a Linux network namespace with one interface (``eth0``,
an address in the benchmarking range 198.18.0.0/15) whose other end sits on a bridge in a
*switch* namespace of its own. Nothing is added to the namespace the caller runs in: no
interface, no address, no route, so no traffic of a node can leave the fabric. Each node's
link is shaped in both directions (``tc`` token bucket, ``tbf``, on the node's interface and
on its port of the bridge) to the rate given, and can be retuned live (``set_rate``), taken
down and up (``link``), or have every process in it killed (``kill``): a node lost.

    with Fabric({"lender": 200, "engine": 10_000}) as fabric:
      server = fabric.popen("lender", [sys.executable, "-m", "..."])
      fabric.measure_mbit("lender", "engine")  # real TCP across the shaped link
      fabric.set_rate("lender", 1000)

The processes a fabric starts (``popen``, each in a process group of its own), its
namespaces, and with them every interface and queue, are removed on every exit path:
``close`` (the ``with`` block's end), the interpreter's exit, and SIGTERM. A run killed
with SIGKILL leaves them behind: namespaces are named after the process that made them
(``<prefix><pid>sw``, ``<prefix><pid>n<i>``), and the next ``Fabric`` removes every one whose
process is gone (``remove_stale``) before it builds its own.

It needs root (namespaces, interfaces and queues are the kernel's) and iproute2 (``ip``,
``tc``); without them ``FabricUnavailable`` names what is missing in one line
(``launch/bench.py --suite=fabric`` prints it and exits 2). ``netem`` is not assumed:
links are shaped by rate, not delay.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys

from jaxkv.errors import InputError
from jaxkv.pids import pid_alive

PREFIX = "jxf"
SUBNET = "198.18.0"  # node i is SUBNET.(i + 1)/24; 198.18.0.0/15 is reserved for benchmarks
MAX_NODES = 200
DEADLINE_S = 10.0  # the longest any ip/tc command, or a process's exit, is waited for

_RECEIVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("READY", flush=True)
s.settimeout(float(sys.argv[3]))
c, _ = s.accept(); c.settimeout(float(sys.argv[3]))
n, t0, first = 0, None, 0
while True:
  b = c.recv(1 << 20)
  if not b:
    break
  if t0 is None:
    t0, first = time.perf_counter(), len(b)
  n += len(b)
print(n - first, time.perf_counter() - t0, flush=True)
"""

_SENDER = r"""
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
chunk, left = b"\0" * (1 << 16), int(sys.argv[3])
while left > 0:
  c.sendall(chunk[:min(len(chunk), left)]); left -= len(chunk)
c.close()
"""


class FabricError(RuntimeError):
  """An ip/tc command failed or timed out (the command and its error in the message)."""


class FabricUnavailable(InputError):
  """This machine cannot build a fabric (not root, or iproute2 missing): one line says why
  (an ``InputError``: the launch scripts print it and exit 2)."""


def check_available() -> None:
  """Raises ``FabricUnavailable`` naming what is missing: root, ``ip`` or ``tc``."""
  missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
  if missing:
    raise FabricUnavailable(f"the fabric needs iproute2 ({' and '.join(missing)} not found "
                            "on PATH): install iproute2 (apt-get install iproute2).")
  if os.geteuid() != 0:
    raise FabricUnavailable(f"the fabric needs root (network namespaces, veth pairs and tc "
                            f"queues), and this process runs as uid {os.geteuid()}: run it "
                            "as root or in a container with CAP_NET_ADMIN.")


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
  try:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=DEADLINE_S)
  except subprocess.TimeoutExpired:
    raise FabricError(f"{' '.join(argv)!r} did not finish in {DEADLINE_S} s.") from None
  if check and done.returncode != 0:
    raise FabricError(f"{' '.join(argv)!r} failed ({done.returncode}): "
                      f"{done.stderr.strip()[:300]}")
  return done


def namespaces() -> list[str]:
  """Every network namespace's name (``ip netns list``)."""
  return [line.split()[0] for line in _run("ip", "netns", "list").stdout.splitlines()
          if line.strip()]


def _kill_namespace(netns: str) -> None:
  """SIGKILL to every process in ``netns``, then the namespace removed (its interfaces
  and their queues go with it)."""
  pids = _run("ip", "netns", "pids", netns, check=False).stdout.split()
  for pid in pids:
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass
  _run("ip", "netns", "del", netns, check=False)


def remove_stale(prefix: str = PREFIX) -> list[str]:
  """Removes the namespaces of fabrics whose process is gone (a run killed with SIGKILL):
  those named ``<prefix><pid>...`` whose ``pid`` no longer runs. Returns their names."""
  pattern = re.compile(rf"^{re.escape(prefix)}(\d+)(sw|n\d+)$")
  stale = [name for name in namespaces()
           if (m := pattern.match(name)) and not pid_alive(int(m.group(1)))]
  for name in stale:
    _kill_namespace(name)
  return stale


def _burst_bytes(mbit: float) -> int:
  """A token bucket deep enough for the rate at a 4 ms timer (and at least 32 KiB)."""
  return max(32 << 10, int(mbit * 1e6 / 8 / 250))


@dataclasses.dataclass
class Node:
  name: str
  netns: str
  address: str
  port: str  # its end on the switch's bridge
  mbit: float


class Fabric:
  """Nodes in network namespaces on one bridge, each node's link shaped to its rate (Mbit/s).
  See the module docstring."""

  def __init__(self, rates: dict[str, float], *, prefix: str = PREFIX):
    if not rates or len(rates) > MAX_NODES:
      raise InputError(f"a fabric takes 1 to {MAX_NODES} nodes; got {len(rates)}.")
    for name, mbit in rates.items():
      if not (isinstance(mbit, (int, float)) and 0 < mbit <= 100_000):
        raise InputError(f"node {name!r}'s rate {mbit!r} must be a number of Mbit/s in "
                         "(0, 100000].")
    if not re.fullmatch(r"[a-z]{1,6}", prefix):
      raise InputError(f"prefix={prefix!r} must be 1-6 lowercase letters (namespace names "
                       "are the prefix, the pid and a suffix).")
    check_available()
    self.prefix = prefix
    self.removed_stale = remove_stale(prefix)
    tag = f"{prefix}{os.getpid()}"
    if any(name.startswith(tag) for name in namespaces()):
      raise FabricError(f"namespaces named {tag}* exist already: one fabric per process at "
                        "a time (close the other first).")
    self.switch = f"{tag}sw"
    self.nodes: dict[str, Node] = {}
    self._procs: list[tuple[str, subprocess.Popen]] = []  # (node, process), as started
    self._closed = False
    atexit.register(self.close)
    self._old_term = signal.getsignal(signal.SIGTERM)
    if _in_main_thread():
      signal.signal(signal.SIGTERM, self._on_term)
    try:
      self._build(tag, rates)
    except BaseException:
      self.close()
      raise

  def _build(self, tag: str, rates: dict) -> None:
    _run("ip", "netns", "add", self.switch)
    sw = ("ip", "-n", self.switch)
    _run(*sw, "link", "set", "lo", "up")
    _run(*sw, "link", "add", "br0", "type", "bridge")
    _run(*sw, "link", "set", "br0", "up")
    for i, (name, mbit) in enumerate(rates.items()):
      node = Node(name=name, netns=f"{tag}n{i}", address=f"{SUBNET}.{i + 1}", port=f"p{i}",
                  mbit=float(mbit))
      self.nodes[name] = node
      _run("ip", "netns", "add", node.netns)
      # Both ends made inside their namespaces: nothing appears in the caller's.
      _run("ip", "link", "add", "eth0", "netns", node.netns, "type", "veth", "peer", "name",
           node.port, "netns", self.switch)
      n = ("ip", "-n", node.netns)
      _run(*n, "link", "set", "lo", "up")
      _run(*n, "addr", "add", f"{node.address}/24", "dev", "eth0")
      _run(*n, "link", "set", "eth0", "up")
      _run(*sw, "link", "set", node.port, "master", "br0")
      _run(*sw, "link", "set", node.port, "up")
      self._shape(node, "add")

  def _shape(self, node: Node, verb: str) -> None:
    rate = f"{node.mbit:g}mbit"
    burst = str(_burst_bytes(node.mbit))
    for netns, dev in ((node.netns, "eth0"), (self.switch, node.port)):
      _run("ip", "netns", "exec", netns, "tc", "qdisc", verb, "dev", dev, "root", "tbf",
           "rate", rate, "burst", burst, "latency", "50ms")

  # ---- what a run does with it -------------------------------------------------------------
  def node(self, name: str) -> Node:
    if name not in self.nodes:
      raise InputError(f"no node {name!r} in this fabric (it has {sorted(self.nodes)}).")
    return self.nodes[name]

  def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
    """Starts ``argv`` inside node ``name``'s namespace, in a process group of its own
    (killed with the fabric)."""
    proc = subprocess.Popen(["ip", "netns", "exec", self.node(name).netns, *argv],
                            start_new_session=True, **kwargs)
    self._procs.append((name, proc))
    return proc

  def set_rate(self, name: str, mbit: float) -> None:
    """Retunes node ``name``'s link (both directions) while it carries traffic."""
    if not (isinstance(mbit, (int, float)) and 0 < mbit <= 100_000):
      raise InputError(f"rate {mbit!r} must be a number of Mbit/s in (0, 100000].")
    node = self.node(name)
    node.mbit = float(mbit)
    self._shape(node, "change")

  def link(self, name: str, up: bool) -> None:
    """Sets node ``name``'s interface down (nothing passes) or up again."""
    _run("ip", "-n", self.node(name).netns, "link", "set", "eth0", "up" if up else "down")

  def kill(self, name: str) -> int:
    """Kills every process in node ``name`` (SIGKILL): the process groups this fabric
    started there (one just started may not have entered the namespace yet) and whatever
    else runs in the namespace. The node is lost; its namespace and link stay. Returns how
    many processes were killed."""
    killed = set()
    for node, proc in self._procs:
      if node == name and proc.poll() is None:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
          killed.add(proc.pid)
        except ProcessLookupError:
          pass
    for pid in _run("ip", "netns", "pids", self.node(name).netns, check=False).stdout.split():
      try:
        os.kill(int(pid), signal.SIGKILL)
        killed.add(int(pid))
      except ProcessLookupError:
        pass
    return len(killed)

  def measure_mbit(self, src: str, dst: str, *, nbytes: int | None = None,
                   port: int = 5201) -> float:
    """Real TCP from node ``src`` to node ``dst``: Mbit/s of payload received (the first
    read left out: it arrives before the bucket has drained), ``nbytes`` sent (default:
    about 1.5 s at ``src``'s shaped rate, at least 1 MiB: 32 times the smallest bucket)."""
    rate = min(self.node(src).mbit, self.node(dst).mbit)
    nbytes = nbytes or max(1 << 20, int(rate * 1e6 / 8 * 1.5))
    wait = DEADLINE_S + 4 * nbytes * 8 / (rate * 1e6)
    receiver = self.popen(dst, [sys.executable, "-c", _RECEIVER, self.node(dst).address,
                                str(port), str(wait)], stdout=subprocess.PIPE, text=True)
    try:
      if receiver.stdout.readline().strip() != "READY":
        raise FabricError(f"the receiver in node {dst!r} did not start.")
      sender = self.popen(src, [sys.executable, "-c", _SENDER, self.node(dst).address,
                                str(port), str(nbytes), str(wait)], stdout=subprocess.DEVNULL)
      sender.wait(timeout=wait)
      out, _ = receiver.communicate(timeout=wait)
    finally:
      for proc in (receiver,):
        if proc.poll() is None:
          _kill_group(proc)
    got, seconds = out.split()
    return int(got) * 8 / float(seconds) / 1e6

  # ---- teardown ------------------------------------------------------------------------------
  def close(self) -> None:
    """Kills every process the fabric started and removes its namespaces (and with them
    their interfaces and queues). Safe to call twice."""
    if self._closed:
      return
    self._closed = True
    for _, proc in self._procs:
      if proc.poll() is None:
        _kill_group(proc)
    for node in self.nodes.values():
      _kill_namespace(node.netns)
    _kill_namespace(self.switch)
    atexit.unregister(self.close)
    if _in_main_thread() and signal.getsignal(signal.SIGTERM) == self._on_term:
      signal.signal(signal.SIGTERM, self._old_term)

  def _on_term(self, signum, frame):
    self.close()
    if callable(self._old_term):
      self._old_term(signum, frame)
    raise SystemExit(128 + signum)

  def __enter__(self) -> "Fabric":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _kill_group(proc: subprocess.Popen) -> None:
  """SIGTERM to ``proc``'s process group, SIGKILL after ``DEADLINE_S``."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    try:
      os.killpg(proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      proc.wait(timeout=DEADLINE_S if sig == signal.SIGTERM else None)
      return
    except subprocess.TimeoutExpired:
      continue


def _in_main_thread() -> bool:
  import threading
  return threading.current_thread() is threading.main_thread()
