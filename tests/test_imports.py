"""What importing a piece of jaxkv costs: the host-only packages (``config``, ``manager``,
``scheduling``) import with JAX and Flax unavailable, each module on its own and first, with
the real ``jaxkv`` package above it (no stub); ``config`` sits below every other module, so
no import circle runs through it; and the package's public names, loaded on first use, are
the objects they name.

The blocked imports run in fresh interpreters: a meta-path finder placed first refuses
``jax``, ``jaxlib`` and ``flax`` (and everything under them) with an ImportError, as a
machine without them would."""

import ast
import importlib
import json
import os
import pathlib
import sys

import jax.numpy as jnp
import pytest
from flax import nnx

import helpers
import jaxkv
from jaxkv import config as config_lib

ROOT = pathlib.Path(helpers.ROOT)
BLOCKED = ("jax", "jaxlib", "flax")

# Imports each named module first: jaxkv's modules (and its old-path finder) are dropped
# before each, so each import runs the package and everything it needs afresh, as in a new
# interpreter. Prints {name: the error it raised} and the blocked packages imported anyway
# (none while the finder works).
BLOCKING = r"""
import importlib, importlib.abc, json, sys
BLOCKED = {blocked!r}

class Refuse(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in BLOCKED:
      raise ImportError(f"{{name}} is blocked in this test", name=name)

sys.meta_path.insert(0, Refuse())
failed = {{}}
for name in {names!r}:
  for loaded in [m for m in sys.modules if m.split(".")[0] == "jaxkv"]:
    del sys.modules[loaded]
  sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("jaxkv")]
  try:
    importlib.import_module(name)
  except Exception as e:
    failed[name] = f"{{type(e).__name__}}: {{e}}"
{then}
print(json.dumps([failed, sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)]))
"""


def host_only_modules():
  """``jaxkv.config`` and every module of the host-only packages, from their files (a module
  added there later is checked too)."""
  names = ["jaxkv.config"]
  for package in ("manager", "scheduling"):
    for path in sorted((ROOT / "jaxkv" / package).rglob("*.py")):
      parts = list(path.relative_to(ROOT).with_suffix("").parts)
      names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
  return names


def run_blocked(names, then=""):
  """A fresh interpreter imports each of ``names`` first with JAX and Flax refused, then runs
  ``then``: ({name: error} of those that failed, the blocked packages loaded anyway)."""
  code = BLOCKING.format(blocked=BLOCKED, names=list(names), then=then)
  proc = helpers.start_process([sys.executable, "-c", code],
                               env={**os.environ, "JAX_PLATFORMS": "cpu"})
  status, out, err = helpers.finish_process(proc, 120, "the blocked imports")
  assert status == 0, err[-3000:]
  return json.loads(out.strip().splitlines()[-1])


def test_the_host_only_modules_each_import_first_with_jax_blocked():
  names = host_only_modules()
  assert {"jaxkv.config", "jaxkv.manager", "jaxkv.scheduling", "jaxkv.manager.index",
          "jaxkv.scheduling.step"} <= set(names), names
  failed, loaded = run_blocked(names)
  assert failed == {} and loaded == [], (failed, loaded)


def test_the_blocker_blocks_and_the_package_loads_its_names_on_first_use():
  """The finder does refuse JAX (a module that needs it fails with its ImportError), and
  ``import jaxkv`` then loads only what is used: the configs and errors, not the engine."""
  then = """
import jaxkv
assert jaxkv.CacheConfig is importlib.import_module("jaxkv.config").CacheConfig
assert issubclass(jaxkv.CapacityError, jaxkv.InputError)
try:
  jaxkv.Engine
except ImportError as e:
  assert e.name.split(".")[0] in BLOCKED, e
else:
  raise AssertionError("jaxkv.Engine was imported with JAX blocked")
"""
  failed, loaded = run_blocked(["jaxkv"], then)
  assert failed == {} and loaded == [], (failed, loaded)


def _is_module(name: str) -> bool:
  path = ROOT.joinpath(*name.split("."))
  return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imported(path) -> set:
  """Every module a file imports, at top level or inside a function (``from M import N``
  counts M, and N where N is a module of this repository)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module:
      out.add(node.module)
      out.update(f"{node.module}.{a.name}" for a in node.names
                 if _is_module(f"{node.module}.{a.name}"))
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
  return out


def test_config_is_below_every_other_module():
  """``jaxkv.config`` imports nothing of jaxkv but ``errors`` (which imports nothing of
  jaxkv), anywhere in it, function bodies included: no circle can pass through it (there was
  config -> nnx -> worker.pages -> ops.select -> config), and no JAX or Flax."""
  config = {m for m in _imported(ROOT / "jaxkv" / "config.py")}
  assert {m for m in config if m.split(".")[0] == "jaxkv"} == {"jaxkv.errors"}, config
  assert not {m for m in config if m.split(".")[0] in BLOCKED}, config
  errors = _imported(ROOT / "jaxkv" / "errors.py")
  assert not {m for m in errors if m.split(".")[0] == "jaxkv"}, errors


def test_a_pools_dtype_is_the_one_jax_names():
  mc = helpers.tiny_model_config()
  for name in config_lib.SUPPORTED_DTYPES:
    cache = helpers.cache_config_for(mc, dtype=name)
    assert cache.jnp_dtype == jnp.dtype(name), name
    assert cache.page_bytes == (2 * cache.num_layers * cache.num_kv_heads * cache.page_size
                                * cache.head_dim * jnp.dtype(name).itemsize)


class TwoShapes(nnx.Module):
  """An NNX model with no config attribute: its shapes are its PagedKV layers'."""

  def __init__(self, head_dims):
    self.layers = nnx.List([jaxkv.nnx.PagedKV(num_kv_heads=2, head_dim=d) for d in head_dims])


def test_an_nnx_models_shapes_are_read_from_its_paged_layers():
  """``CacheConfig.for_model`` of a model without a config (config no longer imports
  ``jaxkv.nnx``: ``jaxkv.nnx.layer_shapes`` reads the layers)."""
  cache = jaxkv.CacheConfig.for_model(TwoShapes([8, 8, 8]), page_size=4, pages_per_shard=8,
                                      max_pages_per_seq=4)
  assert (cache.num_layers, cache.num_kv_heads, cache.head_dim) == (3, 2, 8)
  assert cache.model_name == "TwoShapes"
  with pytest.raises(jaxkv.InputError, match=r"different \(num_kv_heads, head_dim\): "
                                             r"\[\(2, 8\), \(2, 16\)\]"):
    jaxkv.CacheConfig.for_model(TwoShapes([8, 16]))
  for nothing in (TwoShapes([]), object()):
    with pytest.raises(jaxkv.InputError, match="has no jaxkv.nnx.PagedKV layers"):
      jaxkv.CacheConfig.for_model(nothing)


def test_every_public_name_resolves_and_an_old_path_keeps_the_plan_function():
  for name in jaxkv.__all__:
    assert getattr(jaxkv, name) is not None, name
  assert set(jaxkv.__all__) <= set(dir(jaxkv))
  importlib.import_module("jaxkv.plan")  # the old path of jaxkv.planning.plan
  plan_module = importlib.import_module("jaxkv.planning.plan")
  assert jaxkv.plan is plan_module.plan
  assert jaxkv.checkpoint is jaxkv.worker.checkpoint
  with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
    jaxkv.no_such_name  # noqa: B018
