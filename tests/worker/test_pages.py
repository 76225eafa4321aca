"""The sharded page pool: shard-local ops, no collectives, donation in place."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

import jaxkv
from jaxkv.worker import pages as pages_lib
from jaxkv.ops import paged_attention_reference, write_pages_reference


def cfg(**kw):
  base = dict(model_name="m", num_layers=1, num_kv_heads=2, head_dim=8, page_size=4,
              pages_per_shard=6, max_pages_per_seq=4, attention_chunk_pages=2)
  base.update(kw)
  return jaxkv.CacheConfig(**base)


def put(mesh, c, x):
  return jax.device_put(x, NamedSharding(mesh, pages_lib.batch_spec(c, np.ndim(x))))


def step_inputs(rng, c, num_shards, rows_per_shard, q_len):
  """A batch whose row b lives on shard b // rows_per_shard with shard-local page ids."""
  b = num_shards * rows_per_shard
  local = np.stack([rng.permutation(c.pages_per_shard)[:c.max_pages_per_seq]
                    for _ in range(b)]).astype(np.int32)
  lens = rng.integers(q_len, c.max_pages_per_seq * c.page_size + 1, size=b).astype(np.int32)
  positions = (lens[:, None] - q_len + np.arange(q_len)[None]).astype(np.int32)
  positions[-1] = -1  # one padding row
  lens[-1] = 0
  q = rng.standard_normal((b, q_len, 4, c.head_dim)).astype(np.float32)
  k = rng.standard_normal((b, q_len, c.num_kv_heads, c.head_dim)).astype(np.float32)
  v = rng.standard_normal((b, q_len, c.num_kv_heads, c.head_dim)).astype(np.float32)
  glob = local + (np.arange(b) // rows_per_shard * c.pages_per_shard)[:, None].astype(np.int32)
  return q, k, v, local, glob, positions, lens


@pytest.mark.parametrize("q_len", [1, 3])
def test_sharded_write_and_attend_equals_global_reference(mesh, q_len):
  c = cfg()
  rng = np.random.default_rng(q_len)
  shape = pages_lib.pool_shape(mesh, c)
  kp0 = rng.standard_normal(shape).astype(np.float32)
  vp0 = rng.standard_normal(shape).astype(np.float32)
  q, k, v, local, glob, pos, lens = step_inputs(rng, c, 4, 2, q_len)
  kp = jax.device_put(kp0, pages_lib.pool_sharding(mesh, c))
  vp = jax.device_put(vp0, pages_lib.pool_sharding(mesh, c))
  fn = jax.jit(functools.partial(pages_lib.write_and_attend, mesh=mesh, config=c))
  out, kp1, vp1 = fn(put(mesh, c, q), put(mesh, c, k), put(mesh, c, v), kp, vp,
                     put(mesh, c, local), put(mesh, c, pos), put(mesh, c, lens))
  # The same step on one device with global page ids.
  want_k = write_pages_reference(kp0, k, glob, pos)
  want_v = write_pages_reference(vp0, v, glob, pos)
  want = paged_attention_reference(q, want_k, want_v, glob, pos, lens)
  np.testing.assert_array_equal(np.asarray(kp1), np.asarray(want_k))
  np.testing.assert_array_equal(np.asarray(vp1), np.asarray(want_v))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=1e-5, rtol=1e-5)
  assert kp1.sharding.is_equivalent_to(pages_lib.pool_sharding(mesh, c), 4)


def _hlo(fn, *args):
  return fn.lower(*args).compile().as_text()


def test_compiled_write_gather_scatter_have_no_collectives(mesh):
  c = cfg()
  rng = np.random.default_rng(0)
  q, k, v, local, _, pos, lens = step_inputs(rng, c, 4, 2, 2)
  kp = pages_lib.zeros_pool(mesh, c)
  vp = pages_lib.zeros_pool(mesh, c)
  write = jax.jit(functools.partial(pages_lib.write_and_attend, mesh=mesh, config=c),
                  donate_argnums=(3, 4))
  texts = {
      "write_and_attend": _hlo(write, put(mesh, c, q), put(mesh, c, k), put(mesh, c, v), kp, vp,
                               put(mesh, c, local), put(mesh, c, pos), put(mesh, c, lens)),
  }
  ids = put(mesh, c, np.zeros((4, 3), np.int32))
  texts["gather"] = _hlo(pages_lib._gather_fn(mesh, c), kp, ids)
  vals = pages_lib.gather_pages(kp, ids, mesh=mesh, config=c)
  texts["scatter"] = _hlo(pages_lib._scatter_fn(mesh, c), kp, ids, vals)
  for name, text in texts.items():
    found = [op for op in pages_lib.COLLECTIVE_OPS if op in text]
    assert not found, f"{name} compiled with collectives {found}"
  # Sanity check of the detector: a global gather on the sharded page axis does need one.
  glob = jax.jit(lambda p, i: p[:, i], in_shardings=(pages_lib.pool_sharding(mesh, c), None))
  text = _hlo(glob, kp, jnp.arange(5, dtype=jnp.int32) * 5)
  assert any(op in text for op in pages_lib.COLLECTIVE_OPS)


def test_gather_scatter_round_trip_and_donation_in_place(mesh):
  c = cfg()
  rng = np.random.default_rng(3)
  shape = pages_lib.pool_shape(mesh, c)
  src = jax.device_put(rng.standard_normal(shape).astype(np.float32),
                       pages_lib.pool_sharding(mesh, c))
  dst = pages_lib.zeros_pool(mesh, c)
  ids = np.stack([rng.permutation(c.pages_per_shard)[:3] for _ in range(4)]).astype(np.int32)
  dev_ids = put(mesh, c, ids)
  got = pages_lib.gather_pages(src, dev_ids, mesh=mesh, config=c)
  src_np = np.asarray(src)
  for s in range(4):
    np.testing.assert_array_equal(np.asarray(got)[:, s * 3:(s + 1) * 3],
                                  src_np[:, s * c.pages_per_shard + ids[s]])
  pointers = [x.data.unsafe_buffer_pointer() for x in dst.addressable_shards]
  out = pages_lib.scatter_pages(dst, dev_ids, got, mesh=mesh, config=c)
  assert dst.is_deleted()  # donated
  assert [x.data.unsafe_buffer_pointer() for x in out.addressable_shards] == pointers
  out_np = np.asarray(out)
  for s in range(4):
    np.testing.assert_array_equal(out_np[:, s * c.pages_per_shard + ids[s]],
                                  src_np[:, s * c.pages_per_shard + ids[s]])
  mask = np.ones(out_np.shape[1], bool)
  for s in range(4):
    mask[s * c.pages_per_shard + ids[s]] = False
  assert not out_np[:, mask].any()  # nothing else was touched


def test_mesh_validation_errors(mesh):
  with pytest.raises(ValueError, match="num_kv_heads=1 must be divisible by the model axis"):
    pages_lib.validate_mesh(mesh, cfg(num_kv_heads=1))
  with pytest.raises(ValueError, match="lack CacheConfig axis 'batch'"):
    pages_lib.validate_mesh(mesh, cfg(data_axis="batch"))
  # Explicit axes asked for by name (jax.make_mesh's default has changed across
  # versions): every such axis is named in the refusal, and Auto axes pass.
  auto, explicit = jax.sharding.AxisType.Auto, jax.sharding.AxisType.Explicit
  both = jax.make_mesh((4, 2), ("data", "model"), axis_types=(explicit, explicit))
  with pytest.raises(ValueError, match=r"mesh axes \['data', 'model'\] are Explicit"):
    pages_lib.validate_mesh(both, cfg())
  one = jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, explicit))
  with pytest.raises(ValueError, match=r"mesh axes \['model'\] are Explicit"):
    pages_lib.validate_mesh(one, cfg())
  pages_lib.validate_mesh(jax.make_mesh((4, 2), ("data", "model"), axis_types=(auto, auto)),
                          cfg())
  with pytest.raises(ValueError, match="needs 6 devices"):
    jaxkv.make_mesh(data=3, model=2)
