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

from jaxkv import models, nnx, ops
from jaxkv.cache import CapacityError, KVCache
from jaxkv.config import (CacheConfig, EngineConfig, SamplingParams, SchedulerConfig,
                          StreamConfig, TierConfig)
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
from jaxkv.serving.engine import Engine
from jaxkv.errors import InputError
from jaxkv.identity import weights_digest
from jaxkv.manager.index import PrefixIndex, Tier
from jaxkv.worker.pages import make_mesh
from jaxkv.planning.plan import plan
from jaxkv.scheduling.scheduler import RequestHandle, StepOutput
from jaxkv.entrypoints.openai.tokenizer import Tokenizer

from jaxkv import _moved

_moved.install()
__version__ = "0.1.0"

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
