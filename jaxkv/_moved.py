"""Old module paths, kept working after the modules moved into subpackages by role.

``import jaxkv.cache`` style paths are part of what users' scripts rely on (``jaxkv.checkpoint
.Checkpointer``, ``jaxkv.metrics.registry``, ``jaxkv.bench.s3server.LocalS3``...). Each old
path is the same module object as the new one, so a ``monkeypatch`` or an ``isinstance``
through either name means the same thing.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# old path -> new path; a package entry also maps every module under it
MOVED = {
    "jaxkv.admission": "jaxkv.scheduling.admission",
    "jaxkv.scheduler": "jaxkv.scheduling.scheduler",
    "jaxkv.step": "jaxkv.scheduling.step",
    "jaxkv.index": "jaxkv.manager.index",
    "jaxkv.costs": "jaxkv.planning.costs",
    "jaxkv.plan": "jaxkv.planning.plan",
    "jaxkv.planner": "jaxkv.planning.planner",
    "jaxkv.calibration": "jaxkv.planning.calibration",
    "jaxkv.pages": "jaxkv.worker.pages",
    "jaxkv.transfers": "jaxkv.worker.transfers",
    "jaxkv.journal": "jaxkv.worker.journal",
    "jaxkv.runner": "jaxkv.worker.runner",
    "jaxkv.streaming": "jaxkv.worker.streaming",
    "jaxkv.checkpoint": "jaxkv.worker.checkpoint",
    "jaxkv.sampling": "jaxkv.worker.sampling",
    "jaxkv.tiers": "jaxkv.worker.tiers",
    "jaxkv.engine": "jaxkv.serving.engine",
    "jaxkv.service": "jaxkv.serving.service",
    "jaxkv.server": "jaxkv.entrypoints.openai.server",
    "jaxkv.httplimits": "jaxkv.entrypoints.openai.limits",
    "jaxkv.tokenizer": "jaxkv.entrypoints.openai.tokenizer",
    "jaxkv.builder": "jaxkv.tools.builder",
    "jaxkv.workloads": "jaxkv.tools.workloads",
    "jaxkv.online": "jaxkv.tools.online",
    "jaxkv.lowering": "jaxkv.tools.lowering",
    "jaxkv.roofline": "jaxkv.tools.roofline",
    "jaxkv.capacity": "jaxkv.tools.capacity",
    "jaxkv.bench": "jaxkv.tools.bench",
}


def new_name(old: str) -> str | None:
  """The module an old path names now, or None for a path that did not move."""
  for depth in (3, 2):  # the longest moved prefix wins (jaxkv.tiers.remote under jaxkv.tiers)
    prefix = ".".join(old.split(".")[:depth])
    if prefix in MOVED:
      return MOVED[prefix] + old[len(prefix):]
  return None


class _Alias(importlib.abc.Loader):

  def __init__(self, target: str):
    self.target = target

  def create_module(self, spec):
    module = importlib.import_module(self.target)
    self.spec = module.__spec__
    return module

  def exec_module(self, module):
    module.__spec__ = self.spec  # the target ran when imported; the import set the alias's spec


class _Finder(importlib.abc.MetaPathFinder):

  def find_spec(self, name, path=None, target=None):
    new = new_name(name) if name.startswith("jaxkv.") else None
    if new is None:
      return None
    module = importlib.import_module(new)
    return importlib.util.spec_from_loader(name, _Alias(new),
                                           is_package=hasattr(module, "__path__"))


def install() -> None:
  """Old paths resolve to the moved modules; those already imported are aliased now, so
  importing an old path never rebinds a name of the package (``jaxkv.plan`` the function)."""
  if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())  # before the path finder, which would load a copy
  package = sys.modules["jaxkv"]
  for old, new in MOVED.items():
    if new in sys.modules:
      sys.modules.setdefault(old, sys.modules[new])
      leaf = old.rsplit(".", 1)[1]
      if not hasattr(package, leaf):
        setattr(package, leaf, sys.modules[new])
