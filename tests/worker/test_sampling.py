"""Per-request sampling and stops: SamplingParams, the in-step sampler, and generation."""

import numpy as np
import pytest

import helpers
import jaxkv
from jaxkv.worker import sampling
from jaxkv.manager.index import Tier


def rows(n, **kw):
  r = sampling.RowSampling.greedy(n)
  for name, value in kw.items():
    getattr(r, name)[:] = value
  return r


def test_sampler_keeps_to_top_k_and_top_p_and_depends_only_on_seed_and_position():
  logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]] * 64, np.float32))
  positions = np.arange(64, dtype=np.int32)
  free = np.asarray(sampling.next_tokens(logits, rows(64, temperature=1.0), positions))
  # Untruncated, every token is drawn (so the restrictions below do remove some), each
  # about as often as its probability says: within 4 standard deviations of 64 draws.
  assert set(free.tolist()) == {0, 1, 2, 3}
  p = np.array([0.5, 0.3, 0.15, 0.05])
  counts = np.bincount(free, minlength=4)
  assert (np.abs(counts - 64 * p) <= 4 * np.sqrt(64 * p * (1 - p))).all(), counts
  top2 = np.asarray(sampling.next_tokens(logits, rows(64, temperature=1.0, top_k=2), positions))
  assert set(top2.tolist()) <= {0, 1} and len(set(top2.tolist())) == 2
  nucleus = np.asarray(sampling.next_tokens(logits, rows(64, temperature=1.0, top_p=0.7),
                                            positions))
  assert set(nucleus.tolist()) <= {0, 1}  # 0.5 + 0.3 reaches 0.7
  greedy = np.asarray(sampling.next_tokens(logits, rows(64), positions))
  assert (greedy == 0).all()
  # The same seed and position give the same token in any row of any batch.
  again = np.asarray(sampling.next_tokens(logits[:8][::-1], rows(8, temperature=1.0),
                                          positions[:8][::-1]))
  assert again.tolist() == free[:8][::-1].tolist()
  other = np.asarray(sampling.next_tokens(logits, rows(64, temperature=1.0, seed=9), positions))
  assert other.tolist() != free.tolist()


@pytest.mark.parametrize("kw,match", [
    (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(temperature=-1.0), "temperature=-1.0"),
    (dict(top_k=-2), "top_k=-2"), (dict(top_p=0.0), "top_p=0.0"), (dict(seed=-1), "seed=-1"),
    (dict(stop_token_ids=(1, -4)), "stop_token_ids")])
def test_bad_sampling_params_are_refused_naming_the_value(kw, match):
  with pytest.raises(ValueError, match=match):
    jaxkv.SamplingParams(**kw)


@pytest.fixture(scope="module")
def engines(mesh):
  return helpers.reuse_and_fresh(mesh)


def test_stops_and_lengths_per_request_equal_recompute_and_free_every_page(engines):
  engine, fresh = engines
  rng = np.random.default_rng(1)
  prompts = [rng.integers(1, 128, int(n)).tolist() for n in (9, 14, 21, 6, 17)]
  full = fresh.generate(prompts, 10)
  # Stop each request at a token its greedy answer produces (or never), lengths differ.
  params = []
  for i, answer in enumerate(full):
    stop = (answer[3 + i % 3],) if i != 4 else ()
    params.append(jaxkv.SamplingParams(max_new_tokens=10 - i, stop_token_ids=stop))
  want = []
  for answer, sp in zip(full, params):
    cut = answer[:sp.max_new_tokens]
    for j, t in enumerate(cut):
      if t in sp.stop_token_ids:
        cut = cut[:j + 1]
        break
    want.append(cut)
  assert fresh.generate(prompts, params) == want
  before = engine.stats()["generated_tokens"]
  assert engine.generate(prompts, params) == want  # cold
  assert engine.generate(prompts, params) == want  # every prompt's blocks are hits now
  assert engine.stats()["generated_tokens"] - before == 2 * sum(map(len, want))
  assert engine.stats()["hits"]["device"] > 0
  index = engine.cache.index
  index.check_invariants()
  assert all(index.refcount(s, p, Tier.DEVICE) == 0 for s in range(4) for p in range(24))


def test_seeded_sampling_is_the_same_with_and_without_cache_hits(engines):
  engine, fresh = engines
  prompt = list(range(3, 30))
  sp = jaxkv.SamplingParams(max_new_tokens=8, temperature=0.9, top_k=40, top_p=0.95, seed=11)
  want = fresh.generate([prompt], sp)[0]
  hits = engine.stats()["hits"]["device"]
  assert engine.generate([prompt], sp)[0] == want
  assert engine.generate([prompt, [5, 6, 7]], [sp, jaxkv.SamplingParams(max_new_tokens=3)]
                         )[0] == want  # reused, and batched beside a greedy request
  assert engine.stats()["hits"]["device"] > hits
  other = engine.generate([prompt], jaxkv.SamplingParams(max_new_tokens=8, temperature=0.9,
                                                         top_k=40, top_p=0.95, seed=12))
  assert other[0] != want
  greedy = fresh.generate([prompt], 8)[0]
  assert want != greedy  # it really sampled
  assert fresh.generate([prompt], jaxkv.SamplingParams(max_new_tokens=8, temperature=0.9,
                                                       top_k=1, seed=11))[0] == greedy


def test_a_stop_token_outside_the_vocabulary_is_refused(engines):
  engine, _ = engines
  digest = engine.cache.index.digest()
  with pytest.raises(ValueError, match=r"stop_token_ids \[500\] are outside the vocabulary"):
    engine.generate([[1, 2, 3]], jaxkv.SamplingParams(stop_token_ids=(500,)))
  with pytest.raises(ValueError, match="list of 2"):
    engine.generate([[1, 2, 3], [4, 5]], [jaxkv.SamplingParams()])
  assert engine.cache.index.digest() == digest
