"""Models built on the public ``jaxkv.nnx`` layer (used by tests, examples, benchmarks)."""

from jaxkv.models.llama import Llama, LlamaConfig

__all__ = ["Llama", "LlamaConfig"]
