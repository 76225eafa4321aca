"""Test settings: 8 virtual CPU devices and strict dtype promotion, set before JAX starts."""

import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the session and the subprocesses it starts (serve,
# generate, bench, multi-process jobs compile the same steps over and over): a fresh
# directory per session, removed at exit; or, with JAXKV_TEST_COMPILATION_CACHE=DIR, that
# directory, kept for the next run (a developer's reruns; the suite passes from an empty
# one, and CI needs none). It changes no result, only compile time.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _JIT_CACHE = os.environ.get("JAXKV_TEST_COMPILATION_CACHE")
  if _JIT_CACHE:
    os.makedirs(_JIT_CACHE, exist_ok=True)
  else:
    _JIT_CACHE = tempfile.mkdtemp(prefix="jaxkv-test-jit-")
    atexit.register(shutil.rmtree, _JIT_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _JIT_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# XLA's CPU backend compiles at LLVM -O0 in the tests, and emits its fusions with the
# elemental emitters rather than the MLIR fusion emitters (JAXKV_TEST_XLA_FLAGS= turns both
# off): -O0 takes a third off each compile, the emitters half of what is left (the engine's
# test file: 104 s -> 72 s on a 2-core EPYC, 71 -> 38 s of it compiling), and the results
# are the same (no fast-math either way: the serve and tiers digests are the ones the
# defaults give). The processes the tests start inherit every flag but the device count
# (jaxkv.tools.env.child_env).
TEST_XLA_FLAGS = os.environ.get(
    "JAXKV_TEST_XLA_FLAGS",
    "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
          if not f.startswith("--xla_force_host_platform_device_count")]
_flags += [f for f in TEST_XLA_FLAGS.split() if f not in _flags]
os.environ["XLA_FLAGS"] = " ".join(_flags + ["--xla_force_host_platform_device_count=8"])
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


# Files whose tests share a session fixture run on one xdist worker (it starts once).
_SHARED = {"tests/worker/test_remote.py": "remote owners",
           "tests/worker/test_remote_security.py": "remote owners",
           "tests/tools/test_bench.py": "device check dry run",
           "tests/tools/test_device_check.py": "device check dry run"}


# The slowest files (seconds of their tests on a loaded worker, 2 cores: the suite's JUnit
# times at 5642c24, two workers), run first so that no worker is left with a long file at
# the end while the others idle; the rest follow in the order pytest found them.
_SLOW = {"tests/models/test_kv_groups.py": 140, "tests/entrypoints/test_server.py": 135,
         "tests/models/test_gguf.py": 110, "tests/serving/test_engine.py": 80,
         "tests/tools/test_lowering.py": 70, "tests/tools/test_load.py": 70,
         "tests/worker/test_pool.py": 65, "tests/models/test_gemma3.py": 65,
         "tests/launch/test_replicas.py": 60, "tests/launch/test_serve.py": 50,
         "tests/tools/test_bench.py": 50, "tests/launch/test_multihost.py": 40,
         "tests/models/test_hf.py": 40, "tests/launch/test_pool_launch.py": 40,
         "tests/worker/test_remote.py": 40, "tests/combos/test_process_combos.py": 40,
         "tests/worker/test_checkpoint.py": 40, "tests/tools/test_platform_defaults.py": 40,
         "tests/worker/test_tiers.py": 40, "tests/tools/test_fabric_rows.py": 35,
         "tests/combos/test_job_combos.py": 35, "tests/ops/test_ops.py": 30,
         "tests/launch/test_operations.py": 30, "tests/manager/test_window_events.py": 30,
         "tests/worker/test_streamed.py": 30, "tests/planning/test_calibration.py": 30,
         "tests/tools/test_fabric.py": 25, "tests/serving/test_compiles.py": 25,
         "tests/worker/test_disk_security.py": 25, "tests/launch/test_pd.py": 20,
         "tests/serving/test_serving.py": 15, "tests/tools/test_online.py": 15}


def pytest_itemcollected(item):
  # ``-n 3 --dist loadgroup`` (README's command): a file's tests stay on one worker, so
  # a module's fixtures (a server, an owner job, a checkpoint) start once. (Marked as each
  # item is collected: xdist reads the groups in its own pytest_collection_modifyitems,
  # which runs before this file's.)
  path = os.path.relpath(str(item.path), str(item.config.rootpath))
  item.add_marker(pytest.mark.xdist_group(_SHARED.get(path, path)))


def pytest_collection_modifyitems(config, items):
  root = str(config.rootpath)
  paths = {id(item): os.path.relpath(str(item.path), root) for item in items}
  items.sort(key=lambda item: -_SLOW.get(paths[id(item)], 0))  # stable: a file keeps its order
  # This hook runs after xdist's, which has put each item's group into its node id: a
  # pytest or xdist that drops it would split every file across the workers, silently.
  ungrouped = [item.nodeid for item in items if "@" not in item.nodeid]
  if getattr(config.option, "loadgroup", False) and ungrouped:  # (set on xdist workers)
    raise pytest.UsageError(f"--dist loadgroup did not group {ungrouped[0]} (and "
                            f"{len(ungrouped) - 1} more): this pytest-xdist cannot add groups "
                            "to this pytest's node ids; install pyproject.toml's test range.")


# A worker that crashes (a segfault in a C extension) is not replaced (pyproject's addopts:
# --max-worker-restart=0; a replaced worker hangs pytest-xdist 3.8's loadgroup scheduler
# for good) and its test fails. Each worker writes its fault handler's dump to a file the
# session shares, and the failure's report carries the crashing thread's Python stack, so
# that the summary at the end of a truncated log says where it died.
if "JAXKV_TEST_FAULTS_DIR" not in os.environ:  # the controller's (the workers inherit it)
  os.environ["JAXKV_TEST_FAULTS_DIR"] = tempfile.mkdtemp(prefix="jaxkv-test-faults-")
  atexit.register(shutil.rmtree, os.environ["JAXKV_TEST_FAULTS_DIR"], ignore_errors=True)
_FAULTS_DIR = os.environ["JAXKV_TEST_FAULTS_DIR"]
_RUNNER_FRAMES = ("/_pytest/", "/pluggy/", "/xdist/", "/execnet/", '"<string>"')


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which it replaces
def pytest_configure(config):
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker:
    import faulthandler
    config._jaxkv_faults = open(os.path.join(_FAULTS_DIR, f"{worker}.txt"), "w")  # pylint: disable=protected-access
    faulthandler.enable(file=config._jaxkv_faults, all_threads=True)  # pylint: disable=protected-access


def pytest_handlecrashitem(crashitem, report, sched):
  """(xdist, on the controller) Adds the crashed worker's fault dump to its test's report."""
  del crashitem, sched
  path = os.path.join(_FAULTS_DIR, f"{report.node.gateway.id}.txt")
  try:
    with open(path) as f:
      dump = f.read()
  except OSError:
    return
  current = dump.find("Current thread")
  stack = dump[current:].split("\n\n")[0] if current >= 0 else dump[-4000:]
  lines = [l for l in stack.splitlines() if not any(r in l for r in _RUNNER_FRAMES)]
  report.longrepr = "\n".join([str(report.longrepr), *lines])


@pytest.fixture(scope="session")
def mesh():
  import jaxkv
  # A missing precondition is an error: these tests need the 8 virtual devices.
  if len(jax.devices()) < 8:
    pytest.fail(f"the tests need 8 devices and JAX has {len(jax.devices())}: XLA_FLAGS was "
                "set after JAX started (conftest.py sets it before importing jax)")
  return jaxkv.make_mesh(data=4, model=2)


@pytest.fixture(scope="module")
def s3():
  """An S3-compatible server on loopback (moto), for a module's stores."""
  from jaxkv.tools.bench.s3server import LocalS3
  with LocalS3() as server:
    yield server


@pytest.fixture(scope="module")
def fresh(mesh):
  """An engine that recomputes every prompt: what cached answers must equal."""
  import helpers
  return helpers.make_engine(mesh, prefix_reuse=False)


@pytest.fixture(autouse=True)
def _insecure_warnings_afresh():
  """Each test sees the INSECURE warnings its own setups print (they print once per
  process, and the suite is one process)."""
  from jaxkv import security
  security._warned.clear()  # pylint: disable=protected-access


@pytest.fixture(scope="session")
def device_check_dry_run(tmp_path_factory):
  """``bash launch/device_check.sh --dry_run`` as CI runs it, once a session: (exit status,
  its output, its JSON or None, its OUT directory, where ``steps/NAME.json`` is what each
  step wrote). Its whole session is killed if it runs over 900 s."""
  import json
  import subprocess
  import sys
  import helpers
  out = tmp_path_factory.mktemp("device")
  env = helpers.child_env()  # launchers set their own
  # Its temporary files in a directory of its own: a test can see what a suite left there.
  (out / "tmp").mkdir()
  env.update(OUT=str(out), PYTHON=sys.executable, TMPDIR=str(out / "tmp"))
  proc = subprocess.Popen(["bash", "launch/device_check.sh", "--dry_run"], cwd=helpers.ROOT,
                          env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          start_new_session=True)
  try:
    stdout, _ = proc.communicate(timeout=900)
  except subprocess.TimeoutExpired:
    helpers.kill_session(proc.pid)
    stdout, _ = proc.communicate()
    pytest.fail(f"the dry run ran over 900 s; its output ends:\n{stdout[-3000:]}")
  path = out / "device_check.json"
  return proc.returncode, stdout, json.loads(path.read_text()) if path.exists() else None, out


_REMOTE_OWNERS = {}  # the session's owner jobs and the last test that uses them


@pytest.fixture(scope="session")
def remote_owners(request):
  """One owner job (``helpers.Owner``) for tests/worker/test_remote*.py: honest ("none"), keyed
  and lying servers (``helpers.REMOTE_FAULTS``) over the blocks of one prefix; tests only
  read from it. When a test of the session asks for ``spare_owner``, that one starts as
  soon as this one is up (from the compilation cache it filled), while tests run. Both
  end after the session's last test that uses them."""
  import helpers
  owner = helpers.Owner(("none", "keyed", *helpers.REMOTE_FAULTS))
  owner.spare = None
  _REMOTE_OWNERS["jobs"] = [owner]
  try:
    assert owner.address
    users = [item for item in request.session.items if "remote_owners" in item.fixturenames]
    _REMOTE_OWNERS["last"] = users[-1] if users else None
    if any("spare_owner" in item.fixturenames for item in users):
      owner.spare = helpers.Owner(("none",))
      _REMOTE_OWNERS["jobs"].append(owner.spare)
    yield owner
  finally:
    _close_remote_owners()


def _close_remote_owners():
  for job in _REMOTE_OWNERS.pop("jobs", []):
    job.close()
  _REMOTE_OWNERS.pop("last", None)


def pytest_runtest_teardown(item, nextitem):
  del nextitem
  if _REMOTE_OWNERS.get("last") is item:  # no test after it needs the owner jobs
    _close_remote_owners()


@pytest.fixture
def spare_owner(remote_owners):
  """Another honest owner job (started beside ``remote_owners``), for a test that kills
  its peer: once only."""
  assert remote_owners.spare is not None and remote_owners.spare.proc.poll() is None, (
      "the spare owner job was used up already")
  return remote_owners.spare

