"""Operating the launch scripts: every refusal is one line and exit 2 before any work, a bug
keeps its traceback, metrics parse with prometheus_client (file and live endpoint), logs
and progress show, --restore with nothing to restore starts cold.

The refusals run in one driver process that calls each script's ``main`` in process the way
``_common.run`` does (``_common.guarded(main)(_common.parse_flags(argv))``), its flags and
modules defined afresh for every case; one refusal of each script also runs as its own
process, as a user runs it."""

import dataclasses
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import helpers

SMALL = ["--config.workload.chat.users=3", "--config.workload.chat.turns=2",
         "--config.workload.chat.system_prompt_tokens=40",
         "--config.workload.chat.user_tokens=(8, 30)", "--config.workload.chat.max_new_tokens=5",
         *helpers.SERVE_SHAPES]


def clean_env():
  """As a user's shell has it: no JAX_PLATFORMS and no device count inherited from the tests."""
  return helpers.child_env(drop=("JAX_PLATFORMS",))


BROKEN_PLUGIN = "jaxkv_test_broken"


def cloned_env(tmp):
  """``clean_env`` as some users' machines have it, made here: JAX imported from under a
  directory named ``jaxkv`` (a virtual environment in a clone, ``~/jaxkv/.venv``) and a JAX
  plugin that fails to start (``jax_plugins.BROKEN_PLUGIN``). From there JAX's backend probe
  logs ``Unable to initialize backend 'tpu'`` at INFO (where no libtpu is), which a filter
  that took any path with ``/jaxkv/`` in it for jaxkv's own let through ahead of the refusal
  (issue #50: two lines on another machine, one here), and the plugin's error and traceback
  (an ERROR, shown whatever the filter) came before it too."""
  import jax
  site = tmp / "jaxkv" / "site"
  site.parent.mkdir()
  site.symlink_to(os.path.dirname(os.path.dirname(os.path.realpath(jax.__file__))))
  plugins = tmp / "plugins" / "jax_plugins"  # a namespace package beside JAX's own
  plugins.mkdir(parents=True)
  (plugins / f"{BROKEN_PLUGIN}.py").write_text(
      "def initialize():\n  raise RuntimeError('this plugin cannot start')\n")
  env = clean_env()
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), str(plugins.parent),
                                                    env.get("PYTHONPATH")]))
  where = ("import importlib.util as u; "
           f"print(u.find_spec('jax').origin, u.find_spec('jax_plugins.{BROKEN_PLUGIN}').origin)")
  _, found, _ = helpers.finish_process(
      helpers.start_process([sys.executable, "-c", where], env=env), 60, "finding JAX")
  # the conditions hold: JAX is found under jaxkv/, the broken plugin where JAX looks
  assert f"{os.sep}jaxkv{os.sep}site{os.sep}jax{os.sep}" in found, found
  assert str(plugins) in found, found
  return env


def launch(script, *args, timeout=600):
  """``launch/SCRIPT ARGS`` as a user's shell runs it (its process group is killed if it
  runs over ``timeout``)."""
  argv = [sys.executable, f"launch/{script}", *args]
  code, out, err = helpers.finish_process(helpers.start_process(argv, env=clean_env()),
                                          timeout, script)
  return subprocess.CompletedProcess(argv, code, out, err)


@dataclasses.dataclass(frozen=True)
class Refusal:
  """A command line a script must refuse: ``args`` may name the files ``refusal_files``
  makes ({a_file}, {a_dir}, {short_key}, {tmp}); ``needle`` is in its one line. ``real``:
  also run as its own process. ``after_work``: refused once the engine is being built
  (its disk tier's directory is made then), so compiling before it is allowed."""
  script: str
  args: tuple
  needle: str
  real: bool = False
  after_work: bool = False


REFUSALS = [
    Refusal("serve.py", ("--config=configs/llama3_8b_h200.py",), "platform 'gpu'", real=True),
    Refusal("serve.py", ("--config=configs/tpu_v5e_8.py",), "platform 'tpu'", real=True),
    Refusal("serve.py", ("--json_out={a_dir}",), "is a directory"),
    Refusal("serve.py", ("--metrics_out={a_dir}",), "is a directory"),
    Refusal("serve.py", ("--json_out={a_file}/x.json",), "not a writable directory"),
    Refusal("serve.py", ("--checkpoint_dir={a_file}",), "is a file"),
    Refusal("serve.py", ("--device_pages=-5",), "device_pages"),
    Refusal("serve.py", ("--cache=lru",), "cache"),
    Refusal("serve.py", ("--cache=jaxkv", "--policy=nocache"), "--policy=nocache disagree"),
    Refusal("serve.py", ("--disk_pages=0",), "disk_pages"),
    # A shortcut is an alias of one --config field: both at different values are refused.
    Refusal("serve.py", ("--device_pages=40", "--config.cache.pages_per_shard=32"),
            "(--device_pages is an alias of --config.cache.pages_per_shard)"),
    Refusal("serve.py", ("--disk_dir={tmp}/d", "--config.tiers.disk_kvstore={tmp}/e"),
            "(--disk_dir is an alias of --config.tiers.disk_kvstore)"),
    Refusal("serve.py", ("--metrics_port=0",), "metrics_port"),
    Refusal("serve.py", ("--restore",), "--restore needs --checkpoint_dir"),
    Refusal("serve.py", ("--checkpoint_dir={tmp}/none", "--restore", "--require_restore"),
            "no finished checkpoint"),
    Refusal("serve.py", ("--config.cache.page_size=0",), "page_size=0"),
    Refusal("serve.py", ("--config=configs/nope.py",), "nope.py"),
    Refusal("serve.py", ("--deployment_key_file={tmp}/no_key",), "cannot be read"),
    Refusal("serve.py", ("--deployment_key_file={a_file}",), "chmod 600"),
    Refusal("serve.py", ("--deployment_key_file={short_key}",),
            "has 2 bytes; it needs at least 32"),
    # With --nocompare (formerly tests/launch/test_configs.py's bad flags).
    Refusal("serve.py", ("--nocompare", "--config=configs/nope.py"), "nope.py"),
    Refusal("serve.py", ("--nocompare", "--device_pages=-4"), "device_pages"),
    Refusal("serve.py", ("--nocompare", "--disk_dir=/proc/jaxkv-nope",
                         "--config.workload.chat.turns=1"), "cannot be created", after_work=True),
    Refusal("serve.py", ("--nocompare", "--config.cache.page_size=0"), "page_size=0"),
    Refusal("server.py", ("--block_address=0.0.0.0:0",), "--allow_insecure"),
    Refusal("server.py", ("--block_address=nowhere",), "must be HOST:PORT", real=True),
    Refusal("plan.py", ("--kv_bytes=1e9", "--tokens=100", "--link_gb_per_s=10",
                        "--prefill_ms_per_1k=-40"), "prefill_ms_per_1k"),
    Refusal("plan.py", ("--config=configs/cpu_tiny.py", "--tokens=100"), "no hardware section",
            real=True),
    Refusal("plan.py", ("--kv_bytes=1e9", "--link_gb_per_s=10", "--prefill_ms_per_1k=40"),
            "--tokens"),
    Refusal("generate.py", ("--prompt=hi",), "model_dir"),
    Refusal("generate.py", ("--model_dir={a_dir}", "--prompt=hi"), "config.json is missing"),
    Refusal("generate.py", ("--model_dir={a_dir}", "--prompt=hi", "--platform=gpu"),
            "platform 'gpu'", real=True),
    Refusal("bench.py", ("--suite=nope",), "suite", real=True),
    Refusal("bench.py", ("--json_out={a_dir}",), "is a directory"),
]


def refusal_files(tmp):
  """The files the refusals name, made in ``tmp``: {name: path}."""
  a_file = tmp / "a_file"
  a_file.write_text("x")
  short_key = tmp / "short_key"
  short_key.write_text("abcd\n")
  short_key.chmod(0o600)
  a_dir = tmp / "a_dir"
  a_dir.mkdir()
  return {"a_file": a_file, "short_key": short_key, "a_dir": a_dir, "tmp": tmp}


# Runs each case as ``_common.run`` runs a script's main, in this one process: the script's
# modules imported afresh with sys.argv set to the case's (config_flags reads it when its
# flags are defined), every flag not absl's own removed first. Each case's stdout and stderr
# are its file descriptors' (what a process of its own would print), its exit status that
# of its SystemExit (1 and the traceback for any other exception, as Python gives); JAX's
# compile events during the case are recorded.
DRIVER = r"""
import importlib, json, os, sys, tempfile, traceback
sys.path.insert(0, "launch")
import jax
from absl import flags, logging
import _common

compiles = []
def on_event(name, *args, **kwargs):
  if "compil" in name:
    compiles.append(name)
jax.monitoring.register_event_listener(on_event)
jax.monitoring.register_event_duration_secs_listener(on_event)
logging.use_absl_handler()  # as app.run has it
SCRIPTS = ("serve", "server", "plan", "generate", "bench", "_flags")
FLAGS = flags.FLAGS
absl_flags = set(FLAGS)
cases_path, results_path = sys.argv[1:3]
results = []
for script, args in json.load(open(cases_path)):
  argv = [f"launch/{script}", *args]
  FLAGS.unparse_flags()
  for name in set(FLAGS) - absl_flags:
    delattr(FLAGS, name)
  for name in SCRIPTS:
    sys.modules.pop(name, None)
  security = sys.modules.get("jaxkv.security")
  if security is not None:
    security._warned.clear()  # its INSECURE warnings print once per process
  sys.argv = argv
  sys.stdout.flush()
  sys.stderr.flush()
  saved = os.dup(1), os.dup(2)
  with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
    os.dup2(out.fileno(), 1)
    os.dup2(err.fileno(), 2)
    seen = len(compiles)
    try:
      main = importlib.import_module(script[:-3]).main
      _common.guarded(main)(_common.parse_flags(argv))
      code = 0
    except SystemExit as e:
      code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
      traceback.print_exc()
      code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved[0], 1)
    os.dup2(saved[1], 2)
    for fd in saved:
      os.close(fd)
    out.seek(0)
    err.seek(0)
    results.append({"code": code, "stdout": out.read().decode(errors="replace"),
                    "stderr": err.read().decode(errors="replace"),
                    "compiles": compiles[seen:]})
with open(results_path, "w") as f:
  json.dump(results, f)
"""


def tree(root):
  """Every path under ``root`` with its kind and size: what was written there."""
  found = []
  for where, dirs, files in os.walk(root):
    for name in dirs + files:
      path = os.path.join(where, name)
      found.append((os.path.relpath(path, root), os.path.isdir(path),
                    os.lstat(path).st_size))
  return sorted(found)


@pytest.fixture(scope="module")
def refused(tmp_path_factory):
  """Every refusal run in the driver, and the real ones each as its own process, all at
  once: (driver results, {case: (exit status, stdout, stderr)}, the files before, after)."""
  tmp = tmp_path_factory.mktemp("refusals")
  paths = refusal_files(tmp)
  before = tree(tmp)
  cases = [(r.script, [a.format(**paths) for a in r.args]) for r in REFUSALS]
  work = tmp_path_factory.mktemp("driver")
  (work / "cases.json").write_text(json.dumps(cases))
  env = helpers.child_env(device_count=8, JAX_PLATFORMS="cpu")  # as cpu_tiny starts JAX
  driver = helpers.start_process([sys.executable, "-c", DRIVER, str(work / "cases.json"),
                                  str(work / "results.json")], env=env)
  user_env = cloned_env(tmp_path_factory.mktemp("clone"))
  real = {}
  try:
    for i, (r, (script, args)) in enumerate(zip(REFUSALS, cases)):
      if r.real:
        real[i] = helpers.start_process([sys.executable, f"launch/{script}", *args],
                                        env=user_env)
    done = {i: helpers.finish_process(proc, 300, cases[i]) for i, proc in real.items()}
    code, _, err = helpers.finish_process(driver, 600, "the refusal driver")
  finally:  # none is left running, whatever failed
    for proc in [driver, *real.values()]:
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
  assert code == 0, err[-3000:]
  results = json.loads((work / "results.json").read_text())
  assert len(results) == len(REFUSALS)
  return results, done, before, tree(tmp)


def check_refusal(case, code, stderr):
  lines = [l for l in stderr.splitlines() if l.strip()]
  if case.after_work:  # the build had begun: its INFO lines (a capacity the builder
    # defaulted, say) may come before the error
    lines = [l for l in lines if not re.match(r"I\d{4} ", l)]
  where = f"{case.script} {' '.join(case.args)}: {stderr[-1500:]}"
  assert code == 2, where
  assert "Traceback" not in stderr and len(lines) == 1, where
  assert lines[0].startswith("error: ") and case.needle in lines[0], where


@pytest.mark.parametrize("i", range(len(REFUSALS)),
                         ids=[f"{r.script} {' '.join(r.args)}" for r in REFUSALS])
def test_every_refusal_is_one_line_exit_2_before_any_work(refused, i):
  results, real, _, _ = refused
  case, got = REFUSALS[i], results[i]
  check_refusal(case, got["code"], got["stderr"])
  if not case.after_work:  # nothing was built: JAX compiled nothing
    assert got["compiles"] == [], got["compiles"][:5]
  if case.real:
    code, _, err = real[i]
    check_refusal(case, code, err)
    if "platform '" in case.needle:  # what JAX said when its backends started is in the line
      assert f"JAX said: Jax plugin configuration error: Exception when calling jax_plugins." \
             f"{BROKEN_PLUGIN}.initialize()" in err, err


def test_refusals_write_nothing(refused):
  _, _, before, after = refused
  assert after == before  # nothing written, no .tmp left


# Starts JAX's backend as a launch script does, then asks the log filter of launch scripts
# whether an INFO line from JAX's file, jaxkv's and launch/'s would show.
GOES_ON = """
import json, logging, sys
sys.path.insert(0, "launch")
import _common
_common.check_platform({"platform": "cpu"})
import jax._src.xla_bridge, jaxkv.config
files = [jax._src.xla_bridge.__file__, jaxkv.config.__file__, _common.__file__]
shown = [_common._jaxkv_info_only(logging.LogRecord("x", logging.INFO, f, 1, "m", None, None))
         for f in files]
print(json.dumps([files[0], shown]))
"""


def test_jaxs_start_messages_show_when_the_run_goes_on_and_its_info_lines_never(tmp_path):
  """``check_platform`` holds JAX's backend messages only to fold them into a refusal: a
  run on the platform it asked for logs them as JAX would have (the plugin's error and its
  traceback). Launch scripts show INFO lines from jaxkv and launch/ only, decided by those
  directories: JAX's, imported from under a directory named jaxkv, stay hidden."""
  code, out, err = helpers.finish_process(
      helpers.start_process([sys.executable, "-c", GOES_ON], env=cloned_env(tmp_path)), 120,
      "check_platform")
  assert code == 0, err[-3000:]
  jax_file, shown = json.loads(out.strip().splitlines()[-1])
  assert f"{os.sep}jaxkv{os.sep}site{os.sep}" in jax_file and shown == [False, True, True], out
  assert f"Exception when calling jax_plugins.{BROKEN_PLUGIN}.initialize()" in err, err
  assert "RuntimeError: this plugin cannot start" in err, err


BUGGY = """
import sys
sys.path.insert(0, "launch")
import _common
def main(argv):
  raise ValueError("an internal invariant broke")
_common.run(main)
"""


def test_an_internal_error_keeps_its_traceback_and_exits_1():
  code, _, err = helpers.finish_process(
      helpers.start_process([sys.executable, "-c", BUGGY], env=clean_env()), 120, "BUGGY")
  assert code == 1
  assert "Traceback" in err and "an internal invariant broke" in err
  assert "error: an internal" not in err


def families(text):
  return {f.name: f for f in text_string_to_metric_families(text)}


def check_families(fams, *, engines):
  for name in ("jaxkv_ttft_seconds", "jaxkv_time_per_output_token_seconds",
               "jaxkv_e2e_latency_seconds"):
    assert fams[name].type == "histogram", name
  for name in ("jaxkv_block_hits", "jaxkv_requests", "jaxkv_blocks_fetched",
               "jaxkv_blocks_recomputed", "jaxkv_blocks_split", "jaxkv_bytes_moved",
               "jaxkv_verify_failures", "jaxkv_evictions"):
    assert fams[name].type == "counter", name
  for name in ("jaxkv_cached_blocks", "jaxkv_capacity_blocks", "jaxkv_waiting_requests",
               "jaxkv_running_requests"):
    assert fams[name].type == "gauge", name
  assert {s.labels["policy"] for s in fams["jaxkv_requests"].samples} == set(engines)


def value(fams, family, sample, **labels):
  return next(s.value for s in fams[family].samples
              if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()))


# SMALL's sequences (at most 40 + 2 x 30 + 2 x 5 tokens: 7 pages) fit in 8 pages: one table
# width to compile, not two.
EIGHT_PAGES = [*SMALL, "--config.cache.max_pages_per_seq=8"]


def test_metrics_file_logs_progress_and_a_cold_start_without_checkpoint(tmp_path):
  prom, out, ckpt = tmp_path / "m.prom", tmp_path / "s.json", tmp_path / "ckpt"
  proc = launch("serve.py", *EIGHT_PAGES, f"--metrics_out={prom}", f"--json_out={out}",
                   f"--checkpoint_dir={ckpt}", "--restore", f"--disk_dir={tmp_path / 'disk'}",
                   "--config.tiers.disk_pages=100",
                   '--config.name=quote"and\\backslash')  # label values are escaped
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  fams = families(prom.read_text())
  check_families(fams, engines=("jaxkv", "nocache"))
  stats = r["stats"]
  jaxkv = dict(policy="jaxkv", config='quote"and\\backslash')
  assert value(fams, "jaxkv_requests", "jaxkv_requests_total", **jaxkv) == stats["requests"] == 6
  assert value(fams, "jaxkv_ttft_seconds", "jaxkv_ttft_seconds_count", **jaxkv) == 6
  assert value(fams, "jaxkv_ttft_seconds", "jaxkv_ttft_seconds_sum", **jaxkv) == pytest.approx(
      sum(stats["ttft_s"]))
  assert value(fams, "jaxkv_e2e_latency_seconds", "jaxkv_e2e_latency_seconds_count",
               **jaxkv) == 6
  assert value(fams, "jaxkv_block_hits", "jaxkv_block_hits_total", tier="device",
               **jaxkv) == stats["hits"]["device"] > 0
  # --config.tiers.disk_pages is kept with --disk_dir (it used to be replaced by 4096).
  assert value(fams, "jaxkv_capacity_blocks", "jaxkv_capacity_blocks", tier="disk",
               **jaxkv) == 100
  assert value(fams, "jaxkv_cached_blocks", "jaxkv_cached_blocks", tier="device",
               **jaxkv) == r["tier_occupancy_blocks"][-1]["device"]
  assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
  # Logs: start-up, adopted disk records, compile progress; the missing checkpoint warned.
  err = proc.stderr
  assert "KVCache" in err and "disk tier" in err and "adopted 0 blocks" in err
  assert "compiling prefill and decode steps: 1/" in err
  assert "no finished checkpoint" in err and "starting cold" in err
  assert "saved the cache as step 0" in proc.stdout
  # Started again, it restores what the first run saved.
  proc = launch("serve.py", *EIGHT_PAGES, f"--checkpoint_dir={ckpt}", "--restore",
                   "--require_restore", f"--disk_dir={tmp_path / 'disk'}",
                   "--config.tiers.disk_pages=100", "--nocompare")
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "restored step 0" in proc.stdout


def free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_metrics_are_served_live_during_a_run(tmp_path):
  port = free_port()
  proc = helpers.start_process(
      [sys.executable, "launch/serve.py", *SMALL, "--config.workload.chat.turns=3",
       f"--metrics_port={port}", "--nocompare"], env=clean_env())
  scraped = []
  try:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
      try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
          scraped.append(resp.read().decode())
      except (OSError, http.client.HTTPException):  # not up yet, or cut short by the exit
        pass
      try:  # the next scrape half a second on, or as soon as the run ends
        proc.wait(timeout=0.5)
      except subprocess.TimeoutExpired:
        pass
  finally:
    code, _, err = helpers.finish_process(proc, 300, "serve.py --metrics_port")
  assert code == 0, err[-3000:]
  assert proc.returncode == 0, err[-3000:]
  # Complete answers (one racing the process's exit may come back cut short).
  complete = [t for t in scraped if "jaxkv_running_requests" in t]
  assert complete, f"no complete answer among {len(scraped)} scrapes during the run"
  fams = families(complete[-1])
  check_families(fams, engines=("jaxkv",))
  capacity = value(fams, "jaxkv_capacity_blocks", "jaxkv_capacity_blocks", tier="device",
                   policy="jaxkv")
  assert capacity == 4 * 256  # 4 data shards x pages_per_shard
