"""Prefill here, decode there: launch/server.py --role=prefill and --role=decode on one
pool, driven by launch/pd_proxy.py as a vLLM-style proxy drives a pair. Each node runs its
engine in a process of its own (the default --engine_process, pool or not): the hand-off is
an engine command its core carries out, the front holds no cache. The pair's tokens equal
one engine's (greedy and seeded), the decode node finds the prompt's blocks in the pool,
each node's /metrics counts its side of the hand-off, and kv_transfer_params carry vLLM's
field names; bad params are a 400 naming them. A decode node killed mid-stream (the last
test) leaves the proxy's client an error event and [DONE], not a stream that just stops."""

import json
import os
import re
import runpy
import signal

import httpx
import openai
import pytest

import helpers
import jaxkv
from jaxkv.tools.bench.http import ROOT, ServerProcess
from jaxkv.worker.tiers.pool.master import LocalMaster

# Lower-tier hits always fetched: the plan's measured costs (which may recompute a prefix
# on a loaded machine) would make the hit counts below depend on the machine's load.
OVERRIDES = ("--config.cache.max_pages_per_seq=16", "--config.scheduler.decision=fetch")
MODEL = "llama-tiny-random"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  work = tmp_path_factory.mktemp("pd")
  with LocalMaster(log_path=str(work / "master.log"), lease_ms=60_000) as m:
    pool = [f"--pool={m.address}", f"--pool_metadata={m.metadata}", "--pool_segment_mb=32",
            *OVERRIDES]
    with ServerProcess([*pool, "--role=prefill"], workdir=str(work)) as prefill, \
         ServerProcess([*pool, "--role=decode"], workdir=str(work)) as decode:
      prefill.wait_ready(600)
      decode.wait_ready(600)
      with ServerProcess([f"--prefill={prefill.base}", f"--decode={decode.base}"],
                         script=os.path.join("launch", "pd_proxy.py"),
                         workdir=str(work)) as proxy:
        proxy.wait_ready(120)
        yield {"prefill": prefill, "decode": decode, "proxy": proxy}


@pytest.fixture(scope="module")
def reference():
  from jaxkv.tools import builder
  cfg = runpy.run_path(os.path.join(ROOT, "configs", "cpu_tiny.py"))["get_config"]()
  cfg.cache.max_pages_per_seq = 16
  return builder.build_engine(cfg, cache="nocache")


def prompt(seed, n=90):
  return [(seed * 31 + i * 7) % 250 + 1 for i in range(n)]


def test_both_nodes_run_their_engine_in_a_process_of_its_own_with_the_pool(pair):
  """A server with --pool no longer keeps its engine in the HTTP process: each node's ready
  file names its engine core, a live process other than the server's."""
  for node in ("prefill", "decode"):
    server = pair[node]
    assert server.core_pid is not None, f"the {node} node runs its engine in its HTTP process"
    assert server.core_pid != server.proc.pid
    os.kill(server.core_pid, 0)  # (raises if no such process)


def test_the_pairs_tokens_equal_one_engines_and_the_decode_node_reads_the_pool(pair, reference):
  client = openai.OpenAI(base_url=pair["proxy"].url, api_key="none", max_retries=0, timeout=120)
  for seed, sampling in ((1, {"temperature": 0}), (2, {"temperature": 0.8, "seed": 7})):
    p = prompt(seed)
    want = reference.generate([p], jaxkv.SamplingParams(
        max_new_tokens=6, **{"temperature": sampling["temperature"],
                             **({"seed": sampling["seed"]} if "seed" in sampling else {})}))[0]
    r = client.completions.create(model=MODEL, prompt=p, max_tokens=6,
                                  extra_body={"return_token_ids": True}, **sampling)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.usage.prompt_tokens_details.cached_tokens >= 16 * ((len(p) - 1) // 16)
    # Streamed through the proxy: the same tokens.
    stream = client.completions.create(model=MODEL, prompt=p, max_tokens=6, stream=True,
                                       extra_body={"return_token_ids": True}, **sampling)
    ids = [t for chunk in stream for t in (chunk.choices[0].model_extra.get("token_ids") or [])]
    assert ids == want


def pd_counters(server) -> dict[str, float]:
  """The node's hand-off counters, as its /metrics exports them (``jaxkv_pd_*_total``)."""
  text = httpx.get(f"{server.base}/metrics", timeout=30).text
  found = re.findall(r"^jaxkv_(pd_\w+)_total\{[^}]*\} (\S+)$", text, re.M)
  return {name: float(v) for name, v in found}


def test_a_prefill_answer_carries_vllms_kv_transfer_params(pair):
  p = prompt(3)
  body = {"model": MODEL, "prompt": p, "max_tokens": 1,
          "kv_transfer_params": {"do_remote_decode": True}}
  before = {node: pd_counters(pair[node]) for node in ("prefill", "decode")}
  r = httpx.post(f"{pair['prefill'].url}/completions", json=body, timeout=120).json()
  params = r["kv_transfer_params"]
  assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
  blocks = len(params["remote_block_ids"])
  assert blocks == (len(p) - 1) // 16
  assert params["remote_engine_id"] and params["remote_port"] == pair["prefill"].port
  # A decode node given them hits every promised block.
  d = httpx.post(f"{pair['decode'].url}/completions", json=dict(
      body, max_tokens=3, kv_transfer_params=params), timeout=120).json()
  assert d["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * blocks
  # Each node's /metrics counts its side of the hand-off.
  grew = {node: {k: v - before[node][k] for k, v in pd_counters(pair[node]).items()}
          for node in ("prefill", "decode")}
  assert grew["prefill"] == {"pd_prefills_handed_off": 1, "pd_prefills_not_handed_off": 0,
                             "pd_blocks_handed_off": blocks, "pd_decodes_received": 0,
                             "pd_blocks_promised": 0}, grew
  assert grew["decode"] == {"pd_prefills_handed_off": 0, "pd_prefills_not_handed_off": 0,
                            "pd_blocks_handed_off": 0, "pd_decodes_received": 1,
                            "pd_blocks_promised": blocks}, grew


def test_a_hand_off_names_the_servers_own_address_never_the_clients_host_header(pair):
  """remote_host/remote_port are where this server serves (--host and the port it bound),
  not what a client's Host header says: a caller cannot point the proxy's next hop anywhere."""
  body = {"model": MODEL, "prompt": prompt(6), "max_tokens": 1,
          "kv_transfer_params": {"do_remote_decode": True}}
  r = httpx.post(f"{pair['prefill'].url}/completions", json=body, timeout=120,
                 headers={"Host": "evil.example:1"})
  assert r.status_code == 200, r.text
  params = r.json()["kv_transfer_params"]
  assert "evil.example" not in json.dumps(params), params
  assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", pair["prefill"].port)
  assert len(params["remote_block_ids"]) == (len(body["prompt"]) - 1) // 16


def test_a_bad_advertise_address_is_refused_before_start():
  code, _, err = helpers.run_script(["launch/server.py", "--advertise_address=host:0",
                                     *OVERRIDES], timeout_s=120)
  assert code == 2 and "--advertise_address='host:0' must be HOST or HOST:PORT" in err, err


def test_a_prefill_node_refuses_a_stream_it_would_not_hand_off(pair):
  body = {"model": MODEL, "prompt": prompt(5, 20), "max_tokens": 1, "stream": True}
  r = httpx.post(f"{pair['prefill'].url}/completions", json=body, timeout=60)
  assert r.status_code == 400 and r.json()["error"]["param"] == "stream"


@pytest.mark.parametrize("node,params,needle", [
    ("decode", {"do_remote_decode": True}, "this node decodes"),
    ("prefill", {"do_remote_prefill": True}, "this node prefills"),
    ("decode", {"do_remote_prefill": True, "remote_block_ids": ["x"]}, "remote_block_ids"),
    ("decode", "yes", "must be an object"),
])
def test_bad_kv_transfer_params_are_a_400_naming_them(pair, node, params, needle):
  body = {"model": MODEL, "prompt": prompt(4, 20), "max_tokens": 1,
          "kv_transfer_params": params}
  r = httpx.post(f"{pair[node].url}/completions", json=body, timeout=60)
  assert r.status_code == 400 and needle in r.json()["error"]["message"]
  assert r.json()["error"]["param"] == "kv_transfer_params"


def test_a_role_without_a_pool_is_refused_before_start():
  code, _, err = helpers.run_script(["launch/server.py", "--role=decode", *OVERRIDES],
                                    timeout_s=120)
  assert code == 2 and "--role=decode hands KV over through the pool" in err


def test_a_decode_node_killed_mid_stream_ends_the_proxys_stream_with_an_error_event(pair):
  """Runs last: it kills the decode node (its group, engine core included) once the first
  token has come through the proxy. The client gets the tokens that came, whole, then
  OpenAI's error object as an event, then [DONE]."""
  body = {"model": MODEL, "prompt": prompt(8, 40), "max_tokens": 160, "temperature": 0,
          "return_token_ids": True, "stream": True}
  events = []
  # A read that waits 30 s for a byte fails the test: a hang is an error here.
  with httpx.stream("POST", f"{pair['proxy'].url}/completions", json=body,
                    timeout=httpx.Timeout(30.0)) as r:
    assert r.status_code == 200, r.read()
    for line in r.iter_lines():
      if line.startswith("data: "):
        events.append(line.removeprefix("data: "))
        if len(events) == 1:
          os.killpg(pair["decode"].proc.pid, signal.SIGKILL)
  assert events[-1] == "[DONE]", events[-3:]
  error = json.loads(events[-2])["error"]
  assert error["type"] == "server_error" and error["code"] == "upstream_stream_broken", error
  assert "the decode node broke off this stream" in error["message"], error
  tokens = [t for e in events[:-2] for t in json.loads(e)["choices"][0]["token_ids"]]
  assert 0 < len(tokens) < body["max_tokens"], len(tokens)  # broken off midway
