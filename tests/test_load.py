"""Multi-turn load over HTTP (jaxkv.bench.http, launch/load.py): against a real
launch/server.py (one per module; its start compiles), against a fake transport for the
paths a healthy server does not take, and launch/bench.py --suite=http --quick.
"""

import json
import math
import statistics

import httpx
import pytest

from jaxkv import workloads
from jaxkv.bench import http
from jaxkv.errors import InputError

from helpers import run_script

MODEL = "llama-tiny-random"  # configs/cpu_tiny.py's model name
ROWS = 8  # cpu_tiny: 4 data shards x max_seqs_per_shard 2
# As launch/bench.py --suite=http --quick runs it: the steps compile once (conftest's cache).
# max_waiting=0: a ninth outstanding request is answered 429.
SERVER_FLAGS = ["--config.cache.max_pages_per_seq=16", "--max_waiting=0"]


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
  for key in ("http_ttft_overhead_ms_p50", "http_tokens_per_s_vs_in_process"):
    per_rep = r["per_rep"][key]
    assert len(per_rep) == 2 and r[key] == statistics.median(per_rep)
    assert r[f"{key}_min"] == min(per_rep) and r[f"{key}_max"] == max(per_rep)
  sat = r["points"]["saturated"]
  assert sat["users"] == 2 * r["batch_rows"] == 2 * ROWS and sat["requests"] == 2 * sat["users"]
  for side in ("in_process", "http"):
    for point in ("light", "saturated"):
      fig = r["figures"][side][point]
      assert fig["tokens_per_s"]["min"] <= fig["tokens_per_s"]["median"] <= fig[
          "tokens_per_s"]["max"]
      assert 0 < fig["ttft_p50_s"]["median"] <= fig["ttft_p99_s"]["median"]


@pytest.fixture(scope="module")
def server():
  """launch/server.py on the tiny default config; a start that fails or is late is an error."""
  with http.ServerProcess(SERVER_FLAGS) as proc:
    proc.wait_ready(600.0)
    yield proc
    status = proc.close()  # SIGTERM: it drains and exits 0
    assert status == 0, proc.log_tail()


def chat(users, turns, max_new_tokens, seed):
  return workloads.ChatSpec(users=users, turns=turns, system_prompt_tokens=40,
                            user_tokens=(8, 24), max_new_tokens=max_new_tokens,
                            vocab_size=512, seed=seed)


def test_every_turn_streams_its_tokens_and_later_turns_reuse_the_conversation(server):
  spec = chat(users=3, turns=3, max_new_tokens=5, seed=11)
  target = http.Target(url=server.url, model=MODEL, ignore_eos=True)
  results, makespan = http.run_load(target, http.TokenChat(workloads.Chat(spec)), rate=20.0,
                                    seed=11)
  assert [(r.turn, r.user) for r in results] == [(t, u) for t in range(3) for u in range(3)]
  replay = workloads.Chat(spec)  # what each prompt must be: the history, the answer, a message
  for r in results:
    assert r.ok and r.status == 200 and r.done, (r.status, r.error)
    assert r.finish_reason == "length" and r.rejected_429 == 0
    assert r.tokens_streamed == len(r.token_ids) == r.usage["completion_tokens"] == 5
    assert len(r.gaps_s) == 4 and all(g >= 0 for g in r.gaps_s)  # one event per token
    prompt, _ = replay.user_request(r.user, r.turn)
    assert r.usage["prompt_tokens"] == len(prompt)
    assert r.usage["total_tokens"] == len(prompt) + 5
    replay.user_record(r.user, r.turn, list(r.token_ids))
    assert 0 <= r.cached_tokens < r.usage["prompt_tokens"]
    if r.turn:  # the conversation so far was cached by the turn before
      assert r.cached_tokens > 0, (r.user, r.turn)
    assert r.arrival_s < r.first_token_s <= r.finish_s <= makespan
  fig = http.summary(results, makespan, planned=9)
  assert fig["requests_ok"] == 9 and fig["errors_by_status"] == {}
  assert fig["completion_tokens"] == 45 and fig["requests_not_sent"] == 0
  assert fig["cached_token_share"] == fig["cached_tokens"] / fig["prompt_tokens"]
  assert [t["requests_ok"] for t in fig["by_turn"]] == [3, 3, 3]
  assert all(t["cached_token_share"] > 0 for t in fig["by_turn"][1:])


def test_429s_are_counted_and_retried_after_retry_after(server):
  # 12 users at once, 8 rows and no waiting room: some are told to retry, all are answered.
  spec = chat(users=12, turns=1, max_new_tokens=8, seed=12)
  target = http.Target(url=server.url, model=MODEL, ignore_eos=True)
  results, makespan = http.run_load(target, http.TokenChat(workloads.Chat(spec)),
                                    rate=10000.0, seed=12)
  fig = http.summary(results, makespan, planned=12)
  assert fig["requests_ok"] == 12 and fig["requests_failed"] == 0
  rejected = [r for r in results if r.rejected_429]
  assert rejected and fig["errors_by_status"] == {"429": sum(r.rejected_429 for r in results)}
  for r in rejected:  # TTFT counts from arrival: it holds the wait the server asked for
    assert r.ttft_s >= 0.99 * r.rejected_429 and r.usage["completion_tokens"] == 8


def test_load_cli_writes_the_documented_figures(server, tmp_path):
  out = tmp_path / "load.json"
  code, stdout, err = run_script([
      "launch/load.py", f"--url={server.url}", "--users=2", "--turns=2", "--max_tokens=4",
      "--ignore_eos", "--system_prompt_len=40", "--message_len=8,24", "--request_rate=20",
      f"--json_out={out}"], timeout_s=300)
  assert code == 0, err[-3000:]
  r = json.loads(out.read_text())
  documented = {"ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "itl_p50_s", "itl_p90_s",
                "tokens_per_s", "requests_per_s", "cached_token_share", "errors_by_status",
                "requests", "requests_ok", "requests_failed", "requests_not_sent",
                "completion_tokens", "prompt_tokens", "cached_tokens", "makespan_s",
                "mean_in_flight", "by_turn", "error_examples", "url", "model", "mode"}
  assert documented <= set(r), documented - set(r)
  assert r["model"] == MODEL and r["mode"] == "ids"  # the model was found by GET /models
  assert r["requests"] == r["requests_ok"] == 4 and r["errors_by_status"] == {}
  assert r["requests_failed"] == r["requests_not_sent"] == 0
  assert r["completion_tokens"] == 4 * 4
  assert math.isclose(r["tokens_per_s"] * r["makespan_s"], r["completion_tokens"])
  assert math.isclose(r["requests_per_s"] * r["makespan_s"], r["requests_ok"])
  assert r["cached_token_share"] == r["cached_tokens"] / r["prompt_tokens"]
  assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
  assert 0 < r["itl_p50_s"] <= r["itl_p90_s"]
  assert len(r["by_turn"]) == 2 and r["by_turn"][1]["cached_token_share"] > 0
  assert "TTFT p50/p90/p99 (ms)" in stdout and "cached token share" in stdout


# ---- a fake server: the paths a healthy one does not take ---------------------------------------
def sse(*events) -> httpx.Response:
  text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
  return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_text_chat_carries_each_answer_into_the_next_turn():
  seen = []

  def answer(request):
    seen.append((request.url.path, json.loads(request.content)))
    n = len(seen)
    return sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
               {"choices": [{"index": 0, "delta": {"content": f"answer{n} "}}]},
               {"choices": [{"index": 0, "delta": {"content": "ends"}, "finish_reason": "stop"}]},
               {"choices": [], "usage": {"prompt_tokens": 10 * n, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 5 * n - 5}}})

  work = http.TextChat(users=1, turns=3, system_words=5, message_words=(2, 4), max_tokens=7,
                       seed=3)
  results, makespan = http.run_load(http.Target(url="http://fake/v1/", model="m"), work,
                                    rate=100.0, transport=httpx.MockTransport(answer))
  assert [r.text for r in results] == ["answer1 ends", "answer2 ends", "answer3 ends"]
  # The role-only event carries no token: two token events, one gap, TTFT from the first.
  assert all(r.ok and r.tokens_streamed == 2 and len(r.gaps_s) == 1 for r in results)
  assert all(path == "/v1/chat/completions" for path, _ in seen)
  bodies = [body for _, body in seen]
  assert bodies[0]["messages"][0]["role"] == "system" and bodies[0]["max_completion_tokens"] == 7
  assert bodies[0]["stream"] is True and bodies[0]["stream_options"] == {"include_usage": True}
  assert bodies[0]["temperature"] == 0 and "ignore_eos" not in bodies[0]
  for before, after, r in zip(bodies, bodies[1:], results):
    n = len(before["messages"])
    assert after["messages"][:n] == before["messages"]
    assert after["messages"][n] == {"role": "assistant", "content": r.text}
    assert after["messages"][n + 1]["role"] == "user" and len(after["messages"]) == n + 2
  fig = http.summary(results, makespan, planned=3)
  assert fig["cached_token_share"] == (0 + 5 + 10) / (10 + 20 + 30)
  assert fig["completion_tokens"] == 6


def test_429_past_the_deadline_fails_the_request_and_stops_its_user():
  def busy(request):
    del request
    return httpx.Response(429, headers={"Retry-After": "0"}, json={"error": {"message": "busy"}})

  work = http.TokenChat(workloads.Chat(chat(users=2, turns=3, max_new_tokens=4, seed=1)))
  target = http.Target(url="http://fake/v1", model="m", request_timeout_s=0.3)
  results, makespan = http.run_load(target, work, rate=1000.0,
                                    transport=httpx.MockTransport(busy))
  assert len(results) == 2 and all(r.status == 429 and not r.ok for r in results)
  assert all(r.rejected_429 >= 2 for r in results)  # retried until the deadline
  fig = http.summary(results, makespan, planned=6)
  assert fig["requests_failed"] == 2 and fig["requests_not_sent"] == 4
  assert fig["errors_by_status"] == {"429": sum(r.rejected_429 for r in results)}
  assert math.isnan(fig["ttft_p50_s"]) and fig["requests_ok"] == 0


def test_refusals_and_broken_streams_are_counted_by_kind():
  answers = iter([
      httpx.Response(400, json={"error": {"message": "prompt holds token id 900"}}),
      httpx.Response(200, text='data: {"choices": [{"index": 0, "token_ids": [3]}]}\n\n'),
      sse({"error": {"message": "the engine failed"}})])
  work = http.TokenChat(workloads.Chat(chat(users=3, turns=2, max_new_tokens=4, seed=2)))
  results, makespan = http.run_load(
      http.Target(url="http://fake/v1", model="m"), work, rate=1000.0,
      transport=httpx.MockTransport(lambda request: next(answers)))
  fig = http.summary(results, makespan, planned=6)
  assert fig["errors_by_status"] == {"400": 1, "incomplete_stream": 1, "stream_error": 1}
  assert fig["error_examples"]["400"] == "prompt holds token id 900"
  assert fig["error_examples"]["stream_error"] == "the engine failed"
  assert fig["requests_not_sent"] == 3


def test_a_token_conversation_needs_token_ids_in_the_stream():
  text_only = lambda request: sse({"choices": [{"index": 0, "text": "hi"}]})
  work = http.TokenChat(workloads.Chat(chat(users=1, turns=2, max_new_tokens=4, seed=2)))
  with pytest.raises(InputError, match="token_ids"):
    http.run_load(http.Target(url="http://fake/v1", model="m"), work, rate=1000.0,
                  transport=httpx.MockTransport(text_only))
