"""Engine: prefix reuse never changes outputs; isolation, eviction, refusal, bad input."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jaxkv
from jaxkv.tools import workloads

import helpers


def run_chat(engines, spec, tenant="default"):
  """Runs a chat on several engines in lockstep; returns per-engine token and logit lists."""
  chat = workloads.Chat(spec)
  tokens = [[] for _ in engines]
  logits = [[] for _ in engines]
  for turn in range(spec.turns):
    prompts = chat.prompts(turn)
    for i, e in enumerate(engines):
      out, lg = e.generate(prompts, spec.max_new_tokens, tenant, return_logits=True)
      tokens[i].append(out)
      logits[i].append(lg)
    chat.record(turn, tokens[0][-1])
  return tokens, logits


CASES = {
    # name: (model overrides, cache overrides, engine overrides, users, bitwise expected)
    "gqa_page4_chunk2": (dict(), dict(page_size=4), dict(prefill_chunk_pages=2,
                                                          max_seqs_per_shard=2), 5, False),
    "mha_bf16_page8_chunk1": (dict(num_heads=2, num_kv_heads=2, dtype="bfloat16"),
                              dict(page_size=8, max_pages_per_seq=16, attention_chunk_pages=2),
                              dict(prefill_chunk_pages=1, max_seqs_per_shard=1), 6, True),
    "1layer_gqa4_page16_waves": (dict(num_layers=1, num_heads=8, num_kv_heads=2),
                                 dict(page_size=16, max_pages_per_seq=8, attention_chunk_pages=8),
                                 dict(prefill_chunk_pages=4, max_seqs_per_shard=1,
                                      batching="static"), 9, False),
    # jaxkv's Pallas kernel in both forms (Pallas' interpreters here): the same guarantees.
    "pallas_tpu_gqa_page4_chunk2": (dict(), dict(page_size=4, attention_impl="pallas_tpu"),
                                    dict(prefill_chunk_pages=2, max_seqs_per_shard=2), 5, False),
    "pallas_gpu_mha_bf16_page8_chunk1": (dict(num_heads=2, num_kv_heads=2, dtype="bfloat16"),
                                         dict(page_size=8, max_pages_per_seq=16,
                                              attention_chunk_pages=2,
                                              attention_impl="pallas_gpu"),
                                         dict(prefill_chunk_pages=1, max_seqs_per_shard=1), 6,
                                         True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_multi_turn_reuse_equals_recompute_from_scratch(mesh, name):
  model_kw, cache_kw, engine_kw, users, bitwise = CASES[name]
  mc = helpers.tiny_model_config(**model_kw)
  cc = helpers.cache_config_for(mc, **cache_kw)
  reuse = helpers.make_engine(mesh, mc, cache=cc, **engine_kw)
  fresh = helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=False, **engine_kw)
  spec = workloads.ChatSpec(users=users, turns=3, system_prompt_tokens=2 * cc.page_size + 1,
                            user_tokens=(3, 2 * cc.page_size), max_new_tokens=5,
                            vocab_size=mc.vocab_size, seed=7)
  (tok_r, tok_f), (lg_r, lg_f) = run_chat([reuse, fresh], spec)
  assert tok_r == tok_f
  for turn_r, turn_f in zip(lg_r, lg_f):
    for a, b in zip(turn_r, turn_f):
      if bitwise:
        np.testing.assert_array_equal(a, b)
      else:
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  s_r, s_f = reuse.stats(), fresh.stats()
  assert s_f["hits"]["device"] == 0 and s_f["hit_tokens"] == 0
  assert s_r["hits"]["device"] > 0
  assert s_r["computed_tokens"] < s_f["computed_tokens"]
  assert s_r["computed_tokens"] + s_r["hit_tokens"] == s_r["prompt_tokens"]
  assert len(s_r["ttft_s"]) == users * spec.turns
  if engine_kw.get("batching") == "static":
    if users > mesh.shape["data"] * engine_kw["max_seqs_per_shard"]:
      assert s_r["waves"] > spec.turns  # more requests than one wave holds
  else:  # continuous: requests joined as rows freed up, one step at a time
    assert s_r["waves"] == 0 and s_r["steps"] >= spec.turns * spec.max_new_tokens
  reuse.cache.index.check_invariants()
  for s in range(reuse.cache.num_shards):  # every reference was released
    assert all(reuse.cache.index.refcount(s, p) == 0 for p in range(cc.pages_per_shard))


def test_tenants_never_share_blocks_but_a_tenant_reuses_its_own(mesh):
  engine = helpers.make_engine(mesh)
  page = engine.cache.config.page_size
  prompt = list(range(1, 5 * page + 2))
  a1 = engine.generate([prompt], 4, "alice")
  assert engine.stats()["hits"]["device"] == 0
  b1 = engine.generate([prompt], 4, "bob")
  assert engine.stats()["hits"]["device"] == 0  # same tokens, other tenant: no sharing
  a2 = engine.generate([prompt], 4, "alice")
  assert engine.stats()["hits"]["device"] == 5  # all full blocks but the one holding the last token
  assert a1 == b1 == a2


def test_full_prompt_hit_still_computes_last_token(mesh):
  engine = helpers.make_engine(mesh)
  page = engine.cache.config.page_size
  prompt = list(range(1, 3 * page + 1))  # exactly 3 full blocks
  first, lg1 = engine.generate([prompt], 3, return_logits=True)
  second, lg2 = engine.generate([prompt], 3, return_logits=True)
  s = engine.stats()
  assert s["hits"]["device"] == 2  # block 3 holds the last prompt token: recomputed
  assert first == second
  np.testing.assert_allclose(lg1[0], lg2[0], atol=1e-5)


def test_eviction_under_pressure_keeps_outputs_exact(mesh):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=10, max_pages_per_seq=10)
  small = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2)
  fresh = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=False)
  rng = np.random.default_rng(5)
  shared = rng.integers(1, 100, 9).tolist()
  for round_ in range(4):
    prompts = [shared + rng.integers(1, 100, int(rng.integers(4, 20))).tolist()
               for _ in range(6)]
    assert small.generate(prompts, 4) == fresh.generate(prompts, 4), round_
  assert small.stats()["evictions"] > 0
  assert small.stats()["hits"]["device"] > 0
  small.cache.index.check_invariants()


def test_request_refused_when_pages_are_held_and_cache_stays_consistent(mesh):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=8, max_pages_per_seq=8)
  engine = helpers.make_engine(mesh, mc, cache=cc)
  index = engine.cache.index
  engine.generate([list(range(1, 10))], 2)
  held = [index.allocate(s, 6) for s in range(4)]  # someone else holds 6 of 8 pages per shard
  digest = index.digest()
  with pytest.raises(jaxkv.CapacityError, match="needs 4 device pages but at most 2"):
    engine.generate([list(range(1, 14)), [1, 2]], 4)
  assert index.digest() == digest  # nothing was allocated, acquired or evicted
  index.check_invariants()
  assert engine.generate([[1, 2, 3]], 2)  # small requests still run
  for s, pages in enumerate(held):
    index.release(s, pages)
  index.check_invariants()


@pytest.mark.parametrize("prompts,max_new,tenant,match", [
    ([], 2, "t", "non-empty list"),
    ([[1, 2], []], 2, "t", "prompt 1 must be a non-empty"),
    ([[1, 500]], 2, "t", r"prompt 0 token 1 is 500, outside the vocabulary \[0, 128\)"),
    ([[1, -3]], 2, "t", "outside the vocabulary"),
    ([[1.0, 2.0]], 2, "t", "dtype float64; token ids must be integers"),
    ([[1, 2]], 0, "t", "max_new_tokens=0 must be an integer >= 1"),
    ([[1, 2]], 2, "", "tenant=''"),
    ([list(range(1, 120))], 20, "t", "more than a sequence can hold"),
])
def test_bad_input_is_refused_with_a_clear_error(mesh, prompts, max_new, tenant, match):
  engine = helpers.make_engine(mesh)
  digest = engine.cache.index.digest()
  with pytest.raises(ValueError, match=match):
    engine.generate(prompts, max_new, tenant)
  assert engine.cache.index.digest() == digest


def test_config_errors_name_value_and_fix():
  mc = helpers.tiny_model_config()
  with pytest.raises(ValueError, match=r"page_size=0 must be a positive integer"):
    helpers.cache_config_for(mc, page_size=0)
  with pytest.raises(ValueError, match=r"dtype='int8' is not supported"):
    helpers.cache_config_for(mc, dtype="int8")
  with pytest.raises(ValueError, match="max_pages_per_seq=80 exceeds pages_per_shard=64"):
    helpers.cache_config_for(mc, max_pages_per_seq=80)
  with pytest.raises(ValueError, match="model_name"):
    helpers.cache_config_for(mc, model_name=" ")
  with pytest.raises(ValueError, match="max_seqs_per_shard=0"):
    jaxkv.EngineConfig(max_seqs_per_shard=0)


@pytest.mark.parametrize("field,wrong", [("num_layers", 3), ("num_kv_heads", 4),
                                         ("head_dim", 16)])
def test_an_engine_refuses_a_cache_without_its_models_shapes(mesh, field, wrong):
  """At construction, before a page is allocated: the field, both values and the fix."""
  mc = helpers.tiny_model_config()
  right = getattr(mc, field)
  cache = dataclasses.replace(helpers.cache_config_for(mc), **{field: wrong})
  with pytest.raises(jaxkv.InputError) as refused:
    helpers.make_engine(mesh, mc, cache=cache)
  message = str(refused.value)
  assert f"CacheConfig.{field}={wrong} but the model has {field}={right}" in message
  assert "CacheConfig.for_model(model, " in message
  # The shapes are the model's only: for_model takes the budgets, not a shape.
  with pytest.raises(jaxkv.InputError, match=f"for_model reads {field} from the model"):
    jaxkv.CacheConfig.for_model(mc, **{field: wrong})


def test_a_model_whose_layers_disagree_with_its_config_is_refused_by_init_pages(mesh):
  """The PagedKV layers are what the pools are allocated into: they are checked too."""
  mc = helpers.tiny_model_config()
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(0))
  model.kv.head_dim = 16  # its cfg still says 8
  cache = jaxkv.KVCache(helpers.cache_config_for(mc), mesh)
  with pytest.raises(jaxkv.InputError, match="head_dim=16 but CacheConfig has .*head_dim=8"):
    jaxkv.Engine(model, cache)


def test_each_step_compiles_once_per_bucket(mesh):
  mc = helpers.tiny_model_config(num_layers=1, hidden_size=16, mlp_dim=32, vocab_size=64)
  engine = helpers.make_engine(mesh, mc, max_seqs_per_shard=2)
  engine.trace_counts.clear()
  # 64 tokens = 16 pages of 4: widths {4, 8, 16} (at least one attention chunk) x rows {1, 2}
  assert engine.warmup(max_seq_len=64) == 3 * 2
  after_warmup = dict(engine.trace_counts)
  assert all(v == 1 for v in after_warmup.values())
  rng = np.random.default_rng(0)
  for n_prompts, length in [(1, 3), (8, 20), (3, 9), (5, 40), (2, 17), (7, 1)]:
    prompts = [rng.integers(0, 64, length).tolist() for _ in range(n_prompts)]
    engine.generate(prompts, 6)
  assert dict(engine.trace_counts) == after_warmup  # nothing traced again


def test_pages_and_weights_live_in_device_memory(mesh):
  engine = helpers.make_engine(mesh)
  engine.generate([[1, 2, 3, 4, 5]], 2)
  for leaf in engine.cache.worker.pools + jax.tree.leaves(engine.runner.weights):
    assert leaf.sharding.memory_kind == "device"
  for leaf in engine.cache.worker.pools:
    assert leaf.sharding.spec == jaxkv.worker.pages.layer_stack_spec(engine.cache.config)


def test_pinned_prefix_stays_on_every_shard_under_pressure(mesh):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=8)
  engine = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1)
  fresh = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1, prefix_reuse=False)
  system = list(range(1, 13))  # 3 blocks
  assert engine.pin(system) == 3
  keys = engine.cache.index.block_keys(system, "default")
  rng = np.random.default_rng(0)
  for _ in range(6):  # unrelated traffic that needs every unpinned page, many times over
    prompts = [rng.integers(1, 128, 20).tolist() for _ in range(4)]
    assert engine.generate(prompts, 4) == fresh.generate(prompts, 4)
  assert engine.stats()["evictions"] > 0
  for s in range(4):
    assert len(engine.cache.index.match(s, keys)) == 3
  before = engine.stats()["hits"]["device"]
  users = [system + [50 + u, 60 + u] for u in range(4)]
  assert engine.generate(users, 3) == fresh.generate(users, 3)
  assert engine.stats()["hits"]["device"] - before == 4 * 3  # every shard reused the pin
  engine.unpin(system)
  engine.cache.index.check_invariants()
  assert all(engine.cache.index.refcount(s, p) == 0 for s in range(4) for p in range(12))
  with pytest.raises(ValueError, match="not pinned"):
    engine.unpin(system)


def test_a_prefix_on_a_busy_shard_is_copied_across_shards_not_recomputed(mesh):
  engine = helpers.make_engine(mesh, max_seqs_per_shard=1)
  fresh = helpers.make_engine(mesh, max_seqs_per_shard=1, prefix_reuse=False)
  shared = list(range(1, 34))  # 8 full blocks
  engine.generate([shared + [40]], 2)  # computed on one shard only
  users = [shared + [60 + u, 61, 62] for u in range(4)]  # one per shard in the next wave
  assert engine.generate(users, 4) == fresh.generate(users, 4)
  s = engine.stats()
  assert s["hits"]["device"] == 8  # the user placed on the prefix's own shard
  assert s["hits"]["shard"] == 3 * 8  # the three others copied it across
  assert s["blocks_fetched"] == 3 * 8 and s["computed_tokens"] < 2 * 34 + 4 * 4
  engine.cache.index.check_invariants()
  for sh in range(4):  # the source pages were pinned only for the copy
    assert all(engine.cache.index.refcount(sh, p) == 0 for p in range(64))
  # The copy is a collective (that is the point); page writes and attention stay local.
  import jax
  text = jaxkv.worker.pages._copy_fn(
      mesh, engine.cache.config, jaxkv.worker.pages.pool_ranks(engine.cache.worker.pools)).lower(
      tuple(engine.cache.worker.pools), jax.numpy.zeros(4, jax.numpy.int32),
      jax.numpy.zeros(4, jax.numpy.int32)).compile().as_text()
  assert any(op in text for op in jaxkv.worker.pages.COLLECTIVE_OPS)


def test_a_prompt_computed_alone_teaches_the_plan_what_a_prefill_really_costs(mesh):
  """Calibration times bare steps; a prompt computed alone with nothing fetched refines the
  prefill curve with what its first token really took (the scheduling, the plan and the
  sampling around the steps too): a curve a million times too fast is scaled up by the
  first such prompt. Two prompts sharing their steps teach it nothing."""
  from jaxkv.planning.costs import CostModel, PrefillCurve
  costs = CostModel(links={}, prefill=PrefillCurve(1e-9, 1e-9, 0.0))
  e = helpers.make_engine(mesh, scheduler=jaxkv.SchedulerConfig(decision="cost"), costs=costs,
                          max_seqs_per_shard=2)
  e.generate([list(range(1, 40))], 2)
  learned = e.costs.prefill
  assert learned.per_token_s > 1e3 * 1e-9, learned
  e.generate([list(range(40, 80)), list(range(80, 120))], 2)
  assert e.costs.prefill == learned
