"""Sliding-window attention (Gemma 3's local layers): every implementation — the reference,
the chunked jnp path, both Pallas kernel forms in their interpreters, the streamed cold
pages, and ``PagedKV.attend`` under a scan over layers — against a NumPy float64 dense
attention written here from the rule: a query at position ``t`` sees keys at ``p`` with
``t - window < p <= t`` (``window`` 0: every ``p <= t``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.nnx import PageBatch, PagedKV, init_pages
from jaxkv.ops import chunked, paged_attention, paged_attention_reference, select, streamed
from jaxkv.ops import write_pages_reference
from jaxkv.worker import pages as pages_lib

PAGE, CHUNK = 4, 2  # pages of 4 tokens, chunks of 2 pages: chunk edges every 8 positions
HQ, HKV, D = 4, 2, 8
# 3: under a page; 6: not a multiple of the page; 13: spans a chunk edge for every query
# past it; 0: a global layer; 200: longer than any sequence here (equals no window).
WINDOWS = (3, 6, 13, 0, 200)
IMPLS = ("jnp", "pallas_gpu", "pallas_tpu")


def dense_window(q, k_seq, v_seq, q_positions, kv_lens, window):
  """Attention from the rule, in float64, over contiguous K/V ``[B, L, Hkv, D]``."""
  b, t, hq, d = q.shape
  g = hq // k_seq.shape[2]
  out = np.zeros((b, t, hq, d), np.float64)
  for bi in range(b):
    for ti in range(t):
      pos = q_positions[bi, ti]
      keys = [p for p in range(kv_lens[bi]) if p <= pos and (window == 0 or p > pos - window)]
      if pos < 0 or not keys:
        continue
      for h in range(hq):
        k = k_seq[bi, keys, h // g].astype(np.float64)
        v = v_seq[bi, keys, h // g].astype(np.float64)
        s = k @ q[bi, ti, h].astype(np.float64) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[bi, ti, h] = p / p.sum() @ v
  return out


def sequences(k_pages, v_pages, table):
  """Each row's pages as one contiguous sequence ``[B, L, Hkv, D]``."""
  b = table.shape[0]
  seq = lambda p: np.asarray(p)[:, table].transpose(1, 2, 3, 0, 4).reshape(b, -1, HKV, D)
  return seq(k_pages), seq(v_pages)


def rows_case(rng, rows, pages_per_seq=8, q_len=6):
  """Random pages and a batch of ``rows``: ``(first position, query tokens, kv length)``
  each, positions running on from the first (a row of 0 tokens is padding)."""
  num_pages = len(rows) * pages_per_seq + 3
  k_pages = rng.standard_normal((HKV, num_pages, PAGE, D)).astype(np.float32)
  v_pages = rng.standard_normal((HKV, num_pages, PAGE, D)).astype(np.float32)
  table = rng.permutation(num_pages)[:len(rows) * pages_per_seq].reshape(len(rows), -1)
  positions = np.full((len(rows), q_len), -1, np.int32)
  for r, (first, count, _) in enumerate(rows):
    positions[r, :count] = np.arange(first, first + count)
  q = rng.standard_normal((len(rows), q_len, HQ, D)).astype(np.float32)
  lens = np.asarray([n for _, _, n in rows], np.int32)
  return q, k_pages, v_pages, table.astype(np.int32), positions, lens


# A prefill from the start, a prefill chunk continuing a sequence (keys before it already in
# the pages), a decode step, and a row of padding.
MIXED = [(0, 6, 6), (17, 6, 23), (30, 1, 31), (0, 0, 0)]


@functools.lru_cache(maxsize=None)
def mixed_case():
  case = rows_case(np.random.default_rng(51), MIXED)
  q, kp, vp, table, pos, lens = case
  k_seq, v_seq = sequences(kp, vp, table)
  return case, {w: dense_window(q, k_seq, v_seq, pos, lens, w) for w in WINDOWS}


def _attend(impl):
  """Paged attention by ``impl`` (``window`` a keyword: traced unless bound statically)."""
  if impl == "reference":
    return paged_attention_reference
  return functools.partial(paged_attention, pages_per_chunk=CHUNK, impl=impl)


@pytest.mark.parametrize("impl", ("reference",) + IMPLS)
def test_every_implementation_equals_the_dense_rule(impl):
  """Every window at once, traced, in a scan (one compile); then the chunks before a window
  are skipped, not only masked: their pages may hold NaN (a masked read gives 0 * NaN =
  NaN), and a row's bits do not depend on whether its batch let a chunk be skipped."""
  (q, kp, vp, table, pos, lens), want = mixed_case()
  attend = _attend(impl)
  fn = jax.jit(lambda *a, windows: jax.lax.map(lambda w: attend(*a, window=w), windows))
  windows = jnp.asarray(WINDOWS, jnp.int32)
  got = dict(zip(WINDOWS, np.asarray(fn(q, kp, vp, table, pos, lens, windows=windows))))
  for w in WINDOWS:
    np.testing.assert_allclose(got[w], want[w], atol=2e-5, rtol=2e-5, err_msg=f"window={w}")
  assert not got[3][3].any()  # the padding row: exact zeros
  # A window longer than every sequence is no window, to the bit; and windows do cut.
  np.testing.assert_array_equal(got[200], got[0])
  assert not np.allclose(got[3], got[0]) and not np.allclose(got[13], got[0])
  if impl in ("reference", "jnp"):  # a Python window (a constant of the graph) likewise
    static = lambda w: np.asarray(jax.jit(functools.partial(attend, window=w))(
        q, kp, vp, table, pos, lens))
    np.testing.assert_allclose(static(6), want[6], atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(static(None), got[0])  # and no window is a traced 0's bits
  if impl == "reference":
    return
  # Without the prefill from position 0 (now padding), window 3 lets every row skip chunk 0
  # (table entries 0 and 1), which now holds NaN; the kernels skip per sequence, so the
  # decode at 30 skips chunks 0 to 2 (entries 0 to 5), NaN too on those.
  late_pos, late_lens = pos.copy(), lens.copy()
  late_pos[0], late_lens[0] = -1, 0
  kp, vp = kp.copy(), vp.copy()
  poisoned = table[1:3, :2] if impl == "jnp" else np.concatenate([table[1, :2], table[2, :6]])
  kp[:, poisoned] = vp[:, poisoned] = np.nan
  late = np.asarray(fn(q, kp, vp, table, late_pos, late_lens, windows=windows))[0]
  assert np.isfinite(late).all()
  np.testing.assert_array_equal(late[1:3], got[3][1:3])


def test_streamed_cold_pages_take_the_window():
  """A long sequence's cold pages (in the host pool) folded after its hot ones: the window
  masks cold keys too. Rows whose window starts inside the cold pages, and one wholly
  after them."""
  rng = np.random.default_rng(3)
  q, kp, vp, table, pos, lens = rows_case(rng, [(26, 6, 32), (29, 1, 30), (31, 1, 32)])
  k_seq, v_seq = sequences(kp, vp, table)
  hot = np.ones(table.shape, bool)
  hot[:, 1:6] = False  # entries 1..5 are cold: 5 pages per row, streamed 2 at a time
  # The host pool's layout: raw bits, page-major [pages, arrays (K, V), H, S, D].
  host = np.ascontiguousarray(np.moveaxis(np.stack([kp, vp]), 2, 0)).view(np.uint32)
  slots = np.zeros((3, 6), np.int32)  # a multiple of the stream chunk (2)
  slots[:, :5] = table[:, 1:6]
  first = np.ones(3, np.int32)
  count = np.full(3, 5, np.int32)

  @jax.jit
  def attend(window):
    qg, state = chunked.init_state(jnp.asarray(q), HKV)
    state = select.paged_state(state, qg, jnp.asarray(kp), jnp.asarray(vp), table, pos, lens,
                               pages_per_chunk=CHUNK, block_valid=hot, impl="jnp", window=window)
    state = streamed.stream_state(state, qg, jnp.asarray(host), 0, 1, slots, first, count, pos,
                                  lens, pages_per_chunk=2, dtype=jnp.float32, window=window)
    return chunked.finish(state, jnp.asarray(q))

  for w in (3, 6, 13, 0):
    np.testing.assert_allclose(np.asarray(attend(jnp.int32(w))),
                               dense_window(q, k_seq, v_seq, pos, lens, w), atol=2e-5,
                               rtol=2e-5, err_msg=f"window={w}")


@pytest.mark.parametrize("impl", ["jnp", "pallas_gpu"])  # (the TPU form: the test above)
def test_paged_kv_under_a_scan_takes_each_layers_traced_window(mesh, impl):
  """``PagedKV.attend`` in a scan over a stack of layers, the window a traced int32 per
  layer (0: a global layer), on the sharded pool (4 data x 2 model shards): each layer
  writes its K/V and attends with its own window, as the rule says."""
  windows = np.array([6, 0, 3], np.int32)
  layers = len(windows)
  config = jaxkv.CacheConfig(model_name="w", num_layers=layers, num_kv_heads=HKV, head_dim=D,
                             page_size=PAGE, pages_per_shard=10, max_pages_per_seq=8,
                             attention_chunk_pages=CHUNK, attention_impl=impl)
  kv = PagedKV(num_kv_heads=HKV, head_dim=D, num_layers=layers)
  init_pages(kv, config, mesh)
  rng = np.random.default_rng(11)
  shape = (layers, *pages_lib.pool_shape(mesh, config))
  k0, v0 = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
  # One row per data shard: MIXED's rows, each on its shard's pages (shard-local ids).
  q, _, _, _, pos, lens = rows_case(rng, MIXED)
  local = np.stack([rng.permutation(10)[:8] for _ in range(4)]).astype(np.int32)
  glob = local + 10 * np.arange(4, dtype=np.int32)[:, None]
  new_k, new_v = (rng.standard_normal((layers, 4, 6, HKV, D)).astype(np.float32)
                  for _ in range(2))
  put = lambda x: jax.device_put(x, jax.NamedSharding(mesh, pages_lib.batch_spec(config, x.ndim)))
  batch = PageBatch(page_table=put(local), positions=put(pos), kv_lens=put(lens), mesh=mesh,
                    config=config)

  @jax.jit
  def run(k_stack, v_stack, q, new_k, new_v, windows):
    def body(carry, xs):
      k_stack, v_stack = carry
      layer, k, v, window = xs
      out, k_stack, v_stack = kv.attend(q, k, v, batch, k_stack, v_stack, layer, window=window)
      return (k_stack, v_stack), out
    xs = (jnp.arange(layers, dtype=jnp.int32), new_k, new_v, windows)
    return jax.lax.scan(body, (k_stack, v_stack), xs)[1]

  stack = lambda x: jax.device_put(x, jax.NamedSharding(mesh, pages_lib.layer_stack_spec(config)))
  outs = np.asarray(run(stack(k0), stack(v0), put(q), new_k, new_v, jnp.asarray(windows)))
  for layer, w in enumerate(windows):
    kp = np.asarray(write_pages_reference(k0[layer], new_k[layer], glob, pos))
    vp = np.asarray(write_pages_reference(v0[layer], new_v[layer], glob, pos))
    k_seq, v_seq = sequences(kp, vp, glob)
    np.testing.assert_allclose(outs[layer], dense_window(q, k_seq, v_seq, pos, lens, w),
                               atol=2e-5, rtol=2e-5, err_msg=f"layer {layer}, window {w}")


def test_no_window_adds_nothing_to_the_graph():
  """``None`` and a Python 0 are the same traced function as a call without a window (no
  cost for a model without windows); a traced window is a different one."""
  (q, kp, vp, table, pos, lens), _ = mixed_case()
  for impl in IMPLS:
    jaxpr = lambda **kw: str(jax.make_jaxpr(functools.partial(
        paged_attention, pages_per_chunk=CHUNK, impl=impl, **kw))(q, kp, vp, table, pos, lens))
    plain = jaxpr()
    assert jaxpr(window=None) == jaxpr(window=0) == plain, impl
    assert jaxpr(window=jnp.int32(0)) != plain, impl


def test_bad_windows_are_refused_with_the_value():
  (q, kp, vp, table, pos, lens), _ = mixed_case()
  for bad, match in ((-1, "window=-1 must be >= 0"), (2.5, "window=2.5 must be"),
                     (jnp.zeros(2, jnp.int32), "window=.* must be"),
                     (jnp.float32(3), "window=.* must be")):
    with pytest.raises(ValueError, match=match):
      paged_attention(q, kp, vp, table, pos, lens, window=bad)
