"""Models built on the public ``jaxkv.nnx`` layer: the Llama family's decoder and Gemma 3's,
random or loaded from a Hugging Face checkpoint or GGUF file (``from_pretrained``, which
picks the model by the checkpoint's architecture)."""

from jaxkv.models.gemma3 import Gemma3, Gemma3Config
from jaxkv.models.hf import (ARCHITECTURES, CheckpointError, from_pretrained, gemma3_config,
                             llama_config, model_config)
from jaxkv.models.llama import Llama, LlamaConfig, RopeScaling

__all__ = ["ARCHITECTURES", "CheckpointError", "Gemma3", "Gemma3Config", "Llama", "LlamaConfig",
           "RopeScaling", "from_pretrained", "gemma3_config", "llama_config", "model_config"]
