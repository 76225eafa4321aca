"""Continuous batching and the online API: submit / step / token streams."""

import dataclasses

import numpy as np
import pytest

import helpers
import jaxkv
from jaxkv.tools import workloads
from jaxkv.manager.index import Tier


@pytest.fixture(scope="module")
def pair(mesh):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=24, max_pages_per_seq=16)
  return (helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2),
          helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=False,
                              batching="static"))


def test_requests_arriving_mid_decode_equal_recompute_from_scratch(pair):
  engine, fresh = pair
  rng = np.random.default_rng(2)
  shared = rng.integers(1, 128, 13).tolist()
  prompts = [shared + rng.integers(1, 128, int(rng.integers(2, 12))).tolist()
             for _ in range(10)]
  params = [jaxkv.SamplingParams(max_new_tokens=int(rng.integers(1, 9))) for _ in prompts]
  want = [fresh.generate([p], sp)[0] for p, sp in zip(prompts, params)]
  # Stop two of them early at a token their answer holds.
  for i in (1, 6):
    if len(want[i]) > 2:
      params[i] = jaxkv.SamplingParams(max_new_tokens=params[i].max_new_tokens,
                                       stop_token_ids=(want[i][1],))
      want[i] = want[i][:want[i].index(want[i][1]) + 1]
  handles, streamed = [], {}
  for i, (p, sp) in enumerate(zip(prompts, params)):
    handles.append(engine.submit(p, sp, on_token=lambda t, i=i: streamed.setdefault(i, []).append(t)))
    for _ in range(i % 3):  # arrivals between steps, some while others decode
      engine.step()
  while engine.has_unfinished():
    engine.step()
  assert [h.tokens for h in handles] == want
  assert [streamed[i] for i in range(len(prompts))] == want  # the callback saw every token
  assert {h.finish_reason for h in (handles[1], handles[6])} <= {"stop", "length"}
  assert all(h.finished and h.ttft_s > 0 for h in handles)
  s = engine.stats()
  assert s["hits"]["device"] > 0 and s["steps"] > 0
  helpers.no_refs(engine)


def test_iterating_a_handle_streams_its_tokens_while_others_advance(pair):
  engine, fresh = pair
  a = engine.submit([5, 6, 7, 8, 9, 10], 6)
  b = engine.submit([50, 51, 52, 53, 54, 55, 56, 57, 58], 4)
  got = []
  for t in a:
    got.append(t)
  assert got == fresh.generate([[5, 6, 7, 8, 9, 10]], 6)[0] == a.tokens
  assert b.result() == fresh.generate([[50, 51, 52, 53, 54, 55, 56, 57, 58]], 4)[0]
  assert not engine.has_unfinished()
  helpers.no_refs(engine)


def test_continuous_and_static_batching_give_the_same_chat_through_every_tier(mesh, tmp_path):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  spec = workloads.ChatSpec(users=6, turns=3, system_prompt_tokens=9, user_tokens=(3, 8),
                            max_new_tokens=4, vocab_size=128, seed=4)
  outs = {}
  for batching in ("continuous", "static"):
    tiers = jaxkv.TierConfig(host_pages_per_shard=3, disk_kvstore=str(tmp_path / batching),
                             disk_pages=200)
    engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=1,
                                 batching=batching,
                                 scheduler=jaxkv.SchedulerConfig(decision="split", force_split=1))
    chat = workloads.Chat(spec)
    outs[batching] = []
    for turn in range(spec.turns):
      out = engine.generate(chat.prompts(turn), spec.max_new_tokens)
      outs[batching].append(out)
      chat.record(turn, out)
      engine.offload()  # every cached block now comes back from host or disk
      assert engine.flush(30) == 0
    st = engine.stats()
    assert st["hits"]["host"] + st["hits"]["disk"] > 0 and st["blocks_split"] > 0, batching
    assert st["verify_failures"] == 0
    helpers.no_refs(engine, (Tier.DEVICE, Tier.HOST, Tier.DISK))
  assert outs["continuous"] == outs["static"]


def test_arrival_patterns_compile_nothing_after_warmup(mesh):
  engine = helpers.make_engine(mesh, max_seqs_per_shard=2)
  engine.warmup(max_seq_len=64)
  after = dict(engine.trace_counts)
  rng = np.random.default_rng(3)
  for burst in (1, 5, 2, 9, 3):
    for _ in range(burst):
      engine.submit(rng.integers(1, 128, int(rng.integers(1, 40))).tolist(),
                    int(rng.integers(1, 12)))
    for _ in range(int(rng.integers(0, 4))):
      engine.step()
  while engine.has_unfinished():
    engine.step()
  assert dict(engine.trace_counts) == after
  helpers.no_refs(engine)


def test_a_failed_step_releases_every_reference_and_the_engine_goes_on(pair, monkeypatch):
  engine, fresh = pair
  for p in ([1, 2, 3, 4, 5, 6, 7, 8, 9], [9, 8, 7, 6, 5]):
    engine.submit(p, 5)
  engine.step()
  real = engine.runner.decode

  def broken(*args, **kw):
    raise RuntimeError("injected step failure")

  monkeypatch.setattr(engine.runner, "decode", broken)
  with pytest.raises(RuntimeError, match="injected"):
    while engine.has_unfinished():
      engine.step()
  monkeypatch.setattr(engine.runner, "decode", real)
  helpers.no_refs(engine)
  assert engine.generate([[3, 1, 4, 1, 5, 9, 2, 6]], 3) == fresh.generate([[3, 1, 4, 1, 5, 9, 2, 6]], 3)


def test_bad_batching_is_refused():
  with pytest.raises(ValueError, match="batching='waves' must be one of"):
    jaxkv.EngineConfig(batching="waves")


def test_a_stop_inside_a_steady_decode_batch_changes_no_other_answer(pair):
  """Steps decode ahead while the decoding set holds; one sequence stopping drops its row
  of the step already dispatched, the others' tokens are those of recompute."""
  engine, fresh = pair
  rng = np.random.default_rng(9)
  prompts = [rng.integers(1, 128, int(rng.integers(5, 14))).tolist() for _ in range(4)]
  want = fresh.generate(prompts, 10)
  params = [jaxkv.SamplingParams(max_new_tokens=10) for _ in prompts]
  params[2] = jaxkv.SamplingParams(max_new_tokens=10, stop_token_ids=(want[2][3],))
  cut = want[2].index(want[2][3]) + 1
  before = engine.stats()["decode_steps"]
  handles = [engine.submit(p, sp) for p, sp in zip(prompts, params)]
  while engine.has_unfinished():
    engine.step()
  assert [h.tokens for h in handles] == want[:2] + [want[2][:cut]] + want[3:]
  assert handles[2].finish_reason == "stop"
  assert engine.stats()["decode_steps"] - before >= 9  # every token after the first
  helpers.no_refs(engine)
  # What the stopped one left behind is reusable and exact.
  assert engine.generate([prompts[2] + want[2][:cut]], 3) == fresh.generate(
      [prompts[2] + want[2][:cut]], 3)


def test_a_short_tail_runs_in_a_narrower_step_and_stays_exact(mesh):
  """With a wide chunk (32 pages of 4 = 128 tokens), a prompt's last partial chunk runs in
  the narrowest step that holds it (64 tokens here), nothing compiles after warmup, and a
  chat's answers are those of recompute-from-scratch."""
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=96, max_pages_per_seq=48)
  engine = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1, prefill_chunk_pages=32)
  fresh = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1, prefill_chunk_pages=32,
                              prefix_reuse=False)
  assert engine.runner.prefill_widths == [64, 128]
  engine.warmup(max_seq_len=160)
  after = dict(engine.trace_counts)
  assert {k[1][1] for k in after if k[0] == "prefill"} == {64, 128}
  spec = workloads.ChatSpec(users=4, turns=2, system_prompt_tokens=70, user_tokens=(5, 30),
                            max_new_tokens=4, vocab_size=128, seed=12)
  chat, ref = workloads.Chat(spec), workloads.Chat(spec)
  widths = []
  real = engine.runner.prefill

  def spy(batch, *a, **kw):
    widths.append(batch.tokens.shape[1])
    return real(batch, *a, **kw)

  engine.runner.prefill = spy
  for turn in range(spec.turns):
    got, lg = engine.generate(chat.prompts(turn), spec.max_new_tokens, return_logits=True)
    want, lg_want = fresh.generate(ref.prompts(turn), spec.max_new_tokens, return_logits=True)
    assert got == want
    for a, b in zip(lg, lg_want):
      np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
    chat.record(turn, got)
    ref.record(turn, want)
  assert 64 in widths and 128 in widths  # later turns' short tails take the narrow step
  assert dict(engine.trace_counts) == after
  assert engine.stats()["hits"]["device"] > 0
  helpers.no_refs(engine)


def test_a_step_is_a_frozen_plan_executed_into_a_frozen_result(pair):
  engine, fresh = pair
  prompt = list(range(3, 3 + 21))
  want = fresh.generate([prompt], 3)[0]
  handle = engine.submit(prompt, 3)
  plan = engine.loop.schedule()  # what the step will do, decided before it runs
  assert plan.admitted == (handle.id,) and not plan.decode
  assert [c.seq.request for c in plan.prefill] == [handle.id]
  with pytest.raises(dataclasses.FrozenInstanceError):
    plan.decode = ()
  with pytest.raises(ValueError):  # the chunk's tokens are the request's, read-only
    plan.prefill[0].tokens[0] = 0
  assert f"admitted [{handle.id}]" in plan.summary()
  result = engine.runner.execute(plan)  # the runner reads the plan, nothing else
  with pytest.raises(dataclasses.FrozenInstanceError):
    result.tokens = {}
  out = engine.loop.update(plan, result)
  last = plan.prefill[-1].last
  assert (handle.id in result.tokens) == last and bool(out) == last
  while engine.has_unfinished():
    engine.step()
  assert handle.tokens == want and handle.finish_reason == "length"
  helpers.no_refs(engine)


def test_pin_runs_through_the_loop_on_every_shard_while_others_run(pair):
  engine, fresh = pair
  other = engine.submit([7, 7, 7, 1, 2, 3, 4, 5, 6], 6)  # decoding while pin runs
  engine.step()
  prefix = list(range(40, 40 + 2 * engine.cache.config.page_size))
  steps = engine.stats()["steps"]
  assert engine.pin(prefix) == 2
  assert engine.stats()["steps"] > steps  # the pin's prefills were steps of the loop
  index = engine.cache.index
  keys = index.block_keys(np.asarray(prefix, np.int32), "default")
  assert all(len(index.match(s, keys)) == 2 for s in range(engine.cache.num_shards))
  assert other.result() == fresh.generate([[7, 7, 7, 1, 2, 3, 4, 5, 6]], 6)[0]
  engine.unpin(prefix)
  helpers.no_refs(engine)


def test_a_step_failing_after_its_fetches_settled_releases_each_pin_once(mesh, tmp_path):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  tiers = jaxkv.TierConfig(host_pages_per_shard=8)
  engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=1,
                               scheduler=jaxkv.SchedulerConfig(decision="fetch"))
  fresh = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1, prefix_reuse=False)
  prompt = list(range(1, 40))
  engine.generate([prompt], 2)
  engine.offload()  # the prefix now comes back from host memory: a fetch group
  mover = engine.cache.worker.mover
  real = mover.finish_promote

  def settles_then_fails(*args, **kw):
    out = real(*args, **kw)  # settled, but its report is lost with the step: recover
    # releases its pins, once
    raise RuntimeError("injected failure after the fetches settled")

  mover.finish_promote = settles_then_fails
  handle = engine.submit(prompt + [5, 6], 2)
  with pytest.raises(RuntimeError, match="after the fetches settled"):
    while engine.has_unfinished():
      engine.step()
  mover.finish_promote = real
  assert handle.finished and handle.finish_reason == "error"
  helpers.no_refs(engine, (Tier.DEVICE, Tier.HOST))  # check_invariants: no pin released twice
  assert engine.generate([prompt + [5, 6]], 2) == fresh.generate([prompt + [5, 6]], 2)


def test_requests_taken_off_the_queue_by_a_failed_admission_end_in_error(pair, monkeypatch):
  engine, _ = pair

  def broken(*args, **kw):
    raise RuntimeError("injected admission failure")

  handles = [engine.submit([1, 2, 3, 4, 5], 3), engine.submit([6, 7, 8, 9], 3)]
  monkeypatch.setattr(engine.admission, "admit", broken)
  with pytest.raises(RuntimeError, match="admission"):
    engine.step()
  assert all(h.finished and h.finish_reason == "error" for h in handles)
  assert not engine.has_unfinished()
  helpers.no_refs(engine)
