"""Picks the implementation of paged attention: the chunked jnp path or jaxkv's Pallas
kernel. Both fold pages into the same online-softmax state, so the engine and streaming
use either through ``paged_state``; ``paged_attention`` is the whole op."""

from __future__ import annotations

import contextlib
import threading

import jax

from jaxkv.config import ATTENTION_IMPLS, resolve_attention_impl
from jaxkv.errors import InputError
from jaxkv.ops import chunked, kernel
from jaxkv.ops.reference import check_shapes, check_window

_KERNEL_PLATFORM = {"pallas_gpu": "gpu", "pallas_tpu": "tpu"}
_lowering = threading.local()  # .platform: the platform being lowered for, if not this one


@contextlib.contextmanager
def lowering_for(platform: str):
  """Within: a kernel resolves as if the backend were ``platform`` (``gpu`` or ``tpu``),
  so a function traced here lowers the kernel for that platform instead of the
  interpreter (``jaxkv.tools.lowering`` exports functions for hardware that is not attached)."""
  before = getattr(_lowering, "platform", None)
  _lowering.platform = platform
  try:
    yield
  finally:
    _lowering.platform = before


def resolve(impl: str, interpret=None) -> tuple[str, object]:
  """``(implementation, interpret)`` for ``impl``; a kernel off its own platform runs in
  Pallas' interpreter unless ``interpret`` says otherwise (``pallas_tpu`` also takes a
  ``pltpu.InterpretParams``: the TPU interpreter)."""
  if impl not in ATTENTION_IMPLS:
    raise InputError(f"attention impl={impl!r} must be one of {ATTENTION_IMPLS}.")
  impl = resolve_attention_impl(impl)
  if impl == "jnp":
    return impl, False
  if interpret is None:
    backend = getattr(_lowering, "platform", None) or jax.default_backend()
    interpret = backend != _KERNEL_PLATFORM[impl]
  return impl, interpret


def paged_state(state, qg, k_pages, v_pages, page_table, q_positions, kv_lens, *,
                pages_per_chunk: int, block_valid=None, impl: str = "auto", interpret=None,
                layer=None, window=None):
  """Folds every page of ``page_table`` into ``state`` (see ``chunked.paged_state``;
  ``layer``: the pools are stacks of layers and this is the one attended; ``window``: a
  sliding window, see ``reference``)."""
  impl, interpret = resolve(impl, interpret)
  window = check_window(window)
  if impl == "jnp":
    return chunked.paged_state(state, qg, k_pages, v_pages, page_table, q_positions, kv_lens,
                               pages_per_chunk=pages_per_chunk, block_valid=block_valid,
                               layer=layer, window=window)
  return kernel.paged_state(state, qg, k_pages, v_pages, page_table, q_positions, kv_lens,
                            pages_per_chunk=pages_per_chunk, block_valid=block_valid,
                            interpret=interpret, form=_KERNEL_PLATFORM[impl], layer=layer,
                            window=window)


def paged_attention(q, k_pages, v_pages, page_table, q_positions, kv_lens, *,
                    pages_per_chunk: int = 8, scale: float | None = None, block_valid=None,
                    impl: str = "auto", interpret=None, window=None):
  """Attention of ``q`` over each sequence's pages (contract and layout:
  ``reference.paged_attention_reference``). ``impl``: ``auto``, ``jnp``, ``pallas_gpu``
  or ``pallas_tpu``; ``interpret``: run a Pallas kernel in Pallas' interpreter (default:
  when the backend is not the kernel's); ``window``: a sliding window (``reference``).
  Returns ``q``'s shape and dtype."""
  check_shapes(q, k_pages, v_pages, page_table, q_positions, kv_lens)
  if pages_per_chunk <= 0:
    raise InputError(f"{pages_per_chunk=} must be positive.")
  qg, state = chunked.init_state(q, k_pages.shape[0], scale)
  state = paged_state(state, qg, k_pages, v_pages, page_table, q_positions, kv_lens,
                      pages_per_chunk=pages_per_chunk, block_valid=block_valid, impl=impl,
                      interpret=interpret, window=window)
  return chunked.finish(state, q)
