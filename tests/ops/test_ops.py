"""Paged attention: reference vs an independent dense oracle; every implementation (the
chunked jnp path, jaxkv's Pallas kernel in Pallas' interpreter) vs both."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.ops import paged_attention, paged_attention_reference, write_pages


def dense_oracle(q, k_seq, v_seq, q_positions, kv_lens):
  """Plain numpy causal attention over contiguous K/V: [B, L, Hkv, D]."""
  b, t, hq, d = q.shape
  hkv = k_seq.shape[2]
  g = hq // hkv
  out = np.zeros((b, t, hq, d), np.float64)
  for bi, ti, h in itertools.product(range(b), range(t), range(hq)):
    pos = q_positions[bi, ti]
    if pos < 0:
      continue
    n = min(pos + 1, kv_lens[bi])
    if n <= 0:
      continue
    k = k_seq[bi, :n, h // g].astype(np.float64)
    v = v_seq[bi, :n, h // g].astype(np.float64)
    s = k @ q[bi, ti, h].astype(np.float64) / np.sqrt(d)
    p = np.exp(s - s.max())
    out[bi, ti, h] = (p / p.sum()) @ v
  return out


def random_case(rng, *, batch, q_len, hq, hkv, d, page_size, pages_per_seq, num_pages, lens,
                dtype=np.float32):
  """Random pages + a page table of distinct random pages; positions end at each length."""
  k_pages = rng.standard_normal((hkv, num_pages, page_size, d)).astype(dtype)
  v_pages = rng.standard_normal((hkv, num_pages, page_size, d)).astype(dtype)
  perm = rng.permutation(num_pages)[:batch * pages_per_seq]
  table = perm.reshape(batch, pages_per_seq).astype(np.int32)
  q = rng.standard_normal((batch, q_len, hq, d)).astype(dtype)
  positions = np.full((batch, q_len), -1, np.int32)
  for b, n in enumerate(lens):
    m = min(q_len, n)
    positions[b, :m] = np.arange(n - m, n)
  kv_lens = np.asarray(lens, np.int32)
  k_seq = k_pages[:, table].transpose(1, 2, 3, 0, 4).reshape(batch, -1, hkv, d)
  v_seq = v_pages[:, table].transpose(1, 2, 3, 0, 4).reshape(batch, -1, hkv, d)
  return q, k_pages, v_pages, table, positions, kv_lens, k_seq, v_seq


IMPLS = ["jnp", "pallas_gpu", "pallas_tpu"]


def attend(impl):
  return jax.jit(functools.partial(paged_attention, impl=impl),
                 static_argnames="pages_per_chunk")


@functools.lru_cache(maxsize=None)
def oracle_case(hq, hkv, q_len, page_size, pages_per_seq):
  """One shape's random case, the dense oracle's answer and the reference's, computed once:
  every implementation's test compares against the same two."""
  rng = np.random.default_rng(hq * 100 + q_len * 10 + page_size)
  cap = page_size * pages_per_seq
  lens = [cap, 1, cap // 2 + 1, 0]  # full, one token, ragged, empty (padding row)
  case = random_case(rng, batch=4, q_len=q_len, hq=hq, hkv=hkv, d=8, page_size=page_size,
                     pages_per_seq=pages_per_seq, num_pages=4 * pages_per_seq + 3, lens=lens)
  q, kp, vp, table, pos, lens_a, k_seq, v_seq = case
  want = dense_oracle(q, k_seq, v_seq, pos, lens_a)
  ref = np.asarray(jax.jit(paged_attention_reference)(q, kp, vp, table, pos, lens_a))
  return case, want, ref


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("q_len", [1, 5])
@pytest.mark.parametrize("page_size,pages_per_seq,chunk", [(4, 6, 4), (8, 3, 2), (2, 9, 8)])
def test_paged_attention_matches_dense_oracle(impl, hq, hkv, q_len, page_size, pages_per_seq,
                                              chunk):
  case, want, ref = oracle_case(hq, hkv, q_len, page_size, pages_per_seq)
  q, kp, vp, table, pos, lens_a, _, _ = case
  fast = attend(impl)(q, kp, vp, table, pos, lens_a, pages_per_chunk=chunk)
  np.testing.assert_allclose(ref, want, atol=2e-5, rtol=2e-5)
  np.testing.assert_allclose(np.asarray(fast), want, atol=2e-5, rtol=2e-5)
  assert not np.asarray(fast)[3].any()  # padding rows give exact zeros


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_attention_does_not_depend_on_table_width(impl):
  """Padding the page table with more (masked) pages must not change a single bit, nor
  must a width that is not a multiple of the chunk."""
  rng = np.random.default_rng(0)
  q, kp, vp, table, pos, lens, _, _ = random_case(
      rng, batch=3, q_len=4, hq=4, hkv=2, d=8, page_size=4, pages_per_seq=8, num_pages=40,
      lens=[30, 7, 17])
  fn = attend(impl)
  narrow = np.asarray(fn(q, kp, vp, table, pos, lens, pages_per_chunk=4))
  for extra in (24, 5):
    wider = np.concatenate([table, rng.integers(0, 40, (3, extra)).astype(np.int32)], axis=1)
    np.testing.assert_array_equal(narrow, np.asarray(fn(q, kp, vp, wider, pos, lens,
                                                        pages_per_chunk=4)))


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_attention_reads_no_chunk_past_the_longest_sequence(impl):
  """Chunks wholly past every row's length are never read: table entries there may point
  at pages of NaN (a masked read would turn 0 * NaN into NaN), and a short row's output is
  the same bits alone as next to a longer one."""
  rng = np.random.default_rng(2)
  q, kp, vp, table, pos, lens, k_seq, v_seq = random_case(
      rng, batch=2, q_len=3, hq=4, hkv=2, d=8, page_size=4, pages_per_seq=16, num_pages=40,
      lens=[21, 6])  # 21 tokens: chunks of 4 pages (16 tokens) 0 and 1 are used, 2-3 not
  kp, vp = kp.copy(), vp.copy()
  kp[:, 39], vp[:, 39] = np.nan, np.nan
  table = table.copy()
  table[:, 8:] = 39  # every entry of the unused chunks: the NaN page
  fn = attend(impl)
  both = np.asarray(fn(q, kp, vp, table, pos, lens, pages_per_chunk=4))
  assert np.isfinite(both).all()
  np.testing.assert_allclose(both, dense_oracle(q, k_seq, v_seq, pos, lens), atol=2e-5)
  alone = np.asarray(fn(q[1:], kp, vp, table[1:], pos[1:], lens[1:], pages_per_chunk=4))
  np.testing.assert_array_equal(both[1:], alone)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype,atol", [(jnp.bfloat16, 3e-2), (jnp.float16, 3e-3)])
def test_low_precision_pages(impl, dtype, atol):
  rng = np.random.default_rng(1)
  q, kp, vp, table, pos, lens, k_seq, v_seq = random_case(
      rng, batch=2, q_len=3, hq=4, hkv=2, d=16, page_size=4, pages_per_seq=4, num_pages=10,
      lens=[16, 9])
  kp, vp = jnp.asarray(kp, dtype), jnp.asarray(vp, dtype)
  want = dense_oracle(q, np.asarray(kp.astype(jnp.float32))[:, table].transpose(
      1, 2, 3, 0, 4).reshape(2, -1, 2, 16), np.asarray(vp.astype(jnp.float32))[:, table].transpose(
          1, 2, 3, 0, 4).reshape(2, -1, 2, 16), pos, lens)
  got = paged_attention(jnp.asarray(q, dtype), kp, vp, table, pos, lens, pages_per_chunk=2,
                        impl=impl)
  assert got.dtype == dtype
  np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=atol, rtol=atol)


def test_write_pages_places_tokens_and_drops_padding():
  rng = np.random.default_rng(2)
  pages = np.zeros((2, 6, 4, 3), np.float32)
  table = np.array([[4, 1, 0], [2, 3, 5]], np.int32)
  new = rng.standard_normal((2, 3, 2, 3)).astype(np.float32)
  positions = np.array([[3, 4, 5], [0, -1, -1]], np.int32)
  out = np.asarray(write_pages(jnp.asarray(pages), new, table, positions))
  want = pages.copy()
  want[:, 4, 3] = new[0, 0]  # position 3 -> page table[0][0] = 4, slot 3
  want[:, 1, 0] = new[0, 1]
  want[:, 1, 1] = new[0, 2]
  want[:, 2, 0] = new[1, 0]
  np.testing.assert_array_equal(out, want)


def test_shape_errors_name_the_values():
  q = jnp.zeros((1, 1, 3, 8))
  kp = jnp.zeros((2, 4, 4, 8))
  with pytest.raises(ValueError, match="num_q_heads=3 must be divisible by num_kv_heads=2"):
    paged_attention_reference(q, kp, kp, jnp.zeros((1, 2), jnp.int32),
                              jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="page_table"):
    jaxkv.ops.paged_attention(jnp.zeros((1, 1, 2, 8)), kp, kp, jnp.zeros((2, 2), jnp.int32),
                              jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32))
  with pytest.raises(ValueError, match="impl='triton'.*pallas_tpu"):
    jaxkv.ops.paged_attention(jnp.zeros((1, 1, 2, 8)), kp, kp, jnp.zeros((1, 2), jnp.int32),
                              jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32),
                              impl="triton")
  with pytest.raises(ValueError, match="attention_impl='fast'"):
    jaxkv.CacheConfig(model_name="m", num_layers=1, num_kv_heads=2, head_dim=8,
                      attention_impl="fast")


def test_the_kernel_state_is_the_jnp_paths_state():
  """The kernel returns the online-softmax state (max, sum, acc), not only the output, and
  it is the state the jnp path builds: cold pages folded in after either give the same
  attention (streaming relies on it)."""
  from jaxkv.ops import chunked, select
  rng = np.random.default_rng(5)
  q, kp, vp, table, pos, lens, k_seq, v_seq = random_case(
      rng, batch=3, q_len=2, hq=4, hkv=2, d=8, page_size=4, pages_per_seq=6, num_pages=30,
      lens=[24, 13, 5])
  kp, vp, table = jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table)
  hot = np.ones(table.shape, bool)
  hot[:, :2] = False  # the first two pages of every row are "cold": folded in separately
  states = {}
  for impl in IMPLS:
    qg, state = chunked.init_state(jnp.asarray(q), 2)
    state = select.paged_state(state, qg, kp, vp, table, pos, lens, pages_per_chunk=2,
                               block_valid=hot, impl=impl)
    state = select.paged_state(state, qg, kp, vp, table, pos, lens, pages_per_chunk=2,
                               block_valid=~hot, impl="jnp")  # the cold pages, on the jnp path
    states[impl] = state
    np.testing.assert_allclose(np.asarray(chunked.finish(state, jnp.asarray(q))),
                               dense_oracle(q, k_seq, v_seq, pos, lens), atol=2e-5)
  for impl in IMPLS[1:]:
    for a, b in zip(states["jnp"], states[impl]):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)


def test_the_tpu_forms_double_buffered_copies_do_not_race():
  """In the TPU interpreter (simulated DMAs and semaphores, copies landing only when
  waited for, race detection on), the TPU form's prefetch of the next chunk never
  touches the buffer being computed on, and it still equals the oracle."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  from jax.experimental.pallas import tpu as pltpu
  rng = np.random.default_rng(9)
  q, kp, vp, table, pos, lens, k_seq, v_seq = random_case(
      rng, batch=2, q_len=3, hq=4, hkv=2, d=8, page_size=4, pages_per_seq=9, num_pages=30,
      lens=[35, 14])
  params = pltpu.InterpretParams(detect_races=True, dma_execution_mode="on_wait")
  got = paged_attention(q, jnp.asarray(kp), jnp.asarray(vp), jnp.asarray(table), pos, lens,
                        pages_per_chunk=2, impl="pallas_tpu", interpret=params)
  np.testing.assert_allclose(np.asarray(got), dense_oracle(q, k_seq, v_seq, pos, lens),
                             atol=2e-5)
  assert interpret_pallas_call.races is not None
  assert not interpret_pallas_call.races.races_found


@pytest.mark.parametrize("impl", IMPLS)
def test_a_layer_of_a_stack_is_written_and_attended_in_place(impl):
  """A scanned model's pages are one stack [layers, H, P, S, D] and each layer is addressed
  by its index (traced, as under the scan): writing and attending layer i of the stack
  gives what one layer's pool gives, and leaves every other layer's pages untouched."""
  from jaxkv.ops import chunked, reference, select
  rng = np.random.default_rng(11)
  layers = 3
  cases = [random_case(rng, batch=3, q_len=2, hq=4, hkv=2, d=8, page_size=4, pages_per_seq=6,
                       num_pages=30, lens=[24, 13, 5]) for _ in range(layers)]
  k_stack = jnp.stack([jnp.asarray(c[1]) for c in cases])
  v_stack = jnp.stack([jnp.asarray(c[2]) for c in cases])
  q, _, _, table, pos, lens, _, _ = cases[1]
  new = rng.standard_normal((3, 2, 2, 8)).astype(np.float32)

  @jax.jit
  def on_stack(k_stack, v_stack, layer):
    k_stack = reference.write_pages_reference(k_stack, new, table, pos, layer)
    v_stack = reference.write_pages_reference(v_stack, new * 2, table, pos, layer)
    qg, state = chunked.init_state(jnp.asarray(q), 2)
    state = select.paged_state(state, qg, k_stack, v_stack, table, pos, lens,
                               pages_per_chunk=2, impl=impl, layer=layer)
    return chunked.finish(state, jnp.asarray(q)), k_stack, v_stack

  @jax.jit
  def on_pool(k_pages, v_pages):
    k_pages = reference.write_pages_reference(k_pages, new, table, pos)
    v_pages = reference.write_pages_reference(v_pages, new * 2, table, pos)
    qg, state = chunked.init_state(jnp.asarray(q), 2)
    state = select.paged_state(state, qg, k_pages, v_pages, table, pos, lens,
                               pages_per_chunk=2, impl=impl)
    return chunked.finish(state, jnp.asarray(q)), k_pages, v_pages

  for layer in range(layers):
    out, ks, vs = on_stack(k_stack, v_stack, jnp.int32(layer))
    want, kp, vp = on_pool(k_stack[layer], v_stack[layer])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(ks[layer]), np.asarray(kp))
    np.testing.assert_array_equal(np.asarray(vs[layer]), np.asarray(vp))
    others = np.array([i for i in range(layers) if i != layer])
    np.testing.assert_array_equal(np.asarray(ks[others]), np.asarray(k_stack[others]))
    np.testing.assert_array_equal(np.asarray(vs[others]), np.asarray(v_stack[others]))
    assert not np.array_equal(np.asarray(ks[layer]), np.asarray(k_stack[layer]))
