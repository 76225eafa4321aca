"""Load an OpenAI-compatible server with multi-turn chats: Poisson arrivals, streamed answers.

  python launch/load.py --url=http://127.0.0.1:8000/v1 --request_rate=2 --users=8 --turns=4
  python launch/load.py --url=https://host/v1 --mode=chat --model=NAME --json_out=/tmp/load.json

Each user holds one conversation. Its first request arrives by a Poisson process of
--request_rate users per second; each next turn arrives --think_time_s (mean, exponential)
after the previous answer ended, and is the conversation so far plus a new message, so
later turns share their prefix with earlier ones. --mode=ids sends token ids to
/completions (no tokenizer needed: it drives launch/server.py's random-weight default;
the answer's token_ids join the conversation); --mode=chat sends text messages to
/chat/completions. Prompts are a function of --seed. Answers are streamed (SSE) with
usage in the last event. A 429 is retried after its Retry-After until the request's
deadline (--request_timeout_s after its arrival); a user whose request fails stops.
jaxkv.tools.bench.http does the work (and times it: see there for what each figure counts).

Printed, and written by --json_out as one JSON object (seconds and tokens):
  ttft_p50_s, ttft_p90_s, ttft_p99_s  arrival to the first event that carries a token
  itl_p50_s, itl_p90_s                gaps between events that carry tokens
  tokens_per_s                        completion tokens (usage) over the makespan
  requests_per_s                      requests answered in full over the makespan
  cached_token_share                  cached_tokens / prompt_tokens (usage), answered requests
  errors_by_status                    {"429": answers that said retry, "<status>" or
                                      "timeout" or ...: requests that failed}
  requests, requests_ok, requests_failed, requests_not_sent, completion_tokens,
  prompt_tokens, cached_tokens, makespan_s, mean_in_flight, by_turn (per turn: requests_ok,
  ttft_p50_s, cached_token_share), error_examples, and the run's settings.
Exit status 1 when no request was answered.
"""

import logging
import math
import os
import sys

from absl import flags

import _common

_URL = flags.DEFINE_string("url", None, "The API's base URL, e.g. http://127.0.0.1:8000/v1.")
_MODEL = flags.DEFINE_string("model", None, "The model to ask (default: the first that "
                             "GET {url}/models lists).")
_API_KEY = flags.DEFINE_string("api_key", None, "Sent as 'Authorization: Bearer KEY' "
                               "(default: $OPENAI_API_KEY, if set).")
_MODE = flags.DEFINE_enum("mode", "ids", ["ids", "chat"], "ids: token ids to /completions; "
                          "chat: text messages to /chat/completions.")
_RATE = flags.DEFINE_float("request_rate", 2.0, "Users arriving per second (Poisson).",
                           lower_bound=1e-6)
_USERS = flags.DEFINE_integer("users", 8, "Users (conversations).", lower_bound=1)
_TURNS = flags.DEFINE_integer("turns", 4, "Requests each user sends, one after another.",
                              lower_bound=1)
_THINK = flags.DEFINE_float("think_time_s", 0.0, "Mean think time (exponential) between an "
                            "answer and the user's next request.", lower_bound=0.0)
_SEED = flags.DEFINE_integer("seed", 0, "Arrival times and prompts are drawn from it.")
_VOCAB = flags.DEFINE_integer("vocab_size", 512, "--mode=ids: prompt ids are drawn from "
                              "[1, vocab_size); at most the model's vocabulary.", lower_bound=2)
_SYSTEM = flags.DEFINE_integer("system_prompt_len", 128, "A system prompt every user shares: "
                               "tokens (ids) or words (chat).", lower_bound=0)
_MESSAGE = flags.DEFINE_list("message_len", ["32", "96"], "LOW,HIGH: each user message's "
                             "length, uniform, inclusive: tokens (ids) or words (chat).")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 16, "Most tokens per answer.", lower_bound=1)
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy.", lower_bound=0.0,
                                  upper_bound=2.0)
_IGNORE_EOS = flags.DEFINE_bool("ignore_eos", False, "Ask for all --max_tokens of every "
                                "answer (jaxkv and vLLM take it; OpenAI's API does not).")
_TIMEOUT = flags.DEFINE_float("request_timeout_s", 120.0, "Deadline of each request, from "
                              "its arrival, across its retries.", lower_bound=1e-3)
_JSON_OUT = flags.DEFINE_string("json_out", "", "Write the figures here as one JSON object.")
flags.mark_flag_as_required("url")


@flags.validator("message_len", "must be LOW,HIGH with 1 <= LOW <= HIGH, e.g. 32,96")
def _check_message_len(value):
  try:
    low, high = (int(v) for v in value)
  except ValueError:
    return False
  return 1 <= low <= high


def main(argv):
  del argv
  _common.check_output(_JSON_OUT.value, "json_out")
  # One log line per request from httpx would cost the client CPU (and the server, when
  # they share a machine) and bury the progress lines.
  logging.getLogger("httpx").setLevel(logging.WARNING)
  from jaxkv.tools import workloads
  from jaxkv.tools.bench import http
  api_key = _API_KEY.value or os.environ.get("OPENAI_API_KEY") or None
  model = _MODEL.value or http.served_models(_URL.value, api_key)[0]
  target = http.Target(url=_URL.value, model=model, api_key=api_key,
                       request_timeout_s=_TIMEOUT.value, temperature=_TEMPERATURE.value,
                       ignore_eos=_IGNORE_EOS.value)
  low, high = (int(v) for v in _MESSAGE.value)
  if _MODE.value == "ids":
    work = http.TokenChat(workloads.Chat(workloads.ChatSpec(
        users=_USERS.value, turns=_TURNS.value, system_prompt_tokens=_SYSTEM.value,
        user_tokens=(low, high), max_new_tokens=_MAX_TOKENS.value, vocab_size=_VOCAB.value,
        seed=_SEED.value)))
  else:
    work = http.TextChat(users=_USERS.value, turns=_TURNS.value, system_words=_SYSTEM.value,
                         message_words=(low, high), max_tokens=_MAX_TOKENS.value,
                         seed=_SEED.value)
  print(f"{_USERS.value} users x {_TURNS.value} turns at {_RATE.value:g} users/s to "
        f"{target.url} ({model}, --mode={_MODE.value})", flush=True)
  results, makespan = http.run_load(target, work, rate=_RATE.value, think_s=_THINK.value,
                                    seed=_SEED.value)
  fig = http.summary(results, makespan, planned=_USERS.value * _TURNS.value)
  _print(fig)
  _common.write_json(_JSON_OUT.value, {
      "url": target.url, "model": model, "mode": _MODE.value, "request_rate": _RATE.value,
      "users": _USERS.value, "turns": _TURNS.value, "think_time_s": _THINK.value,
      "max_tokens": _MAX_TOKENS.value, "temperature": _TEMPERATURE.value,
      "seed": _SEED.value, **fig})
  if not fig["requests_ok"]:
    sys.exit(1)


def _print(fig: dict) -> None:
  ms = lambda *keys: " / ".join("-" if math.isnan(fig[k]) else f"{1e3 * fig[k]:.1f}"
                                for k in keys)
  rows = [
      ("requests ok / sent", f"{fig['requests_ok']} / {fig['requests']}"
       + (f" ({fig['requests_not_sent']} not sent)" if fig["requests_not_sent"] else "")),
      ("TTFT p50/p90/p99 (ms)", ms("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
      ("ITL p50/p90 (ms)", ms("itl_p50_s", "itl_p90_s")),
      ("tokens/s", f"{fig['tokens_per_s']:.1f}"),
      ("requests/s", f"{fig['requests_per_s']:.2f}"),
      ("cached token share", f"{fig['cached_token_share']:.3f} ({fig['cached_tokens']} of "
       f"{fig['prompt_tokens']} prompt tokens)"),
      ("makespan (s)", f"{fig['makespan_s']:.2f}"),
      ("errors by status", ", ".join(f"{k}: {v}" for k, v in fig["errors_by_status"].items())
       or "none"),
  ]
  for label, value in rows:
    print(f"{label:24s} {value}")
  for turn in fig["by_turn"]:
    print(f"  turn {turn['turn']:<3d} {turn['requests_ok']:4d} ok  TTFT p50 "
          f"{1e3 * turn['ttft_p50_s']:8.1f} ms  cached {turn['cached_token_share']:.3f}")
  for kind, message in fig["error_examples"].items():
    print(f"  {kind}: {message}")


if __name__ == "__main__":
  _common.run(main)
