"""Paged attention ops.

``paged_attention`` is the entry point (chunked online softmax, jittable on every
backend); ``paged_attention_reference`` is the pure-jnp definition it is validated
against; ``write_pages`` scatters a step's K or V into pages.
"""

from jaxkv.ops.chunked import paged_attention
from jaxkv.ops.reference import paged_attention_reference, write_pages_reference

write_pages = write_pages_reference

__all__ = ["paged_attention", "paged_attention_reference", "write_pages",
           "write_pages_reference"]
