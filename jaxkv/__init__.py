"""jaxkv: a tiered, sharded KV cache for LLM inference in JAX.

The public API is this module's names plus ``jaxkv.nnx`` (the layer a Flax NNX model
calls), ``jaxkv.models`` (the Llama family's decoder, random or from a Hugging Face
checkpoint) and ``jaxkv.ops`` (paged attention). Everything else is internal.

What users touch: configs (``CacheConfig``, ``TierConfig``, ``EngineConfig``,
``SchedulerConfig``, ``StreamConfig``, ``SamplingParams``), the ``KVCache`` and the
``Engine`` over it, the handle ``Engine.submit`` returns (``RequestHandle``) and what
``Engine.step`` returns (``StepOutput``), and the errors (``InputError``: a value you gave
is unusable; ``CapacityError``: it does not fit). ``PrefixIndex``, ``CostModel``/``LinkCost``/
``PrefillCurve`` and the jitted ``plan`` are exported for those who drive or calibrate
the decision themselves (``launch/plan.py`` does).
"""

import importlib
import importlib.util
import sys
import types

from jaxkv import _moved

_moved.install()
__version__ = "0.1.0"

# Each public name and the module it lives in. They are imported on first use (PEP 562), so
# ``import jaxkv.config`` (or the host-only ``jaxkv.manager``, ``jaxkv.scheduling``) does not
# import JAX, Flax and the engine with this package.
_EXPORTS = {
    "CacheConfig": "jaxkv.config",
    "EngineConfig": "jaxkv.config",
    "SamplingParams": "jaxkv.config",
    "SchedulerConfig": "jaxkv.config",
    "StreamConfig": "jaxkv.config",
    "TierConfig": "jaxkv.config",
    "InputError": "jaxkv.errors",
    "CapacityError": "jaxkv.errors",
    "KVCache": "jaxkv.cache",
    "CostModel": "jaxkv.planning.costs",
    "LinkCost": "jaxkv.planning.costs",
    "PrefillCurve": "jaxkv.planning.costs",
    "Engine": "jaxkv.serving.engine",
    "weights_digest": "jaxkv.identity",
    "PrefixIndex": "jaxkv.manager.index",
    "Tier": "jaxkv.manager.index",
    "make_mesh": "jaxkv.worker.pages",
    "plan": "jaxkv.planning.plan",
    "RequestHandle": "jaxkv.scheduling.scheduler",
    "StepOutput": "jaxkv.scheduling.scheduler",
    "Tokenizer": "jaxkv.entrypoints.openai.tokenizer",
}


def __getattr__(name: str):
  """A public name (imported from its module and kept here), or a submodule (``jaxkv.nnx``,
  ``jaxkv.metrics``, an old path such as ``jaxkv.checkpoint``) imported on first use."""
  if name in _EXPORTS:
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
  elif not name.startswith("__") and (_moved.new_name(f"{__name__}.{name}") is not None
                                      or importlib.util.find_spec(f"{__name__}.{name}")):
    value = importlib.import_module(f"{__name__}.{name}")
  else:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  globals()[name] = value
  return value


def __dir__():
  return sorted({*globals(), *__all__})


class _Package(types.ModuleType):
  """This package's module type: a module never replaces a public name. ``import jaxkv.plan``
  (the old path of ``jaxkv.planning.plan``) makes the import system bind that module to the
  package's ``plan``, which is the jitted function."""

  def __setattr__(self, name, value):
    if name in _EXPORTS and isinstance(value, types.ModuleType):
      return
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "CacheConfig",
    "CapacityError",
    "Engine",
    "EngineConfig",
    "InputError",
    "KVCache",
    "CostModel",
    "LinkCost",
    "PrefillCurve",
    "PrefixIndex",
    "RequestHandle",
    "SamplingParams",
    "Tokenizer",
    "SchedulerConfig",
    "StepOutput",
    "StreamConfig",
    "plan",
    "Tier",
    "TierConfig",
    "make_mesh",
    "models",
    "nnx",
    "ops",
    "weights_digest",
]
