"""Online load: users arriving over time (jaxkv.tools.online), traces with arrival times and stops."""

import json

import jax
import numpy as np
import pytest

import helpers
import jaxkv
from jaxkv.tools import online, workloads


@pytest.fixture(scope="module")
def engines(mesh):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=40, max_pages_per_seq=24)
  return (helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2),
          helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=False,
                              batching="static"))


SPEC = workloads.ChatSpec(users=4, turns=2, system_prompt_tokens=12, user_tokens=(3, 9),
                          max_new_tokens=5, vocab_size=128, seed=8)


def test_online_chat_gives_the_answers_of_a_run_in_rounds(engines):
  engine, fresh = engines
  chat = workloads.Chat(SPEC)
  want = []
  for turn in range(SPEC.turns):
    out = fresh.generate(chat.prompts(turn), SPEC.max_new_tokens)
    chat.record(turn, out)
    want.extend(out)
  records, makespan = online.run(engine, workloads.Chat(SPEC), rate=200.0, think_s=0.005,
                                 seed=3)
  assert [(r.turn, r.user) for r in records] == [(t, u) for t in range(2) for u in range(4)]
  assert [r.tokens for r in records] == want
  by = {(r.user, r.turn): r for r in records}
  for r in records:
    assert r.arrival_s <= r.first_token_s <= r.finish_s <= makespan
    assert r.finish_reason == "length" and r.ttft_s > 0
    if r.turn:  # a user's next request comes after its previous answer
      assert r.arrival_s >= by[r.user, r.turn - 1].finish_s
  fig = online.summary(records, makespan)
  assert fig["requests"] == 8 and fig["tokens_per_s"] > 0
  assert 0 < fig["ttft_p50_s"] <= fig["ttft_p90_s"] <= fig["ttft_p99_s"]
  assert 0 < fig["tpot_p50_s"] and fig["e2e_p50_s"] >= fig["ttft_p50_s"]
  assert engine.stats()["hits"]["device"] > 0  # later turns reuse their history
  assert not engine.has_unfinished()


def test_a_trace_brings_its_arrival_times_lengths_and_stops(engines, tmp_path):
  engine, fresh = engines
  rng = np.random.default_rng(4)
  prompts = [rng.integers(1, 128, int(rng.integers(6, 20))).tolist() for _ in range(4)]
  free = [fresh.generate([p], 6)[0] for p in prompts]
  lines = [{"prompt": prompts[0], "max_new_tokens": 6, "arrival_s": 0.0},
           {"prompt": prompts[1], "max_new_tokens": 3, "arrival_s": 0.05},
           {"prompt": prompts[2], "max_new_tokens": 6, "arrival_s": 0.02,
            "stop_token_ids": [free[2][1]]},
           {"prompt": prompts[3], "arrival_s": 0.1, "max_new_tokens": 6}]
  path = tmp_path / "t.jsonl"
  path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  trace = workloads.Trace(str(path), 128)
  assert trace.arrivals() == [0.0, 0.05, 0.02, 0.1]
  records, _ = online.run(engine, trace, rate=0.0)
  assert [r.arrival_s for r in records] == [0.0, 0.05, 0.02, 0.1]
  got = [r.tokens for r in records]
  stop = free[2].index(free[2][1]) + 1
  assert got == [free[0], free[1][:3], free[2][:stop], free[3]]
  assert records[2].finish_reason == "stop" and records[1].finish_reason == "length"
  # In rounds, the trace's own lengths and stops apply too.
  assert engine.generate(trace.prompts(0), trace.sampling(0)) == got


@pytest.mark.parametrize("lines,match", [
    ([{"prompt": [1, 2], "arrival_s": 0.0}, {"prompt": [3, 4]}], "on 1 of 2 lines"),
    ([{"prompt": [1, 2], "arrival_s": -1}], "arrival_s=-1.0 must be"),
    ([{"prompt": [1, 2], "stop_token_ids": [500]}], r"outside \[0, 128\)"),
    ([{"prompt": [1, 2], "max_new_tokens": 0}], "max_new_tokens"),
])
def test_bad_trace_lines_are_refused_naming_the_line(tmp_path, lines, match):
  path = tmp_path / "bad.jsonl"
  path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
  with pytest.raises(ValueError, match=match):
    workloads.Trace(str(path), 128)


def test_online_needs_continuous_batching_and_a_rate(engines):
  engine, fresh = engines
  with pytest.raises(ValueError, match="batching"):
    online.run(fresh, workloads.Chat(SPEC), rate=1.0)
  with pytest.raises(ValueError, match="rate=0.0 must be a positive"):
    online.run(engine, workloads.Chat(SPEC), rate=0.0)
  with pytest.raises(ValueError, match="think_s=-1"):
    online.run(engine, workloads.Chat(SPEC), rate=1.0, think_s=-1)


def test_requests_sharing_a_new_prefix_compute_it_once(mesh):
  one = jaxkv.make_mesh(data=1, model=2, devices=jax.devices()[:2])  # one data shard
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=64, max_pages_per_seq=16)
  engine = helpers.make_engine(one, mc, cache=cc, max_seqs_per_shard=4)
  fresh = helpers.make_engine(one, mc, cache=cc, max_seqs_per_shard=4, prefix_reuse=False)
  rng = np.random.default_rng(6)
  doc = rng.integers(1, 128, 24).tolist()  # 6 blocks of 4, cached nowhere
  tails = [rng.integers(1, 128, int(rng.integers(1, 6))).tolist() for _ in range(5)]
  prompts = [doc + t for t in tails]
  handles = [engine.submit(p, 4) for p in prompts]  # all in the queue at one step
  while engine.has_unfinished():
    engine.step()
  assert [h.tokens for h in handles] == fresh.generate(prompts, 4)
  st = engine.stats()
  assert st["shared_prefix_waits"] == 4
  assert st["computed_tokens"] == len(doc) + sum(len(t) for t in tails)  # the doc once
  assert st["hit_tokens"] == 4 * len(doc)
  # Arriving while the first one prefills: the same.
  doc2 = rng.integers(1, 128, 32).tolist()
  a = engine.submit(doc2 + [5], 3)
  engine.step()  # a is placed and computes its first chunk
  b = engine.submit(doc2 + [9, 9], 3)
  while engine.has_unfinished():
    engine.step()
  assert [a.tokens, b.tokens] == fresh.generate([doc2 + [5], doc2 + [9, 9]], 3)
  assert engine.stats()["shared_prefix_waits"] == 5
  # On several data shards, a request that would run elsewhere computes in parallel.
  spread = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=1)
  doc3 = rng.integers(1, 128, 24).tolist()
  handles = [spread.submit(doc3 + [i + 1], 3) for i in range(3)]
  while spread.has_unfinished():
    spread.step()
  assert [h.tokens for h in handles] == fresh.generate([doc3 + [i + 1] for i in range(3)], 3)
  assert spread.stats()["shared_prefix_waits"] == 0
