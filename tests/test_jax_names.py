"""jaxkv is written against the JAX names that 0.11 and 0.12 keep.

The code must run on JAX 0.10.2 here, but a user who moves to a newer JAX should not find
jaxkv on a name that newer release deprecates or removes: ``jax.experimental.shard_map``
(now ``jax.shard_map``), ``with mesh:`` and ``jax.sharding.use_mesh`` (now ``jax.set_mesh``),
``pltpu.HOST``/``pltpu.ANY``/``pltpu.TPUMemorySpace`` (now ``pl.HOST``/``pl.ANY``/
``pltpu.MemorySpace``), ``PmapSharding``, ``device_put_sharded``/``device_put_replicated``,
and the internals under ``jax.core``, ``jax.interpreters`` and ``jax.lib``. The check reads
every source file's syntax tree (comments and strings do not count) and fails naming the
file, the line and the name to use instead.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Dotted names (as written, after resolving ``import x as y`` aliases) and what replaces them.
DEPRECATED = {
    "jax.experimental.shard_map": "jax.shard_map",
    "jax.experimental.pjit": "jax.jit",
    "jax.experimental.maps": "jax.sharding.Mesh and jax.shard_map",
    "jax.experimental.host_callback": "jax.debug.callback or jax.pure_callback",
    "jax.sharding.use_mesh": "jax.set_mesh",
    "jax.sharding.PmapSharding": "jax.sharding.NamedSharding",
    "jax.device_put_sharded": "jax.device_put with a NamedSharding",
    "jax.device_put_replicated": "jax.device_put with a replicated NamedSharding",
    "jax.core": "the public jax API (jax.typeof, jax.ShapeDtypeStruct, jax.extend)",
    "jax.interpreters.pxla": "jax.sharding",
    "jax.interpreters.xla": "the public jax API",
    "jax.lib.xla_bridge": "jax.devices / jax.default_backend",
    "jax.lib.xla_client": "the public jax API",
    "jax.tree_map": "jax.tree.map",
    "jax.experimental.pallas.tpu.HOST": "jax.experimental.pallas.HOST",
    "jax.experimental.pallas.tpu.ANY": "jax.experimental.pallas.ANY",
    "jax.experimental.pallas.tpu.TPUMemorySpace": "jax.experimental.pallas.tpu.MemorySpace",
    "jax.experimental.pallas.tpu.TPUCompilerParams": "jax.experimental.pallas.tpu.CompilerParams",
    "jax.experimental.pallas.gpu.TritonCompilerParams":
        "jax.experimental.pallas.triton.CompilerParams",
}
# Private JAX modules a file may use, each with why no public name serves.
PRIVATE_ALLOWED = {
    "launch/triton_smem.py": "compiles the module Pallas builds for Triton to read its "
                             "shared-memory figure; no public API returns that module",
    "tests/ops/test_ops.py": "runs the TPU kernel under Mosaic's interpreter with race detection, "
                         "which only jax._src exposes",
}


def _dotted(node: ast.AST) -> str | None:
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if isinstance(node, ast.Name):
    parts.append(node.id)
    return ".".join(reversed(parts))
  return None


def problems(source: str, path: str = "<snippet>") -> list[str]:
  """Every deprecated JAX name ``source`` uses, as ``path:line: name (use ...)``."""
  tree = ast.parse(source)
  inner = set()  # attributes that are part of a longer chain (``a.b`` in ``a.b.c``)
  for node in ast.walk(tree):
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
      inner.add(id(node.value))
  aliases: dict[str, str] = {}  # local name -> the dotted module or object it stands for
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
  found = []

  def check(full: str, line: int) -> None:
    for name, instead in DEPRECATED.items():
      if full == name or full.startswith(name + "."):
        found.append(f"{path}:{line}: {name} (use {instead})")
    if full.startswith("jax._src") and path not in PRIVATE_ALLOWED:
      found.append(f"{path}:{line}: {full} is private to JAX (use its public name)")

  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        check(a.name, node.lineno)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      for a in node.names:
        check(f"{node.module}.{a.name}", node.lineno)
    elif isinstance(node, ast.Attribute) and id(node) not in inner:
      name = _dotted(node)
      if name is not None:
        head, _, rest = name.partition(".")
        check(aliases.get(head, head) + ("." + rest if rest else ""), node.lineno)
    elif isinstance(node, ast.With):
      for item in node.items:  # ``with mesh:`` (a Mesh as a context manager)
        expr = item.context_expr
        name = _dotted(expr) if not isinstance(expr, ast.Call) else None
        if name is not None and name.split(".")[-1].lower().endswith("mesh"):
          found.append(f"{path}:{node.lineno}: `with {name}:` (use jax.set_mesh({name}))")
  return found


def sources():
  for folder in ("jaxkv", "launch", "tests", "configs"):
    yield from sorted((ROOT / folder).rglob("*.py"))


def test_no_source_uses_a_jax_name_that_newer_jax_deprecates_or_removes():
  files = list(sources())
  assert len(files) > 80  # the whole package, its launchers, configs and tests
  found = []
  for f in files:
    found += problems(f.read_text(), f.relative_to(ROOT).as_posix())
  assert not found, "\n".join(found)


@pytest.mark.parametrize("snippet, name", [
    ("from jax.experimental.shard_map import shard_map", "jax.experimental.shard_map"),
    ("from jax.experimental import shard_map\nshard_map.shard_map(f)",
     "jax.experimental.shard_map"),
    ("import jax\nwith mesh:\n  pass", "with mesh"),
    ("import jax\nwith self.mesh:\n  pass", "with self.mesh"),
    ("import jax\nwith jax.sharding.use_mesh(m):\n  pass", "jax.sharding.use_mesh"),
    ("from jax.experimental.pallas import tpu as pltpu\nx = pltpu.HOST",
     "jax.experimental.pallas.tpu.HOST"),
    ("from jax.experimental.pallas import tpu as pltpu\nx = pltpu.TPUMemorySpace.ANY",
     "jax.experimental.pallas.tpu.TPUMemorySpace"),
    ("import jax\ns = jax.sharding.PmapSharding", "jax.sharding.PmapSharding"),
    ("import jax\njax.device_put_sharded(xs, ds)", "jax.device_put_sharded"),
    ("import jax\njax.device_put_replicated(x, ds)", "jax.device_put_replicated"),
    ("from jax.interpreters import pxla", "jax.interpreters.pxla"),
    ("import jax.core as core\ncore.Tracer", "jax.core"),
    ("import jax\njax.core.ShapedArray", "jax.core"),
    ("from jax._src import mesh", "private to JAX"),
])
def test_the_check_catches_each_deprecated_name(snippet, name):
  found = problems(snippet, "jaxkv/example.py")
  assert found and name in found[0], found


def test_the_check_accepts_the_names_newer_jax_keeps():
  snippet = """
import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
f = jax.shard_map(g, mesh=mesh, in_specs=(), out_specs=())
with jax.set_mesh(mesh):
  pass
with jax.sharding.use_abstract_mesh(abstract):
  pass
spec = pl.BlockSpec(memory_space=pl.ANY)
params = pltpu.CompilerParams(dimension_semantics=("parallel",))
"""
  assert problems(snippet, "jaxkv/example.py") == []
