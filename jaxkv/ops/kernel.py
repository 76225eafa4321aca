"""jaxkv's Pallas paged-attention kernel: decode and chunked prefill, returning the
online-softmax state.

Same contract and layout as ``reference.paged_attention_reference``. One program per
(sequence, kv head) holds every query row of that head's group (``G`` query heads x ``T``
query tokens, as ``G*T`` rows) and walks the sequence's page table ``pages_per_chunk``
entries at a time, exactly as ``chunked.paged_state`` does: the same chunk boundaries in
absolute positions, the same masking, the same fold (``chunked.fold``) into a running
``(max, sum, acc)``. It stops after the chunk that holds the sequence's last token, and a
chunk whose keys are all masked leaves the state bit-for-bit unchanged, so its result does
not depend on the table's width or on the other sequences of the batch: KV computed by
one decode step and recomputed inside a wide prefill are the same bits on this path too.

It returns the state rather than the normalised output, so cold pages streamed from the
host (``streamed.stream_state``) merge into it as on the jnp path.

Two forms of the same kernel, one per Pallas backend:
- ``gpu``: Triton (``pltriton.CompilerParams`` given explicitly: with none, Pallas in JAX
  0.10 lowers to Mosaic GPU, which stages whole blocks in shared memory). The pools stay in
  global memory as pointers; each chunk's pages are gathered by table entries inside the
  kernel. Grid ``(sequence, kv head, row block)``: at most ``GPU_ROW_BLOCK`` query rows per
  program, so a 512-token prefill does not hold 2,048 rows at once. Triton keeps the chunk's
  K/V tiles (``GPU_NUM_STAGES`` in flight) and their float32 dot operands in shared memory,
  so the form walks the table in its own chunk: the largest power of two pages, at most
  ``pages_per_chunk``, whose tiles fit ``GPU_SMEM_BUDGET`` (``gpu_pages_per_chunk``). That
  chunk depends only on the page size, head size and KV dtype, so decode and prefill fold the
  same chunks and the exactness below holds on this form too.
- ``tpu``: the pools stay in HBM (``memory_space=ANY``); the page table, lengths and valid
  flags are prefetched scalars, and each chunk's pages are DMA'd into a double-buffered
  VMEM scratch, the next chunk's copies started before this chunk is computed.
Sliding windows (``window``, ``reference``'s module docstring): the window rides in the
small scalar array that names the layer's first head row (``[row, window]``), and each
sequence's first chunk a query of it can see beside its length; a program masks keys before
each row's window and starts its walk at that chunk, so a local layer of a long sequence
reads about a window of pages. The chunks skipped are wholly masked (no bit changes). With
no window those arrays keep their one-value shapes and the kernel its ops: a layer without
a window compiles to what it did before windows existed.
Off their hardware both run in Pallas' interpreters (``interpret=True``; the TPU form in
the TPU interpreter, which simulates the DMAs and semaphores): the tests check them that
way; interpreter timings say nothing about kernel speed. Whether a form is accepted by its
platform's compiler is checked by lowering it for that platform (``jax.export``, tests in
``tests/tools/test_lowering.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

from jaxkv.errors import InputError
from jaxkv.ops import chunked
from jaxkv.ops.reference import check_window, first_visible

# The Triton form's budget: shared memory one block may opt into on sm_90 (H100/H200),
# less a tenth of headroom for Triton versions other than the one the model was fit to.
GPU_SMEM_BYTES = 232448
GPU_SMEM_BUDGET = GPU_SMEM_BYTES * 9 // 10
GPU_ROW_BLOCK = 64  # most query rows per program
GPU_NUM_STAGES = 2  # chunks whose K/V loads are in flight at once
GPU_NUM_WARPS = 4


def gpu_smem_bytes(pages_per_chunk: int, page_size: int, head_dim: int, kv_itemsize: int,
                   row_block: int = GPU_ROW_BLOCK) -> int:
  """Shared memory of one program of the Triton form: the chunk's K and V tiles as loaded
  (``GPU_NUM_STAGES`` chunks in flight), one float32 dot operand of the chunk's width, and
  the query rows in float32. Fit to Triton 3.9's own figure for this kernel compiled for
  sm_90 (``launch/triton_smem.py``): within 0.1% for 64-row programs at head_dim 64, 128
  and 256 and chunks of 32 to 512 keys (a 16-row decode program needs less)."""
  chunk = pages_per_chunk * page_size
  per_key = head_dim * (GPU_NUM_STAGES * 2 * kv_itemsize + 4)
  return chunk * per_key + row_block * head_dim * 4


def gpu_pages_per_chunk(pages_per_chunk: int, page_size: int, head_dim: int,
                        kv_itemsize: int) -> int:
  """The Triton form's chunk: the largest power of two pages, at most ``pages_per_chunk``,
  whose tiles fit ``GPU_SMEM_BUDGET`` (see ``gpu_smem_bytes``)."""
  for name, value in (("page_size", page_size), ("head_dim", head_dim)):
    if value & (value - 1):
      raise InputError(f"the GPU kernel needs a power-of-two {name}, got {value}: use "
                       "attention_impl=jnp for this shape.")
  pages = 1 << (max(pages_per_chunk, 1).bit_length() - 1)
  while pages > 1 and gpu_smem_bytes(pages, page_size, head_dim, kv_itemsize) > GPU_SMEM_BUDGET:
    pages //= 2
  if gpu_smem_bytes(pages, page_size, head_dim, kv_itemsize) > GPU_SMEM_BUDGET:
    raise InputError(f"one page of {page_size} tokens x head_dim {head_dim} needs "
                     f"{gpu_smem_bytes(1, page_size, head_dim, kv_itemsize)} bytes of shared "
                     f"memory on the GPU kernel, over {GPU_SMEM_BUDGET}: use smaller pages or "
                     "attention_impl=jnp.")
  return pages


def _fold_chunk(state, c, q, qpos, length, k, v, valid, floor=None):
  """Chunk ``c``'s keys and values (``[pages, page_size, D]``; ``valid``: ``[L]``, one flag
  per key) folded into the state of the rows ``q`` (``[R, D]``) at positions ``qpos``
  (``[R]``; ``floor``: ``[R]``, the last key each row's window hides, or None): the
  arithmetic both forms share."""
  chunk_tokens, head_dim = valid.shape[0], q.shape[-1]
  kpos = c * chunk_tokens + jnp.arange(chunk_tokens, dtype=jnp.int32)
  mask = (kpos[None] <= qpos[:, None]) & (kpos[None] < length) & valid[None]
  if floor is not None:
    mask = mask & (kpos[None] > floor[:, None])
  k = k.reshape(chunk_tokens, head_dim).astype(jnp.float32)
  v = v.reshape(chunk_tokens, head_dim).astype(jnp.float32)
  s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [R, L]
  return chunked.fold(state, s, mask, lambda p: jnp.dot(
      p, v, preferred_element_type=jnp.float32))


def _chunks_used(length, width: int, pages_per_chunk: int, page_size: int):
  """The chunks up to the one holding the sequence's last token (the rest are masked)."""
  chunk_tokens = pages_per_chunk * page_size
  return jnp.minimum(width // pages_per_chunk, (length + chunk_tokens - 1) // chunk_tokens)


def _window_floor(qpos, window):
  """In a kernel: the last key position each row's window hides (``-1``: none, where the
  traced window is 0)."""
  return jnp.where(window > 0, qpos - window, -1)


def _run(state_refs, out_refs, start, used, step) -> None:
  """Folds chunks ``start .. used-1`` into the state, then stores it."""
  state = jax.lax.fori_loop(start, used, step, tuple(r[...] for r in state_refs))
  for ref, x in zip(out_refs, state):
    ref[...] = x


def _kernel(head_ref, lens_ref, table_ref, valid_ref, qpos_ref, q_ref, k_ref, v_ref, m_ref, l_ref,
            acc_ref, m_out, l_out, acc_out, *, pages_per_chunk: int, page_size: int,
            num_pages: int, windowed: bool):
  length = lens_ref[0]
  q, qpos = q_ref[...], qpos_ref[...]  # [R, D] float32 scaled; [R]
  # windowed: head_ref is [first row, window], lens_ref [length, first chunk to read]
  floor = _window_floor(qpos, head_ref[1]) if windowed else None
  start = lens_ref[1] if windowed else 0
  # The pools come as [rows * pages, S, D] (rows: the stack's layers x kv heads): this
  # program's head of its layer starts at page ``first``.
  first = (head_ref[0] + pl.program_id(1)) * num_pages

  def step(c, state):
    entries = pl.ds(c * pages_per_chunk, pages_per_chunk)
    table = table_ref[entries]
    valid = jnp.repeat(valid_ref[entries], page_size) != 0
    return _fold_chunk(state, c, q, qpos, length, k_ref[first + table], v_ref[first + table],
                       valid, floor)

  used = _chunks_used(length, table_ref.shape[0], pages_per_chunk, page_size)
  _run((m_ref, l_ref, acc_ref), (m_out, l_out, acc_out), start, used, step)


def _tpu_kernel(lens_ref, table_ref, valid_ref, head_ref, qpos_ref, q_ref, k_hbm, v_hbm, m_ref,
                l_ref, acc_ref, m_out, l_out, acc_out, k_buf, v_buf, k_sem, v_sem, *,
                pages_per_chunk: int, page_size: int, width: int, windowed: bool):
  b = pl.program_id(0)
  h = head_ref[0] + pl.program_id(1)  # this layer's kv head among the stack's rows
  length = lens_ref[b]
  q, qpos = q_ref[...], qpos_ref[0]  # [R, D] float32 scaled; [R]
  used = _chunks_used(length, width, pages_per_chunk, page_size)
  # windowed: head_ref is [first row, window]; lens_ref the B lengths, then each
  # sequence's first chunk to read
  floor = _window_floor(qpos, head_ref[1]) if windowed else None
  start = lens_ref[lens_ref.shape[0] // 2 + b] if windowed else 0

  def copies(c, slot):
    out = []
    for i in range(pages_per_chunk):
      page = table_ref[b * width + c * pages_per_chunk + i]
      out.append(pltpu.make_async_copy(k_hbm.at[h, page], k_buf.at[slot, i], k_sem.at[slot]))
      out.append(pltpu.make_async_copy(v_hbm.at[h, page], v_buf.at[slot, i], v_sem.at[slot]))
    return out

  @pl.when(used > start)
  def _():
    for copy in copies(start, start % 2):
      copy.start()

  def step(c, state):
    slot = c % 2

    @pl.when(c + 1 < used)
    def _():  # the next chunk's pages travel while this one is computed
      for copy in copies(c + 1, 1 - slot):
        copy.start()

    for copy in copies(c, slot):
      copy.wait()
    flags = [valid_ref[b * width + c * pages_per_chunk + i] != 0
             for i in range(pages_per_chunk)]
    valid = jnp.concatenate([jnp.full((page_size,), f) for f in flags])
    return _fold_chunk(state, c, q, qpos, length, k_buf[slot], v_buf[slot], valid, floor)

  _run((m_ref, l_ref, acc_ref), (m_out, l_out, acc_out), start, used, step)


def paged_state(state, qg, k_pages, v_pages, page_table, q_positions, kv_lens, *,
                pages_per_chunk: int, block_valid=None, interpret: bool = False,
                form: str = "gpu", layer=None, window=None):
  """``chunked.paged_state`` on the kernel: folds every page of ``page_table`` into
  ``state`` (``[B, H, G, T, 1]`` max and sum, ``[B, H, G, T, D]`` acc); ``qg``:
  ``[B, T, H, G, D]`` scaled float32 queries (``chunked.init_state``); ``form``: ``gpu``
  or ``tpu`` (see the module's docstring); ``interpret``: a bool, or for the TPU form a
  ``pltpu.InterpretParams`` (the TPU interpreter: simulated DMAs, race detection);
  ``layer``: the pools are stacks of layers ``[layers, H, P, S, D]`` and this (a scalar,
  traced or not) is the one attended. The kernel reads the stack in place, as
  ``[layers * H, P, S, D]`` rows (a free reshape), starting at row ``layer * H``;
  ``window``: a sliding window (``reference``'s module docstring)."""
  window = check_window(window)
  batch, q_len, heads, group, head_dim = qg.shape
  page_size = k_pages.shape[-2]
  first = jnp.zeros((1,), jnp.int32)  # the kernel's first row of this layer's heads
  if layer is not None:
    first = (jnp.asarray(layer, jnp.int32) * heads).reshape(1)
  if k_pages.ndim == 5 and form == "gpu" and k_pages.size >= 2**31:
    # Triton offsets pages with int32 arithmetic: a stack of 2**31 elements or more would
    # overflow it, so such a stack's layer is sliced out (a copy of one layer's pool).
    k_pages = jax.lax.dynamic_index_in_dim(k_pages, layer, keepdims=False)
    v_pages = jax.lax.dynamic_index_in_dim(v_pages, layer, keepdims=False)
    first = jnp.zeros((1,), jnp.int32)
  if k_pages.ndim == 5:
    k_pages = k_pages.reshape(-1, *k_pages.shape[2:])
    v_pages = v_pages.reshape(-1, *v_pages.shape[2:])
  if form == "gpu":
    pages_per_chunk = gpu_pages_per_chunk(pages_per_chunk, page_size, head_dim,
                                          k_pages.dtype.itemsize)
  width = page_table.shape[1]
  pad = -width % pages_per_chunk
  valid = (jnp.ones(page_table.shape, jnp.int32) if block_valid is None
           else block_valid.astype(jnp.int32))
  if pad:  # padded entries point at page 0 and are masked by position
    page_table = jnp.pad(page_table, ((0, 0), (0, pad)))
    valid = jnp.pad(valid, ((0, 0), (0, pad)))
  lens = kv_lens.astype(jnp.int32)  # [B]; windowed: [B, 2], each row's first chunk beside
  if window is not None:  # the window beside the first row
    first = jnp.concatenate([first, jnp.asarray(window, jnp.int32).reshape(1)])
    starts = first_visible(q_positions, window) // (pages_per_chunk * page_size)
    lens = jnp.stack([lens, jnp.minimum(starts, page_table.shape[1] // pages_per_chunk)], 1)
  rows = group * q_len  # row g*T + t: query head g of the group at token t
  q = jnp.moveaxis(qg, 1, 3).reshape(batch, heads, rows, head_dim)
  qpos = jnp.tile(q_positions, (1, group))  # [B, G*T], the same row order
  m, l, acc = (x.reshape(batch, heads, rows, -1) for x in state)
  if form == "gpu":  # Triton's blocks: a power of two rows, at least 16 for its dot
    block = min(GPU_ROW_BLOCK, max(16, 1 << (rows - 1).bit_length()))
    extra = -rows % block
    pad_rows = lambda x, value=0: jnp.pad(x, [(0, 0), (0, 0), (0, extra), (0, 0)],
                                          constant_values=value)
    q, m, l, acc = pad_rows(q), pad_rows(m, -jnp.inf), pad_rows(l), pad_rows(acc)
    qpos = jnp.pad(qpos, ((0, 0), (0, extra)), constant_values=-1)  # masked: nothing read
    out = _call(pages_per_chunk, page_size, block, interpret, m, l, acc, first, lens,
                page_table.astype(jnp.int32), valid, qpos, q, k_pages, v_pages)
  else:  # prefetched scalars, flat: the lengths, then (windowed) the first chunks
    out = _call_tpu(pages_per_chunk, page_size, interpret, m, l, acc, first,
                    lens.T.reshape(-1) if lens.ndim == 2 else lens,
                    page_table.astype(jnp.int32), valid, qpos, q, k_pages, v_pages)
  return tuple(x[:, :, :rows].reshape(batch, heads, group, q_len, -1) for x in out)


def _per_row(*tail) -> pl.BlockSpec:
  """Sequence ``b``'s block of a ``[B, *tail]`` operand (grid ``(b, h)``; the TPU form's
  prefetched scalar refs follow as ``*_``)."""
  return pl.BlockSpec((None, *tail), lambda b, h, *_: (b, *([0] * len(tail))))


def _per_head(*tail) -> pl.BlockSpec:
  """Program ``(b, h)``'s block of a ``[B, H, *tail]`` operand."""
  return pl.BlockSpec((None, None, *tail), lambda b, h, *_: (b, h, *([0] * len(tail))))


def _state_specs(rows: int, head_dim: int) -> list:
  return [_per_head(rows, 1), _per_head(rows, 1), _per_head(rows, head_dim)]


def _call(pages_per_chunk, page_size, block, interpret, m, l, acc, first, kv_lens, page_table,
          valid, qpos, q, k_pages, v_pages):
  batch, heads, rows, head_dim = q.shape
  width = page_table.shape[1]
  windowed = first.shape[0] == 2
  seq = lambda *tail: pl.BlockSpec((None, *tail), lambda b, h, r: (b, *([0] * len(tail))))
  rows_of = lambda tail: pl.BlockSpec((None, None, block, tail), lambda b, h, r: (b, h, r, 0))
  # The whole stack stays in global memory (a pointer), its heads' pages one after another
  # (a free reshape); the kernel offsets its page ids to its layer's head.
  num_pages = k_pages.shape[1]
  k_pages = k_pages.reshape(-1, page_size, head_dim)
  v_pages = v_pages.reshape(-1, page_size, head_dim)
  pool = pl.BlockSpec(k_pages.shape, lambda b, h, r: (0, 0, 0))
  state_specs = [rows_of(1), rows_of(1), rows_of(head_dim)]
  kernel = functools.partial(_kernel, pages_per_chunk=pages_per_chunk, page_size=page_size,
                             num_pages=num_pages, windowed=windowed)
  return pl.pallas_call(
      kernel,
      grid=(batch, heads, rows // block),
      in_specs=[pl.BlockSpec(first.shape, lambda b, h, r: (0,)), seq(2 if windowed else 1),
                seq(width), seq(width),
                pl.BlockSpec((None, block), lambda b, h, r: (b, r)),
                rows_of(head_dim), pool, pool, *state_specs],
      out_specs=state_specs,
      out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (m, l, acc)],
      input_output_aliases={8: 0, 9: 1, 10: 2},
      compiler_params=pltriton.CompilerParams(num_warps=GPU_NUM_WARPS,
                                              num_stages=GPU_NUM_STAGES),
      interpret=interpret,
      name=f"jaxkv_paged_attention_{pages_per_chunk}x{page_size}",
  )(first, kv_lens if windowed else kv_lens[:, None], page_table, valid, qpos, q, k_pages,
    v_pages, m, l, acc)


def _call_tpu(pages_per_chunk, page_size, interpret, m, l, acc, first, kv_lens, page_table, valid,
              qpos, q, k_pages, v_pages):
  batch, heads, rows, head_dim = q.shape
  width = page_table.shape[1]
  state_specs = _state_specs(rows, head_dim)
  hbm = pl.BlockSpec(memory_space=pl.ANY)
  buf = pltpu.VMEM((2, pages_per_chunk, page_size, head_dim), k_pages.dtype)
  kernel = functools.partial(_tpu_kernel, pages_per_chunk=pages_per_chunk, page_size=page_size,
                             width=width, windowed=first.shape[0] == 2)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=4,  # lengths, the page table, the valid flags (flattened), the
          # layer's first head row
          grid=(batch, heads),
          in_specs=[_per_row(1, rows), _per_head(rows, head_dim), hbm, hbm, *state_specs],
          out_specs=state_specs,
          scratch_shapes=[buf, buf, pltpu.SemaphoreType.DMA((2,)),
                          pltpu.SemaphoreType.DMA((2,))]),
      out_shape=[jax.ShapeDtypeStruct(x.shape, jnp.float32) for x in (m, l, acc)],
      input_output_aliases={8: 0, 9: 1, 10: 2},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
      interpret=interpret,
      name=f"jaxkv_paged_attention_tpu_{pages_per_chunk}x{page_size}",
  )(kv_lens, page_table.reshape(-1), valid.reshape(-1), first, qpos[:, None], q, k_pages,
    v_pages, m, l, acc)
