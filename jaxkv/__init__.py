"""jaxkv: a tiered, sharded KV cache for LLM inference in JAX.

The public API is this module's names plus ``jaxkv.nnx`` (the layer a Flax NNX model
calls), ``jaxkv.models`` (the Llama family's decoder, random or from a Hugging Face
checkpoint) and ``jaxkv.ops`` (paged attention). Everything else is internal.
"""

from jaxkv import models, nnx, ops
from jaxkv.cache import CapacityError, KVCache
from jaxkv.config import (CacheConfig, EngineConfig, SamplingParams, SchedulerConfig,
                          StreamConfig, TierConfig)
from jaxkv.engine import Engine
from jaxkv.identity import weights_digest
from jaxkv.index import PrefixIndex, Tier
from jaxkv.scheduler import CostModel, LinkCost, PrefillCurve, plan
from jaxkv.pages import make_mesh
from jaxkv.tokenizer import Tokenizer

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "CapacityError",
    "Engine",
    "EngineConfig",
    "KVCache",
    "CostModel",
    "LinkCost",
    "PrefillCurve",
    "PrefixIndex",
    "SamplingParams",
    "Tokenizer",
    "SchedulerConfig",
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
