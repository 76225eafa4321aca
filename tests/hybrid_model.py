"""A small random Gemma 3 for the tests of hybrid attention's window group (6 layers, every
third global, a 40-token window over 8-token pages: 5 window blocks), so that prompts of a
few hundred tokens cross the window many times; and how its answers are compared."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv.models import gemma3

WINDOW, PAGE = 40, 8
CFG = gemma3.Gemma3Config(vocab_size=128, hidden_size=64, num_layers=6, num_heads=4,
                          num_kv_heads=1, head_dim=32, mlp_dim=128, sliding_window=WINDOW,
                          global_every=3)


@pytest.fixture(scope="module")
def one():
  """One CPU device: the mesh the window tests' engines run on (a test module imports it)."""
  return jaxkv.make_mesh(data=1, model=1, devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def recompute(one):  # pylint: disable=redefined-outer-name
  """The reference: the all-global layout, every prompt computed from its first token."""
  return engine(one, groups=False, reuse=False, max_pages_per_seq=80)


def engine(mesh, *, groups=True, reuse=True, tiers=None, rows=2, key=None, stream=None,
           costs=None, **cache):
  """The small Gemma 3 over ``mesh``; lower-tier hits always fetched, or, with ``costs``,
  as the plan decides with them."""
  model = gemma3.Gemma3(dataclasses.replace(CFG, kv_groups=groups), rngs=nnx.Rngs(0))
  # Gemma's output head is its embedding, scaled by sqrt(hidden) on the way in: at the
  # init's unit scale every answer token has probability 1. At 0.3 the log-probabilities
  # are a few units apart and depend on every layer.
  model.embed.embedding.set_value(model.embed.embedding.get_value() * 0.3)
  budgets = dict(page_size=PAGE, pages_per_shard=96, max_pages_per_seq=48,
                 attention_chunk_pages=4)
  cc = jaxkv.CacheConfig.for_model(model, **{**budgets, **cache})
  return jaxkv.Engine(model, jaxkv.KVCache(cc, mesh, tiers, deployment_key=key),
                      jaxkv.EngineConfig(max_seqs_per_shard=rows, prefill_chunk_pages=2,
                                         prefix_reuse=reuse),
                      scheduler=jaxkv.SchedulerConfig(decision="cost" if costs else "fetch"),
                      stream=stream, costs=costs)


def costs(link: str, bytes_per_s: float):
  """Costs with ``link`` at ``bytes_per_s``, the other links fast, and prefill at 1 ms a
  token (what a test that plans from costs gives its engine)."""
  from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve
  links = {name: LinkCost(0.0, 1e10)
           for name in ("host_to_device", "disk_to_host", "pool_to_host", "remote_to_host")}
  return CostModel(links={**links, link: LinkCost(0.0, bytes_per_s)},
                   prefill=PrefillCurve(0.0, 1e-3, 0.0))


def window_loads(before: dict, after: dict, source: str) -> tuple[int, int, int]:
  """Window blocks loaded, failed and skipped from ``source`` (``disk``, ``pool``,
  ``remote``) between two of an engine's ``stats()``."""
  return tuple(after[f"window_{source}_{what}"] - before[f"window_{source}_{what}"]
               for what in ("loaded", "failed", "skipped"))


def prompt(seed: int, n: int) -> list[int]:
  return np.random.default_rng(seed).integers(1, CFG.vocab_size, n).tolist()


def run(e, p, n):
  """``e``'s greedy answer to ``p`` with each token's log-probability (a random model's
  tokens hardly depend on a few wrong keys; its log-probabilities do)."""
  h = e.submit(p, jaxkv.SamplingParams(max_new_tokens=n, logprobs=1))
  h.result()
  return h


def assert_same(h, want):
  assert h.tokens == want.tokens
  got = np.array([lp for lp, _ in h.logprobs])
  ref = np.array([lp for lp, _ in want.logprobs])
  assert np.abs(got - ref).max() < 1e-5, np.abs(got - ref).max()
