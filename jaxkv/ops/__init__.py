"""Paged attention ops.

``paged_attention`` is the entry point (``impl``: the chunked online-softmax jnp path,
jittable on every backend, or jaxkv's Pallas kernel); ``paged_attention_reference`` is
the pure-jnp definition every implementation is validated against; ``write_pages``
scatters a step's K or V into pages. Every one takes a sliding ``window`` (Gemma 3's local
layers; ``reference``'s docstring states the rule).
"""

from jaxkv.config import ATTENTION_IMPLS
from jaxkv.ops.reference import paged_attention_reference, write_pages_reference
from jaxkv.ops.select import paged_attention, resolve as resolve_impl

write_pages = write_pages_reference

__all__ = ["ATTENTION_IMPLS", "paged_attention", "paged_attention_reference", "resolve_impl",
           "write_pages", "write_pages_reference"]
