"""Models built on the public ``jaxkv.nnx`` layer: the Llama family's decoder, random or
loaded from a Hugging Face checkpoint (``from_pretrained``)."""

from jaxkv.models.hf import ARCHITECTURES, CheckpointError, from_pretrained, llama_config
from jaxkv.models.llama import Llama, LlamaConfig, RopeScaling

__all__ = ["ARCHITECTURES", "CheckpointError", "Llama", "LlamaConfig", "RopeScaling",
           "from_pretrained", "llama_config"]
