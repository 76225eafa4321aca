"""The model's weights are part of the cache's key: nothing cached under other weights is used."""

import dataclasses
import os

import pytest
from flax import nnx

import helpers
import jaxkv
from jaxkv import identity
from jaxkv.worker.checkpoint import Checkpointer


def digest(seed=0, **overrides):
  return identity.weights_digest(jaxkv.models.Llama(helpers.tiny_model_config(**overrides),
                                                    rngs=nnx.Rngs(seed)))


def test_the_digest_follows_weights_and_settings_not_the_instance():
  a = digest(0)
  assert a == digest(0) and len(a) == 64
  assert digest(1) != a  # other random weights
  assert digest(0, rope_theta=500000.0) != a  # same weights, other positions: other KV
  model = jaxkv.models.Llama(helpers.tiny_model_config(), rngs=nnx.Rngs(0))
  kernel = model.layers.mlp.down.kernel  # [layers, mlp, hidden]: the last layer's last row
  kernel.set_value(kernel.get_value().at[-1, -1].add(1e-3))  # one sampled value
  assert identity.weights_digest(model) != a


def tiered_engine(mesh, tmp_path, seed, **cache_kw):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12, **cache_kw)
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"),
                           disk_pages=64, write_policy="write_through")
  return helpers.make_engine(mesh, mc, seed=seed, cache=cc, tiers=tiers, max_seqs_per_shard=1)


PROMPT = list(range(1, 30))


def test_a_store_or_checkpoint_of_other_weights_is_never_used(mesh, tmp_path):
  first = tiered_engine(mesh, tmp_path, seed=0)
  first.generate([PROMPT], 3)
  first.flush(30)
  Checkpointer(first.cache, str(tmp_path / "ckpt")).save(wait=True)
  assert first.cache.config.weights_digest == digest(0)
  # Same name, shapes and directory; other weights (a fine-tune, another seed).
  tuned = tiered_engine(mesh, tmp_path, seed=1)
  assert tuned.cache.disk_recovered["adopted"] == 0
  # The first model's records are another fingerprint's: neither read nor deleted.
  assert tuned.cache.disk_recovered["deleted"] == 0
  assert tuned.cache.worker.disk.prefix_path != first.cache.worker.disk.prefix_path
  assert len(os.listdir(first.cache.worker.disk.prefix_path)) >= 7
  fresh = helpers.make_engine(mesh, helpers.tiny_model_config(), seed=1, prefix_reuse=False)
  assert tuned.generate([PROMPT], 3) == fresh.generate([PROMPT], 3)
  assert tuned.stats()["hits"]["disk"] == 0
  with pytest.raises(ValueError, match="weights_digest: checkpoint"):
    Checkpointer(tuned.cache, str(tmp_path / "ckpt")).restore()
  # The same weights again: the store it wrote comes back.
  tuned.flush(30)
  again = tiered_engine(mesh, tmp_path, seed=1)
  assert again.cache.disk_recovered["adopted"] >= 7
  assert again.generate([PROMPT], 3) == fresh.generate([PROMPT], 3)
  assert again.stats()["hits"]["disk"] == 7


def test_a_given_digest_must_match_the_model(mesh, tmp_path):
  good = tiered_engine(mesh, tmp_path, seed=0, weights_digest=digest(0))
  assert good.cache.config.weights_digest == digest(0)
  with pytest.raises(ValueError, match="belongs to other weights"):
    tiered_engine(mesh, tmp_path, seed=1, weights_digest=digest(0))
  with pytest.raises(ValueError, match="weights_digest='a b' must be a string without spaces"):
    dataclasses.replace(good.cache.config, weights_digest="a b")
