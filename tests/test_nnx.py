"""The public Flax layer: cache variables are nnx.Cache, filters separate them."""

import jax
import pytest
from flax import nnx

import jaxkv

import helpers


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "looped"])
def test_kv_pages_are_nnx_cache_and_split_off_the_weights(mesh, scan):
  """A scanned model holds one stack of every layer's K and V; a looped one a pool per
  layer. Either way the pages are nnx.Cache, apart from the weights, and the rows the
  tiers move are every layer's K and V."""
  mc = helpers.tiny_model_config(num_layers=3, scan_layers=scan)
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  cc = helpers.cache_config_for(mc)
  jaxkv.nnx.init_pages(model, cc, mesh)
  assert issubclass(jaxkv.nnx.KVPages, nnx.Cache)
  caches = nnx.state(model, nnx.Cache)
  pages = nnx.state(model, jaxkv.nnx.KVPages)
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(pages)
  pool = (cc.num_kv_heads, 4 * cc.pages_per_shard, cc.page_size, cc.head_dim)
  assert len(leaves) == len(jax.tree.leaves(caches)) == (2 if scan else 2 * mc.num_layers)
  for leaf in leaves:
    assert leaf.shape == ((mc.num_layers, *pool) if scan else pool)
  assert not set(map(id, leaves)) & set(map(id, jax.tree.leaves(params)))
  layers = jaxkv.nnx.paged_layers(model)
  assert [l.num_kv_heads for l in layers] == [2] * len(layers)
  assert jaxkv.nnx.num_paged_layers(model) == mc.num_layers
  # Layer i's K and V rows among the 2 x layers rows, in either form: 2i and 2i + 1 (a
  # stack's layers interleaved, so a block's bytes mean the same for both forms).
  step = lambda l: 2 if l.num_layers else 0
  rows = [r for l in layers for i in range(l.layers)
          for r in (l.k_index + step(l) * i, l.v_index + step(l) * i)]
  assert rows == list(range(2 * mc.num_layers))


def test_init_pages_rejects_a_mesh_that_cannot_split_heads(mesh):
  mc = helpers.tiny_model_config(num_heads=2, num_kv_heads=1)
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_kv_heads=1 must be divisible by the model axis"):
    jaxkv.nnx.init_pages(model, helpers.cache_config_for(mc), mesh)
