"""Multi-turn load over HTTP (jaxkv.tools.bench.http, launch/load.py): against a real
launch/server.py serving a checkpoint with a tokenizer (one per module; its start
compiles), through a real fault-injecting front (``faults.FaultyFront``) for the paths a
healthy server does not take, and launch/bench.py --suite=http --quick.
"""

import collections
import json
import math
import os

import pytest

import faults
import hf_fixtures as hf
from jaxkv.tools import workloads
from jaxkv.tools.bench import http
from jaxkv.errors import InputError

from helpers import run_script

ROWS = 8  # cpu_tiny: 8 rows (4 data shards x 2, one shard of 8 with a checkpoint on CPU)
VOCAB = 300  # prompt ids are drawn below it: the checkpoint's vocabulary is 320
# max_waiting=0: a ninth outstanding request is answered 429. The cache's shape is
# tests/entrypoints/test_server.py's (the same checkpoint shapes too).
SERVER_FLAGS = ["--config.cache.pages_per_shard=96", "--config.cache.max_pages_per_seq=32",
                "--max_waiting=0"]


def test_http_suite_compares_the_same_arrivals_in_process_and_over_http(tmp_path):
  path = tmp_path / "http.json"
  code, _, err = run_script(["launch/bench.py", "--suite=http", "--quick",
                             f"--json_out={path}"])
  assert code == 0, err[-3000:]
  r = json.loads(path.read_text())
  assert r["suite"] == "http" and len(r["machine"]["devices"]) == 8 and r["reps"] == 2
  assert math.isfinite(r["http_ttft_overhead_ms_p50"])  # may be below 0 on a noisy machine
  for key in ("http_tokens_per_s_vs_in_process", "in_process_ttft_p50_ms", "http_ttft_p50_ms",
              "in_process_tokens_per_s", "http_tokens_per_s"):
    assert math.isfinite(r[key]) and r[key] > 0, key
  assert 0 < r["cached_token_share"] <= 1
  # Same prompts and arrival times on both sides, greedy: the same tokens, nothing refused.
  assert r["arrivals_identical"] is True and r["outputs_identical"] is True
  assert r["errors_by_status"] == {}
  # Each repetition's figure is within what the two sides' own timings allow (their ranges
  # over the repetitions), not only the median of the list it came from.
  figs = r["figures"]
  h, i = (figs[side]["saturated"]["tokens_per_s"] for side in ("http", "in_process"))
  assert r["http_tokens_per_s"] == h["median"] and r["in_process_tokens_per_s"] == i["median"]
  ratios = r["per_rep"]["http_tokens_per_s_vs_in_process"]
  assert len(ratios) == 2 and all(
      h["min"] / i["max"] * (1 - 1e-12) <= x <= h["max"] / i["min"] * (1 + 1e-12)
      for x in ratios), (ratios, h, i)
  hl, il = (figs[side]["light"]["ttft_p50_s"] for side in ("http", "in_process"))
  overheads = r["per_rep"]["http_ttft_overhead_ms_p50"]
  assert len(overheads) == 2 and all(
      1e3 * (hl["min"] - il["max"]) - 1e-9 <= x <= 1e3 * (hl["max"] - il["min"]) + 1e-9
      for x in overheads), (overheads, hl, il)
  for key in ("http_ttft_overhead_ms_p50", "http_tokens_per_s_vs_in_process"):
    assert r[f"{key}_min"] <= r[key] <= r[f"{key}_max"], key
  # A prompt 4x a sequence's device budget, streamed from host memory on both sides.
  assert r["long_context_prompt_tokens"] == 4 * r["long_context_device_budget_tokens"]
  assert math.isfinite(r["long_context_ttft_vs_in_process"])
  assert r["long_context_ttft_vs_in_process"] > 0
  assert 0 < r["detok_us_per_token_at_4k"] and 0 < r["detok_us_per_token_at_64"]
  sat = r["points"]["saturated"]
  assert sat["users"] == 2 * r["batch_rows"] == 2 * ROWS and sat["requests"] == 2 * sat["users"]
  for side in ("in_process", "http"):
    for point in ("light", "saturated"):
      fig = r["figures"][side][point]
      assert fig["tokens_per_s"]["min"] <= fig["tokens_per_s"]["median"] <= fig[
          "tokens_per_s"]["max"]
      assert 0 < fig["ttft_p50_s"]["median"] <= fig["ttft_p99_s"]["median"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  path, *_ = hf.text_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "model"))
  return path


@pytest.fixture(scope="module")
def model(checkpoint):
  return os.path.basename(checkpoint)  # the served model's name: the checkpoint's folder


@pytest.fixture(scope="module")
def server(checkpoint):
  """launch/server.py on the tiny config and a checkpoint with a tokenizer (so text chat is
  served too); a start that fails or is late is an error."""
  with http.ServerProcess([f"--model_dir={checkpoint}", *SERVER_FLAGS]) as proc:
    proc.wait_ready(600.0)
    yield proc
    status = proc.close()  # SIGTERM: it drains and exits 0
    assert status == 0, proc.log_tail()


@pytest.fixture
def front(server):
  """A real HTTP front on loopback that passes requests to the module's server, and
  misbehaves as each test tells it (``faults.FaultyFront``)."""
  proxy = faults.FaultyFront(server.base)
  yield proxy
  proxy.close()


def chat(users, turns, max_new_tokens, seed):
  return workloads.ChatSpec(users=users, turns=turns, system_prompt_tokens=40,
                            user_tokens=(8, 24), max_new_tokens=max_new_tokens,
                            vocab_size=VOCAB, seed=seed)


def test_every_turn_streams_its_tokens_and_later_turns_reuse_the_conversation(server, model):
  spec = chat(users=3, turns=3, max_new_tokens=5, seed=11)
  target = http.Target(url=server.url, model=model, ignore_eos=True)
  results, makespan = http.run_load(target, http.TokenChat(workloads.Chat(spec)), rate=20.0,
                                    seed=11)
  assert [(r.turn, r.user) for r in results] == [(t, u) for t in range(3) for u in range(3)]
  replay = workloads.Chat(spec)  # what each prompt must be: the history, the answer, a message
  prompt_lens = collections.Counter()  # by turn, from the replay (not the server's usage)
  cached = collections.Counter()  # by turn, from each request's own usage
  for r in results:
    assert r.ok and r.status == 200 and r.done, (r.status, r.error)
    assert r.finish_reason == "length" and r.rejected_429 == 0
    assert r.tokens_streamed == len(r.token_ids) == r.usage["completion_tokens"] == 5
    # One gap between successive token events; the server sends tokens that queued up
    # while the client read as one event, so there are at most 4.
    assert len(r.gaps_s) < r.tokens_streamed and all(g >= 0 for g in r.gaps_s)
    prompt, _ = replay.user_request(r.user, r.turn)
    assert r.usage["prompt_tokens"] == len(prompt)
    prompt_lens[r.turn] += len(prompt)
    cached[r.turn] += r.cached_tokens
    assert r.usage["total_tokens"] == len(prompt) + 5
    replay.user_record(r.user, r.turn, list(r.token_ids))
    assert 0 <= r.cached_tokens < r.usage["prompt_tokens"]
    if r.turn:  # the conversation so far was cached by the turn before
      assert r.cached_tokens > 0, (r.user, r.turn)
    assert r.arrival_s < r.first_token_s <= r.finish_s <= makespan
  fig = http.summary(results, makespan, planned=9)
  assert fig["requests_ok"] == 9 and fig["errors_by_status"] == {}
  assert fig["completion_tokens"] == 45 and fig["requests_not_sent"] == 0
  # The summary's totals and shares are the requests' own, turn by turn.
  assert fig["prompt_tokens"] == sum(prompt_lens.values())
  assert fig["cached_tokens"] == sum(cached.values())
  assert math.isclose(fig["cached_token_share"], sum(cached.values()) / sum(prompt_lens.values()))
  assert [t["requests_ok"] for t in fig["by_turn"]] == [3, 3, 3]
  for turn, t in enumerate(fig["by_turn"]):
    assert math.isclose(t["cached_token_share"], cached[turn] / prompt_lens[turn]), (turn, t)
  assert all(t["cached_token_share"] > 0 for t in fig["by_turn"][1:])


def test_429s_are_counted_and_retried_after_retry_after(server, model):
  # 12 users at once, 8 rows and no waiting room: some are told to retry, all are answered.
  spec = chat(users=12, turns=1, max_new_tokens=8, seed=12)
  target = http.Target(url=server.url, model=model, ignore_eos=True)
  results, makespan = http.run_load(target, http.TokenChat(workloads.Chat(spec)),
                                    rate=10000.0, seed=12)
  fig = http.summary(results, makespan, planned=12)
  assert fig["requests_ok"] == 12 and fig["requests_failed"] == 0
  rejected = [r for r in results if r.rejected_429]
  assert rejected and fig["errors_by_status"] == {"429": sum(r.rejected_429 for r in results)}
  for r in rejected:  # TTFT counts from arrival: it holds the wait the server asked for
    assert r.ttft_s >= 0.99 * r.rejected_429 and r.usage["completion_tokens"] == 8


def test_load_cli_writes_the_documented_figures(server, model, tmp_path):
  out = tmp_path / "load.json"
  code, stdout, err = run_script([
      "launch/load.py", f"--url={server.url}", "--users=2", "--turns=2", "--max_tokens=4",
      "--ignore_eos", "--system_prompt_len=40", "--message_len=8,24", "--request_rate=20",
      f"--vocab_size={VOCAB}", f"--json_out={out}"], timeout_s=300)
  assert code == 0, err[-3000:]
  r = json.loads(out.read_text())
  documented = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s",
                "tokens_per_s", "requests_per_s", "cached_token_share", "errors_by_status",
                "requests", "requests_ok", "requests_failed", "requests_not_sent",
                "completion_tokens", "prompt_tokens", "cached_tokens", "makespan_s",
                "mean_in_flight", "by_turn", "error_examples", "url", "model", "mode"}
  assert documented <= set(r), documented - set(r)
  assert r["model"] == model and r["mode"] == "ids"  # the model was found by GET /models
  assert r["requests"] == r["requests_ok"] == 4 and r["errors_by_status"] == {}
  assert r["requests_failed"] == r["requests_not_sent"] == 0
  assert r["completion_tokens"] == 4 * 4
  assert math.isclose(r["tokens_per_s"] * r["makespan_s"], r["completion_tokens"])
  assert math.isclose(r["requests_per_s"] * r["makespan_s"], r["requests_ok"])
  # The prompts the CLI's workload sends (its default seed, 4-token answers: --ignore_eos):
  # their lengths, counted here, are what the server's usage summed to.
  replay = workloads.Chat(chat(users=2, turns=2, max_new_tokens=4, seed=0))
  lens = [[0, 0], [0, 0]]  # [turn][user]
  for turn in range(2):
    for user in range(2):
      prompt, _ = replay.user_request(user, turn)
      lens[turn][user] = len(prompt)
      replay.user_record(user, turn, [1] * 4)
  assert r["prompt_tokens"] == sum(map(sum, lens)), (r["prompt_tokens"], lens)
  assert math.isclose(r["cached_token_share"], r["cached_tokens"] / sum(map(sum, lens)))
  # The later turn's share can only come from cached tokens of the later prompts.
  assert 0 < r["by_turn"][1]["cached_token_share"] * sum(lens[1]) <= r["cached_tokens"]
  assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
  assert 0 < r["itl_p50_s"] <= r["itl_p90_s"]
  assert len(r["by_turn"]) == 2 and r["by_turn"][1]["cached_token_share"] > 0
  assert "TTFT p50/p90/p99 (ms)" in stdout and "cached token share" in stdout


# ---- faults around the real server: the paths a healthy one does not take ---------------------
def _content(event) -> str:
  return "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())


def test_text_chat_carries_each_answer_into_the_next_turn(front, model):
  """Text conversations to the real server (through the front, untouched): each turn's
  messages are the last turn's plus its answer, as the server streamed it, and a message;
  the figures are the server's own usage."""
  work = http.TextChat(users=1, turns=3, system_words=24, message_words=(2, 4), max_tokens=7,
                       seed=3)
  results, makespan = http.run_load(http.Target(url=front.url, model=model), work, rate=100.0)
  assert len(results) == len(front.seen) == 3 and all(r.ok for r in results)
  assert all(path == "/v1/chat/completions" for path, _, _ in front.seen)
  for r, (_, _, events) in zip(results, front.seen):
    answer = [e for e in events if e != "[DONE]" and e.get("choices")]
    # The role-only event carries no token: TTFT counts from the first event with text.
    assert answer[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with_text = [e for e in answer if _content(e)]
    assert r.text == "".join(_content(e) for e in answer)
    assert r.tokens_streamed == len(with_text) and len(r.gaps_s) == len(with_text) - 1
    assert events[-1] == "[DONE]" and r.usage == events[-2]["usage"]
  bodies = [body for _, body, _ in front.seen]
  assert bodies[0]["messages"][0]["role"] == "system" and bodies[0]["max_completion_tokens"] == 7
  assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
  assert bodies[0]["temperature"] == 0 and "ignore_eos" not in bodies[0]
  for before, after, r in zip(bodies, bodies[1:], results):
    n = len(before["messages"])
    assert after["messages"][:n] == before["messages"]
    assert after["messages"][n] == {"role": "assistant", "content": r.text}
    assert after["messages"][n + 1]["role"] == "user" and len(after["messages"]) == n + 2
  assert all(r.cached_tokens > 0 for r in results[1:])  # the conversation so far was cached
  fig = http.summary(results, makespan, planned=3)
  prompt = [r.usage["prompt_tokens"] for r in results]
  assert prompt == sorted(prompt) and len(set(prompt)) == 3  # each turn holds the last
  assert fig["cached_token_share"] == sum(r.cached_tokens for r in results) / sum(prompt)
  assert fig["completion_tokens"] == sum(r.usage["completion_tokens"] for r in results)


def test_429_past_the_deadline_fails_the_request_and_stops_its_user(front, model):
  """A server that stays full (the front answers 429 for it): each first request is
  retried as Retry-After says, twice at once, then told to wait an hour, which its
  deadline cuts short; it fails as a 429 and its user sends no more. (The last wait is
  the long one so that the deadline falls in a wait, never in an attempt.)"""
  front.default, front.busy_retry_after = "busy", ["0", "0", "3600"]
  work = http.TokenChat(workloads.Chat(chat(users=2, turns=3, max_new_tokens=4, seed=1)))
  target = http.Target(url=front.url, model=model, request_timeout_s=1.0)
  results, makespan = http.run_load(target, work, rate=1000.0)
  assert len(results) == 2 and all(r.status == 429 and not r.ok for r in results)
  assert [r.rejected_429 for r in results] == [3, 3]  # two retries, then the deadline
  assert all(r.error.startswith("no answer within request_timeout_s=1.0") for r in results)
  firsts = [work.body(u, 0)["prompt"] for u in range(2)]
  assert sorted(firsts.index(body["prompt"]) for _, body, _ in front.seen) == [0, 0, 0, 1, 1, 1]
  fig = http.summary(results, makespan, planned=6)
  assert fig["requests_failed"] == 2 and fig["requests_not_sent"] == 4
  assert fig["errors_by_status"] == {"429": 6}
  assert math.isnan(fig["ttft_p50_s"]) and fig["requests_ok"] == 0


def test_refusals_and_broken_streams_are_counted_by_kind(front, model):
  """Five users' first requests, each met by one fault around the real server: its own
  400 for a prompt id outside the vocabulary, a stream that ends early, one cut mid-body,
  the engine's error event, and one that stalls past the deadline. Each is counted by
  kind, and no user sends its second turn."""
  front.faults = ["token_900", "cut", "drop", "engine_error", "stall"]
  work = http.TokenChat(workloads.Chat(chat(users=5, turns=2, max_new_tokens=4, seed=2)))
  results, makespan = http.run_load(
      # (The stall holds until the client goes; the healthy half of the others must beat the
      # deadline on a busy machine: 3 s did not once, with helpers' runs beside the suite.)
      http.Target(url=front.url, model=model, request_timeout_s=8.0), work, rate=1000.0)
  assert len(results) == len(front.seen) == 5 and not [r for r in results if r.ok]
  fig = http.summary(results, makespan, planned=10)
  assert fig["errors_by_status"] == {"400": 1, "RemoteProtocolError": 1, "incomplete_stream": 1,
                                     "stream_error": 1, "timeout": 1}
  assert fig["error_examples"]["400"].startswith("prompt holds token id 900, outside the "
                                                 "vocabulary [0, 320)")
  assert fig["error_examples"]["stream_error"].startswith("the engine failed")
  assert fig["requests_not_sent"] == 5
  for r in results:  # each broken stream had its first tokens from the server
    if r.failure in ("incomplete_stream", "stream_error"):
      assert r.tokens_streamed >= 1 and r.token_ids and r.first_token_s is not None


def test_a_token_conversation_needs_token_ids_in_the_stream(front, model):
  """A server that ignores return_token_ids (the front takes it out; the real server then
  streams text alone): a token-id conversation cannot go on, and says how to."""
  front.default = "no_token_ids"
  work = http.TokenChat(workloads.Chat(chat(users=1, turns=2, max_new_tokens=4, seed=2)))
  with pytest.raises(InputError, match="token_ids"):
    http.run_load(http.Target(url=front.url, model=model, ignore_eos=True), work, rate=1000.0)
  [(_, body, events)] = front.seen  # the first answer: text and no ids
  assert body["return_token_ids"] is True
  assert any(e["choices"][0].get("text") for e in events if e != "[DONE]" and e["choices"])
  assert not any(e["choices"][0].get("token_ids") for e in events if e != "[DONE]"
                 and e["choices"])
