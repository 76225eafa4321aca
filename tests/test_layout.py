"""The layout's rules: subpackages by role, imports flowing one way, the old module paths.

Roles, bottom up (``../shared/DESIGN.md`` "Modules"): the shared basics at the top of the
package (errors, config, security, stats, distributed, buckets, nnx) with ``models`` and
``ops``; ``manager`` (the prefix index, pins, allocation: host only, no JAX);
``scheduling`` (admission, the scheduler, the StepPlan/StepResult types: host only);
``planning`` (costs, the jitted plan, the planner, calibration); ``worker`` (pools, runner,
transfers, journal, streaming, checkpoints, the tiers); ``cache`` (``KVCache``, the facade
over the manager and the worker); ``serving`` (engine, service); ``entrypoints`` (the HTTP
server: its protocol, limits, the tokenizer and the chat-template sandbox; no layer below
imports the tokenizer, which ``jaxkv`` re-exports); ``tools`` (the harness). A layer
imports only the layers below it, with the exceptions named in ``ALLOWED`` and why.
"""

import ast
import importlib
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import helpers
from jaxkv import _moved

ROOT = pathlib.Path(helpers.ROOT)
BASE = ("jaxkv.errors", "jaxkv.config", "jaxkv.security", "jaxkv.stats", "jaxkv.progress",
        "jaxkv.distributed", "jaxkv.buckets", "jaxkv.identity", "jaxkv.metrics", "jaxkv.nnx",
        "jaxkv.compiles", "jaxkv.pids",
        "jaxkv.models", "jaxkv.ops")
# each role and the roles it may import (besides the basics and itself)
BELOW = {
    "jaxkv.manager": (),
    "jaxkv.scheduling": ("jaxkv.manager",),
    "jaxkv.planning": ("jaxkv.manager",),
    "jaxkv.worker": ("jaxkv.manager",),
    "jaxkv.cache": ("jaxkv.manager", "jaxkv.worker"),
    "jaxkv.serving": ("jaxkv.manager", "jaxkv.scheduling", "jaxkv.planning", "jaxkv.worker",
                      "jaxkv.cache"),
    "jaxkv.entrypoints": ("jaxkv.serving",),
}
# the exceptions, each a value type crossing one way or a measurement that needs the pools
ALLOWED = {
    # the step module's value types (Block, Fetch, FetchReport, Failure, the orders) cross
    # one way: the manager names and resolves blocks with them, the planner reads reports,
    # the worker executes plans and its tiers serve fetches
    ("jaxkv.manager", "jaxkv.scheduling.step"), ("jaxkv.worker", "jaxkv.scheduling.step"),
    ("jaxkv.planning", "jaxkv.scheduling.step"), ("jaxkv.cache", "jaxkv.scheduling.step"),
    # calibration lands a measured copy's bytes (the tiers' Landing)
    ("jaxkv.planning.calibration", "jaxkv.worker.tiers.base"),
    # calibration measures prefills and copies on real pools
    ("jaxkv.planning.calibration", "jaxkv.worker.pages"),
    # the public layer's page reads and writes are the pool's ops
    ("jaxkv.nnx", "jaxkv.worker.pages"),
}


def _modules():
  for path in sorted((ROOT / "jaxkv").rglob("*.py")):
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts.pop()
    yield ".".join(parts), path, ast.parse(path.read_text())


def _imports(tree) -> set[str]:
  """Every jaxkv name a module imports at run time (``if TYPE_CHECKING:`` blocks left out)."""
  typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                 and ast.unparse(node.test).endswith("TYPE_CHECKING") for n in ast.walk(node)}
  out = set()
  for node in ast.walk(tree):
    if id(node) in typing_only:
      continue
    if isinstance(node, ast.ImportFrom) and node.module:
      out.update(f"{node.module}.{a.name}" for a in node.names)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
  return {m for m in out if m.startswith("jaxkv.")}


def _under(name: str, prefix: str) -> bool:
  return name == prefix or name.startswith(prefix + ".")


def _role(name: str) -> str | None:
  return next((r for r in BELOW if _under(name, r)), None)


def test_each_role_imports_only_the_roles_below_it():
  bad = []
  for name, _, tree in _modules():
    if name == "jaxkv" or _under(name, "jaxkv.tools"):
      continue  # the package's re-exports and the harness may import anything
    role = _role(name)
    for imported in _imports(tree):
      other = _role(imported)
      if (imported.startswith(BASE + ("jaxkv._moved",)) and not _under(imported, "jaxkv.tools")
          or other is not None and other == role
          or other in BELOW.get(role, ())
          or any(_under(name, a) and _under(imported, b) for a, b in ALLOWED)):
        continue
      bad.append(f"{name} imports {imported}")
  assert not bad, "\n".join(sorted(bad))


def test_the_http_layers_parts_import_one_way():
  """chat_template -> tokenizer -> server, and protocol -> server: the sandbox knows no
  tokenizer, the wire format no server."""
  trees = {name: tree for name, _, tree in _modules()}
  http = "jaxkv.entrypoints.openai"
  for name, above in ((f"{http}.chat_template", ("tokenizer", "protocol", "server")),
                      (f"{http}.tokenizer", ("protocol", "server")),
                      (f"{http}.protocol", ("tokenizer", "chat_template", "server"))):
    bad = sorted(m for m in _imports(trees[name])
                 if any(_under(m, f"{http}.{a}") for a in above))
    assert not bad, f"{name} imports {bad}"


def test_nothing_on_the_serving_path_imports_the_harness():
  bad = [f"{name} imports {m}" for name, _, tree in _modules()
         if not name.startswith("jaxkv.tools") for m in _imports(tree)
         if _under(m, "jaxkv.tools")]
  assert not bad, bad


def test_tiers_import_nothing_above_them():
  above = ("jaxkv.serving", "jaxkv.scheduling", "jaxkv.planning", "jaxkv.cache",
           "jaxkv.worker.transfers", "jaxkv.worker.runner", "jaxkv.worker.checkpoint",
           "jaxkv.worker.journal", "jaxkv.worker.streaming")
  for name, _, tree in _modules():
    if name.startswith("jaxkv.worker.tiers"):
      bad = [m for m in _imports(tree) if any(_under(m, a) for a in above)
             and not _under(m, "jaxkv.scheduling.step")]  # the fetch value types
      assert not bad, f"{name} imports {bad}"


def test_the_scheduler_and_admission_order_tier_work_and_never_do_it():
  """They see the cache through its manager: no mover, pool, tier or worker is named in
  their code, and tier work reaches the worker only as a plan's orders. The runner takes
  the plan's types from ``jaxkv.scheduling.step``, not from the scheduler."""
  trees = {name: tree for name, _, tree in _modules()}
  worker = {"mover", "pools", "set_pools", "host", "disk", "journal", "remotes", "cache"}
  for name in ("jaxkv.scheduling.scheduler", "jaxkv.scheduling.admission",
               "jaxkv.scheduling.step", "jaxkv.manager", "jaxkv.manager.index"):
    touched = sorted({(node.attr, node.lineno) for node in ast.walk(trees[name])
                      if isinstance(node, ast.Attribute) and node.attr in worker})
    assert not touched, f"{name} names {touched}"
  # The pools change in one place: ``CacheWorker.update_pools`` (no other module assigns
  # or reads them by their private name, and no module has a ``set_pools``).
  for name, _, tree in _modules():
    names = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and n.attr in ("_pools", "set_pools")]
    if name == "jaxkv.worker.worker":
      assert names, "the worker's pools are not where this rule looks for them"
    else:
      assert not names, f"{name}:{names} changes the pools outside CacheWorker.update_pools"
  runner = _imports(trees["jaxkv.worker.runner"])
  assert not {m for m in runner if _under(m, "jaxkv.scheduling.scheduler")}
  assert "jaxkv.scheduling.step.StepPlan" in runner
  assert "jaxkv.scheduling.step.StepPlan" in _imports(trees["jaxkv.scheduling.scheduler"])
  scheduler = _imports(trees["jaxkv.scheduling.scheduler"])
  assert not {m for m in scheduler
              if any(_under(m, p) for p in ("jaxkv.worker.runner", "jaxkv.worker.streaming",
                                            "jaxkv.serving", "jaxkv.worker.transfers"))}


def test_the_index_changes_only_through_the_manager():
  """Slots are taken, released and published, and copies reported, through
  ``CacheManager``: no module outside ``jaxkv.manager`` names a mutator of a
  ``PrefixIndex`` (called or not), so the index has one writer. Reads stay open."""
  mutators = {"allocate", "allocate_evicting", "publish", "release", "acquire", "unpublish",
              "drop_chain", "evict_all_unreferenced", "bind_fingerprint", "record_hits"}
  seen = 0
  for name, path, tree in _modules():
    for node in ast.walk(tree):
      if not (isinstance(node, ast.Attribute) and node.attr in mutators):
        continue
      on = node.value
      if (isinstance(on, ast.Name) and on.id == "index") or (
          isinstance(on, ast.Attribute) and on.attr == "index"):
        if _under(name, "jaxkv.manager"):
          seen += 1
        else:
          pytest.fail(f"{path.relative_to(ROOT)}:{node.lineno} changes the index directly "
                      f"(.index.{node.attr}): go through the cache's manager")
  assert seen, "the manager's own index writes are not where this rule looks for them"


def test_costs_plan_and_planner_import_one_way():
  # distributed -> costs -> plan -> planner, bottom up: none imports a module after it, nor
  # the layers above the planner (the callers hand it values; it never calls back up).
  chain = ("jaxkv.distributed", "jaxkv.planning.costs", "jaxkv.planning.plan",
           "jaxkv.planning.planner")
  callers = ("jaxkv.tools.capacity", "jaxkv.scheduling", "jaxkv.worker", "jaxkv.serving")
  trees = {name: tree for name, _, tree in _modules()}
  for i, name in enumerate(chain):
    bad = sorted(m for m in _imports(trees[name])
                 if any(_under(m, p) for p in chain[i + 1:] + callers)
                 and not _under(m, "jaxkv.scheduling.step"))
    assert not bad, f"{name} imports {bad}"


def test_nothing_but_the_engine_reads_an_engines_private_state_and_parts_stay_small():
  for name, path, tree in _modules():
    rel = path.relative_to(ROOT).as_posix()
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
          and not node.attr.startswith("__") and isinstance(node.value, ast.Name)
          and node.value.id in ("engine", "eng", "e") and name != "jaxkv.serving.engine"):
        pytest.fail(f"{rel}:{node.lineno} reads {node.value.id}.{node.attr}")
      if name.startswith("jaxkv.tools.bench"):
        continue
      if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        lines = node.end_lineno - node.lineno + 1
        limit = 400 if isinstance(node, ast.ClassDef) else 100
        assert lines <= limit, f"{rel}: {node.name} has {lines} lines (limit {limit})"
  # The engine is a front over its parts: it grows by public surface, never by logic
  # (360: warm-up marks and streamed warm-up joined it).
  assert len((ROOT / "jaxkv" / "serving" / "engine.py").read_text().splitlines()) <= 360


def test_the_flat_package_is_gone_and_every_old_path_names_the_moved_module():
  flat = sorted(p.stem for p in (ROOT / "jaxkv").glob("*.py"))
  assert not set(flat) & {old.split(".")[1] for old in _moved.MOVED}, flat
  for old, new in _moved.MOVED.items():
    assert importlib.import_module(old) is importlib.import_module(new), old
  # a module under a moved package, imported first through its old path
  assert (importlib.import_module("jaxkv.bench.s3server")
          is importlib.import_module("jaxkv.tools.bench.s3server"))
  assert _moved.new_name("jaxkv.tiers.remote") == "jaxkv.worker.tiers.remote"
  assert _moved.new_name("jaxkv.models.hf") is None


def test_old_paths_in_a_fresh_process_load_one_copy_and_keep_the_plan_function():
  """Through an old path first, before the new: one module object, its own spec (not the
  alias's), and ``jaxkv.plan`` still the jitted function after ``import jaxkv.plan``."""
  code = textwrap.dedent("""
      import json, sys
      import jaxkv.checkpoint, jaxkv.bench.storage, jaxkv.plan, jaxkv.tiers.remote
      from jaxkv.capacity import capacity_plan
      from jaxkv.tokenizer import TemplateLimits, Tokenizer, TokenizerError
      import jaxkv
      from jaxkv.entrypoints.openai import tokenizer
      from jaxkv.worker import checkpoint
      from jaxkv.tools.bench import storage
      unique = {id(m): m for n, m in sys.modules.items() if n.startswith("jaxkv")}
      files = [getattr(m, "__file__", None) for m in unique.values()]
      print(json.dumps({
          "same": [jaxkv.checkpoint is checkpoint, jaxkv.bench.storage is storage,
                   jaxkv.tokenizer is tokenizer, jaxkv.tokenizer.TokenizerError is TokenizerError,
                   Tokenizer is jaxkv.Tokenizer, TemplateLimits is tokenizer.TemplateLimits],
          "names": [checkpoint.__spec__.name, storage.__spec__.name, jaxkv.capacity.__name__],
          "plan_is_function": callable(jaxkv.plan) and not hasattr(jaxkv.plan, "__path__"),
          "copies": [f for f in set(files) if files.count(f) > 1]}))
      """)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert out.returncode == 0, out.stderr[-3000:]
  got = json.loads(out.stdout.strip().splitlines()[-1])
  assert got["same"] == [True] * 6, got
  assert got["names"] == ["jaxkv.worker.checkpoint", "jaxkv.tools.bench.storage",
                          "jaxkv.tools.capacity"], got
  assert got["plan_is_function"] and got["copies"] == [], got


def test_tests_mirror_the_package():
  """A test file under tests/<role>/ for each role; none left flat that belongs to one."""
  roles = {p.name for p in (ROOT / "jaxkv").iterdir() if (p / "__init__.py").exists()}
  dirs = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and p.name != "__pycache__"}
  assert roles - {"entrypoints"} <= dirs | {"entrypoints"}, sorted(roles - dirs)
  # launch/ mirrors the scripts; combos/ holds the tests where features of several roles meet
  assert dirs - roles <= {"launch", "combos"}, sorted(dirs - roles)
  for d in dirs:
    assert list((ROOT / "tests" / d).glob("test_*.py")), d
