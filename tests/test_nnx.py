"""The public Flax layer: cache variables are nnx.Cache, filters separate them."""

import jax
import pytest
from flax import nnx

import jaxkv

import helpers


def test_kv_pages_are_nnx_cache_and_split_off_the_weights(mesh):
  mc = helpers.tiny_model_config()
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  cc = helpers.cache_config_for(mc)
  jaxkv.nnx.init_pages(model, cc, mesh)
  assert issubclass(jaxkv.nnx.KVPages, nnx.Cache)
  caches = nnx.state(model, nnx.Cache)
  pages = nnx.state(model, jaxkv.nnx.KVPages)
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(pages)
  assert len(leaves) == 2 * mc.num_layers == len(jax.tree.leaves(caches))
  for leaf in leaves:
    assert leaf.shape == (cc.num_kv_heads, 4 * cc.pages_per_shard, cc.page_size, cc.head_dim)
  assert not set(map(id, leaves)) & set(map(id, jax.tree.leaves(params)))
  assert [l.num_kv_heads for l in jaxkv.nnx.paged_layers(model)] == [2] * mc.num_layers


def test_init_pages_rejects_a_mesh_that_cannot_split_heads(mesh):
  mc = helpers.tiny_model_config(num_heads=2, num_kv_heads=1)
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads=1 must be divisible by the model axis"):
    jaxkv.nnx.init_pages(model, helpers.cache_config_for(mc), mesh)
