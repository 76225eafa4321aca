"""Engine features that each have their own tests, combined as a server combines them:
log-probabilities of a request whose prompt came from the cache (device or host), the n
samples of one prompt sharing its blocks, and a GGUF model whose cache went through host
and disk tiers and an Orbax checkpoint.

Every answer is checked against an engine that recomputes every prompt (conftest's
``fresh``: the same tiny model, seed and shapes as most engine tests, whose compiled steps
these share) and, where values are compared, against the NumPy
forward of the same weights (tests/numpy_llama.py) or of the GGUF file
(tests/gguf_fixtures.py). Tolerances: a cached and a computed prefix give the same float32
bits on CPU (measured: 0 difference), so they are compared to 1e-6 (one float32 step at
these magnitudes); float32 against the float64 reference, 2e-4 (measured ~1e-6; see
tests/models/test_model.py).
"""

import jax
import numpy as np
from flax import nnx

import jaxkv
from jaxkv.worker.checkpoint import Checkpointer

import gguf_fixtures as gf
import helpers
import numpy_llama
from numpy_llama import NumpyLlama


PAGE = 4  # helpers.cache_config_for's page size
PROMPT = np.random.default_rng(5).integers(0, 128, 23).tolist()
FULL_BLOCKS = (len(PROMPT) - 1) // PAGE  # what a later request reuses (the last token is computed)


def _tops(handle):
  return [[i for i, _ in top] for _, top in handle.logprobs]


def _values(handle):
  return np.asarray([[lp] + [v for _, v in top] for lp, top in handle.logprobs])


def test_logprobs_after_a_prefix_hit_equal_the_uncached_runs_and_the_numpy_forwards(
    mesh, fresh):
  """The same prompt three times with logprobs: the second reuses the first's blocks from
  device memory, the third from host memory (after every block was offloaded). Their
  tokens, log-probabilities and top alternatives equal the run that computed the whole
  prompt, which equal a log-softmax of the NumPy forward's logits."""
  engine = helpers.make_engine(mesh, tiers=jaxkv.TierConfig(host_pages_per_shard=32))
  sampling = jaxkv.SamplingParams(max_new_tokens=4, logprobs=3)
  want = fresh.submit(PROMPT, sampling)
  want.result()
  lsm = NumpyLlama(engine.model).log_softmax(PROMPT + want.tokens[:-1])[len(PROMPT) - 1:]
  assert _tops(want) == [np.argsort(-row, kind="stable")[:3].tolist() for row in lsm]
  ids = np.asarray([[t] + top for t, top in zip(want.tokens, _tops(want))])
  np.testing.assert_allclose(_values(want), np.take_along_axis(lsm, ids, axis=1), atol=2e-4)
  first = engine.submit(PROMPT, sampling)
  first.result()
  assert first.cached_tokens == 0
  for tier in (jaxkv.Tier.DEVICE, jaxkv.Tier.HOST):
    if tier == jaxkv.Tier.HOST:  # every block leaves the device: the host tier holds them
      assert engine.offload() > 0 and engine.flush(30) == 0
      assert engine.occupancy()["cached_blocks"]["device"] == 0
    engine.reset_stats()
    again = engine.submit(PROMPT, sampling)
    again.result()
    hits = engine.stats()["hits"]
    assert again.cached_tokens == FULL_BLOCKS * PAGE, (tier, again.cached_tokens)
    assert hits[tier.name.lower()] == sum(hits.values()) == FULL_BLOCKS, (tier, hits)
    for got in (first, again):
      assert got.tokens == want.tokens and _tops(got) == _tops(want), tier
      np.testing.assert_allclose(_values(got), _values(want), atol=1e-6, rtol=0, err_msg=tier.name)
  helpers.no_refs(engine, (jaxkv.Tier.DEVICE, jaxkv.Tier.HOST))


def test_n_samples_of_one_prompt_share_its_blocks_and_each_equals_its_seed_alone(fresh):
  """n = 3 samples of one prompt submitted together, as the server submits a request's n
  (seeds s, s+1, s+2): on one data shard the first computes the prompt and the others wait
  for its blocks and reuse them; the device holds the prompt's blocks once (and each
  sample's own decode blocks). Each sample's tokens equal its seed's run alone on an
  engine that recomputes everything. (On several data shards the samples start on
  different shards and compute the prompt in parallel, by design: no sharing to check.)"""
  one_shard = jaxkv.make_mesh(data=1, model=2, devices=jax.devices()[:2])
  engine = helpers.make_engine(one_shard)
  samplings = [jaxkv.SamplingParams(max_new_tokens=5, temperature=0.9, top_p=0.95, seed=11 + j)
               for j in range(3)]
  handles = [engine.submit(PROMPT, s) for s in samplings]
  for h in handles:
    h.result()
  shared = FULL_BLOCKS * PAGE
  assert [h.cached_tokens for h in handles] == [0, shared, shared]
  stats = engine.stats()
  assert stats["shared_prefix_waits"] == 2 and stats["hits"]["device"] == 2 * FULL_BLOCKS
  # A sequence's full blocks: its prompt and answer but the last token (never fed back).
  own = [(len(PROMPT) + len(h.tokens) - 1) // PAGE - FULL_BLOCKS for h in handles]
  assert engine.occupancy()["cached_blocks"]["device"] == FULL_BLOCKS + sum(own)
  alone = [fresh.generate([PROMPT], s)[0] for s in samplings]
  assert [h.tokens for h in handles] == alone
  assert len({tuple(a) for a in alone}) == 3  # the seeds do differ
  helpers.no_refs(engine)


# Short prompts: a follow-up (prompt, answer, 3 more, 4 new tokens) stays within 8 pages,
# the page-table width the other tests here compile.
PROMPTS = [PROMPT[:13], list(range(50, 60)) + list(range(5, 11)), list(range(90, 107))]


def test_a_gguf_model_through_host_and_disk_tiers_and_a_checkpoint_equals_recompute(
    mesh, fresh, tmp_path):
  """A GGUF model's cache with host and disk tiers (write-through). Engine a answers two
  prompts, offloads their blocks to host memory and saves an Orbax checkpoint (its host
  blocks), then answers a third (its blocks reach the disk store only). Engine b, over the
  same file and disk store, restores the checkpoint into host memory: follow-ups of the
  first two hit host memory, the third's hits disk, and every answer equals
  recomputation's (an engine over the same weights, nothing cached) and the GGUF file's
  own NumPy reference."""
  mc = helpers.tiny_model_config()
  weights = numpy_llama.hf_weights(jaxkv.models.Llama(mc, rngs=nnx.Rngs(0)))  # fresh's
  path = gf.write_gguf(str(tmp_path / "tiny.gguf"),
                       {**numpy_llama.hf_config(mc), "max_position_embeddings": 2048},
                       {k: v.astype(np.float32) for k, v in weights.items()})
  tiers = jaxkv.TierConfig(host_pages_per_shard=32, disk_kvstore=str(tmp_path / "disk"),
                           disk_pages=64, write_policy="write_through")

  def engine():
    model = jaxkv.models.from_pretrained(path, dtype="float32", mesh=mesh)
    cache = jaxkv.KVCache(helpers.cache_config_for(model.cfg), mesh, tiers)
    return jaxkv.Engine(model, cache, scheduler=jaxkv.SchedulerConfig(decision="fetch"))

  a = engine()
  want = a.generate(PROMPTS[:2], 4)
  # A sequence's full blocks are cached: its prompt and answer but the last token.
  blocks = [(len(p) + len(w) - 1) // PAGE for p, w in zip(PROMPTS, want)]
  a.offload()
  assert a.flush(30) == 0
  held = a.occupancy()["cached_blocks"]
  assert held["device"] == 0 and held["host"] == held["disk"] == sum(blocks), held
  step = Checkpointer(a.cache, str(tmp_path / "ckpt")).save(wait=True)
  want += a.generate(PROMPTS[2:], 4)  # after the checkpoint: on disk (and a's device) only
  assert a.flush(30) == 0
  assert want == fresh.generate(PROMPTS, 4)  # the file holds fresh's weights
  blocks.append((len(PROMPTS[2]) + len(want[2]) - 1) // PAGE)
  b = engine()
  counts = Checkpointer(b.cache, str(tmp_path / "ckpt")).restore(into="host")
  assert counts["step"] == step and counts["failed_checksum"] == 0
  assert counts["placed"] == sum(blocks[:2]), counts
  follow = [p + w + [7, 8, 9] for p, w in zip(PROMPTS, want)]
  got = b.generate(follow, 4)
  assert got == fresh.generate(follow, 4)
  assert got[0] == gf.GGUFReference(path).greedy(follow[0], 4)[0]
  hits = b.stats()["hits"]
  assert (hits["host"], hits["disk"], hits["device"]) == (sum(blocks[:2]), blocks[2], 0), hits
  b.cache.index.check_invariants()
