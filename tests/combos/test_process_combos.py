"""Combinations of features that each have their own process tests, run together in real
processes on loopback: a prefill node, a decode node and launch/pd_proxy.py on one Mooncake
master, with tenants (API keys), a deployment key and a short soft pin on the hand-off's
blocks; a raw pool client in this process stands for another deployment sharing the pool;
launch/router.py in front of the pair and the decode node.

- The pair answers with log-probabilities as one engine does, for each tenant; a wrong key
  is refused before either node works, and one tenant's hand-off is no hit for another.
- A hand-off nobody collects: once its pin has ended, the pool evicts its blocks under
  another deployment's puts; a late collect is a miss (recomputed), the answer exact.
- The pool's master killed and restarted under the pair: answers stay exact, and
  hand-offs hit the pool again once the prefill node has remounted its segment.
- A replica (the proxy) killed mid-stream: the client's stream ends with an error event and
  [DONE] (no hang), the router counts the break and takes the replica out at once, and the
  next requests go to the live replica, exactly.

Every process is started with its own process group and killed with it on every path
(``ServerProcess``, ``LocalMaster``). The last test kills the proxy: it runs last."""

import contextlib
import json
import os
import re
import runpy
import signal
import time

import httpx
import numpy as np
import pytest

import helpers
import jaxkv
from jaxkv.entrypoints.openai.router import REPLICA_HEADER
from jaxkv.tools.bench.http import ROOT, ServerProcess
from jaxkv.worker.tiers.pool.master import LocalMaster, free_port

MODEL = "llama-tiny-random"
PAGE = 16
# Lower-tier hits always fetched (the measured costs could recompute them on a loaded machine).
OVERRIDES = ("--config.cache.max_pages_per_seq=16", "--config.scheduler.decision=fetch")
KEYS = {"key-alice-combos-0123456": "alice", "key-bob-combos-01234567": "bob"}
ALICE, BOB = ({"authorization": f"Bearer {k}"} for k in KEYS)
DEPLOYMENT_KEY = bytes(range(100, 140))
PIN_S = 1.0  # the prefill node's soft pin on every block it hands off
SEGMENT_MB = 16  # the pool's one segment (the prefill node's); the client's smallest
BLOCK_BYTES = 2 * 4 * 2 * 32 * PAGE * 4  # K and V, 4 layers, 2 KV heads, head_dim 32, float32

# configs/cpu_tiny.py with the prefill node's pin shortened (no flag sets tiers.pool_pin_s).
CONFIG = """
import runpy
def get_config():
  c = runpy.run_path({path!r})["get_config"]()
  with c.unlocked():
    c.tiers.pool_pin_s = {pin_s!r}
  return c
"""


def _secret(path, text):
  path.write_text(text)
  path.chmod(0o600)
  return str(path)


def reference_engine():
  """One engine recomputing every prompt, in this process: what the pair must answer."""
  from jaxkv.tools import builder
  cfg = runpy.run_path(os.path.join(ROOT, "configs", "cpu_tiny.py"))["get_config"]()
  cfg.cache.max_pages_per_seq = 16
  return builder.build_engine(cfg, cache="nocache")


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
  """Every process started at once (ports chosen here, so that the proxy and the router
  need not wait for the nodes to name theirs), the reference built while they start."""
  work = tmp_path_factory.mktemp("combos")
  keys = _secret(work / "keys.json", json.dumps(KEYS))
  key = _secret(work / "deployment.key", DEPLOYMENT_KEY.hex())
  config = work / "pinned.py"
  config.write_text(CONFIG.format(path=os.path.join(ROOT, "configs", "cpu_tiny.py"),
                                  pin_s=PIN_S))
  url = {name: f"http://127.0.0.1:{free_port()}" for name in ("prefill", "decode", "proxy")}
  port = lambda name: f"--port={url[name].rsplit(':', 1)[1]}"  # (after ServerProcess's 0)
  # Leases end fast, so that only the pin keeps a block from eviction.
  with LocalMaster(log_path=str(work / "master.log"), lease_ms=300) as master, \
       contextlib.ExitStack() as stack:
    common = [f"--config={config}", f"--pool={master.address}",
              f"--pool_metadata={master.metadata}", f"--api_keys_file={keys}",
              f"--deployment_key_file={key}", "--metrics_tenants=alice", *OVERRIDES]
    start = lambda flags, script="server.py": stack.enter_context(ServerProcess(
        flags, script=os.path.join("launch", script), workdir=str(work)))
    box = {"master": master, "work": work,
           "prefill": start([*common, "--role=prefill", f"--pool_segment_mb={SEGMENT_MB}",
                             port("prefill")]),
           "decode": start([*common, "--role=decode", "--pool_segment_mb=0", port("decode")]),
           "proxy": start([f"--prefill={url['prefill']}", f"--decode={url['decode']}",
                           port("proxy")], "pd_proxy.py"),
           "router": start([f"--replicas={url['proxy']},{url['decode']}",
                            "--routing=round_robin"], "router.py")}
    try:
      box["reference"] = reference_engine()
      for name in ("prefill", "decode", "proxy", "router"):
        box[name].wait_ready(600)
      yield box
    finally:  # killed, not drained: nothing of theirs is read after the tests
      for name in ("router", "proxy", "decode", "prefill"):
        box[name].close(timeout_s=1)


def prompt(seed, n):
  return [(seed * 29 + i * 13) % 250 + 1 for i in range(n)]


def complete(url, body, headers=ALICE, timeout=120):
  return httpx.post(f"{url}/completions", json={"model": MODEL, "return_token_ids": True,
                                                **body}, headers=headers, timeout=timeout)


def pool_hits(server) -> float:
  """The server's blocks reused from the pool (its Prometheus counter)."""
  text = httpx.get(f"{server.base}/metrics", headers=ALICE, timeout=30).text
  found = re.findall(r'^jaxkv_block_hits_total\{[^}]*tier="pool"[^}]*\} (\S+)$', text, re.M)
  return sum(float(v) for v in found)


def log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_the_pair_answers_each_tenant_with_one_engines_tokens_and_logprobs(pd):
  """Sampled, with logprobs=2, a tenant's key and the deployment key: each tenant's answer
  through the proxy is the engine's (tokens, their log-probabilities, the two likeliest),
  and the decode node took the prompt's blocks from the pool."""
  p = prompt(1, 90)
  sampling = jaxkv.SamplingParams(max_new_tokens=5, temperature=0.7, seed=5)
  (want,), (logits,) = pd["reference"].generate([p], sampling, return_logits=True)
  want_lp = log_softmax(logits)
  for headers in (ALICE, BOB):
    hits = pool_hits(pd["decode"])
    r = complete(pd["proxy"].url, {"prompt": p, "max_tokens": 5, "temperature": 0.7,
                                   "seed": 5, "logprobs": 2}, headers)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == want
    lp = choice["logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"],
                               [want_lp[i, t] for i, t in enumerate(want)], atol=1e-4)
    for i, top in enumerate(lp["top_logprobs"]):
      best = np.argsort(-want_lp[i])[:2]
      assert {f"token_id:{t}" for t in best} <= set(top), (i, top, best)
      for t in best:
        assert abs(top[f"token_id:{t}"] - want_lp[i, t]) < 1e-4
    # The decode node fetched every block the prefill node promised (5 full ones).
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == PAGE * ((len(p) - 1) // PAGE), cached
    assert pool_hits(pd["decode"]) - hits == (len(p) - 1) // PAGE


def test_the_pair_answers_n_samples_as_one_engine_does(pd):
  p = prompt(2, 70)
  want = [pd["reference"].generate([p], jaxkv.SamplingParams(
      max_new_tokens=4, temperature=0.9, seed=11 + j))[0] for j in range(2)]
  r = complete(pd["proxy"].url, {"prompt": p, "max_tokens": 4, "temperature": 0.9,
                                 "seed": 11, "n": 2})
  assert r.status_code == 200, r.text
  got = sorted(r.json()["choices"], key=lambda c: c["index"])
  assert [c["token_ids"] for c in got] == want
  # The decode node's choices share the blocks the prefill node handed off (computed once).
  cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
  assert cached >= PAGE * ((len(p) - 1) // PAGE), cached


def test_a_wrong_key_is_refused_and_one_tenants_hand_off_is_no_hit_for_another(pd):
  p = prompt(3, 70)
  want = pd["reference"].generate([p], 4)[0]
  before = pool_hits(pd["decode"])
  bad = complete(pd["proxy"].url, {"prompt": p, "max_tokens": 4, "temperature": 0},
                 {"authorization": "Bearer key-mallory-000000000"})
  assert bad.status_code == 401, bad.text
  # Alice's prompt handed off; bob brings her kv_transfer_params to the decode node.
  first = complete(pd["prefill"].url, {"prompt": p, "max_tokens": 1, "temperature": 0,
                                       "kv_transfer_params": {"do_remote_decode": True}})
  assert first.status_code == 200, first.text
  params = first.json()["kv_transfer_params"]
  assert len(params["remote_block_ids"]) == (len(p) - 1) // PAGE
  r = complete(pd["decode"].url, {"prompt": p, "max_tokens": 4, "temperature": 0,
                                  "kv_transfer_params": params}, BOB)
  assert r.status_code == 200, r.text
  assert r.json()["choices"][0]["token_ids"] == want
  assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not his blocks
  assert pool_hits(pd["decode"]) == before  # (the 401 ran nothing either)
  # Alice's own collect hits them all.
  r = complete(pd["decode"].url, {"prompt": p, "max_tokens": 4, "temperature": 0,
                                  "kv_transfer_params": params})
  assert r.json()["choices"][0]["token_ids"] == want
  assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == PAGE * len(
      params["remote_block_ids"])


def fill_pool(master, n_values):
  """Another deployment's puts into the pool (a raw client lending nothing): ``n_values``
  values of one block's size, unpinned. Returns the put codes."""
  from jaxkv.worker.tiers.pool import native
  native.load_store()
  from mooncake.store import MooncakeDistributedStore, ReplicateConfig
  store = MooncakeDistributedStore()
  assert store.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "",
                     master.address) == 0
  try:
    config = ReplicateConfig()
    config.replica_num = 1
    value = b"\x5a" * BLOCK_BYTES
    codes = [store.put(f"other-deployment-{i}", value, config) for i in range(n_values)]
    gone = sum(store.is_exist(f"other-deployment-{i}") != 1 for i in range(n_values))
    return codes, gone
  finally:
    store.close()


def test_a_hand_off_nobody_collects_is_evicted_after_its_pin_and_a_late_collect_recomputes(
    pd):
  p = prompt(4, 97)
  want = pd["reference"].generate([p], 4)[0]
  first = complete(pd["prefill"].url, {"prompt": p, "max_tokens": 1, "temperature": 0,
                                       "kv_transfer_params": {"do_remote_decode": True}})
  assert first.status_code == 200, first.text
  params = first.json()["kv_transfer_params"]
  assert len(params["remote_block_ids"]) == (len(p) - 1) // PAGE  # all placed, pinned
  time.sleep(PIN_S + 0.5)  # the pin's time to live (a TTL, not a race: nothing to poll)
  # Twice the pool's capacity from another deployment: the master evicts as it fills.
  capacity = SEGMENT_MB * (1 << 20) // BLOCK_BYTES
  codes, gone = fill_pool(pd["master"], 2 * capacity)
  assert codes.count(0) >= capacity and gone > 0, (codes.count(0), gone)  # it did evict
  hits = pool_hits(pd["decode"])
  late = complete(pd["decode"].url, {"prompt": p, "max_tokens": 4, "temperature": 0,
                                     "kv_transfer_params": params})
  assert late.status_code == 200, late.text
  assert late.json()["choices"][0]["token_ids"] == want
  # The promised blocks were evicted: a miss, recomputed.
  assert late.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
  assert pool_hits(pd["decode"]) == hits


def test_after_the_pools_master_crashes_the_pair_answers_exactly_and_its_hits_resume(pd):
  """The master killed (SIGKILL) and restarted on its ports: it lost its contents and the
  prefill node's segment, the pool's only memory. Every answer through the pair stays
  exact, and hand-offs hit the pool again once the node has remounted its segment (each
  try a new prompt, so that no device copy answers for the pool)."""
  old = pd["master"].proc.pid
  pd["master"].restart()
  assert pd["master"].proc.pid != old
  tries = iter(range(100, 200))

  def hand_off_hits():
    p = prompt(next(tries), 50)
    hits = pool_hits(pd["decode"])
    r = complete(pd["proxy"].url, {"prompt": p, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == pd["reference"].generate([p], 3)[0]
    return pool_hits(pd["decode"]) - hits == (len(p) - 1) // PAGE

  helpers.wait_for(hand_off_hits, 90, "hand-offs through a restarted master hit the pool",
                   interval_s=0.5)


def stream_ids(response, on_first):
  """Token ids of a streamed completion as they come, its error events' objects, and
  whether it ended with [DONE]; ``on_first()`` runs once the first token has arrived."""
  ids, errors, done = [], [], False
  for line in response.iter_lines():
    if line == "data: [DONE]":
      done = True
    elif line.startswith("data: "):
      event = json.loads(line[6:])
      if "error" in event:
        errors.append(event["error"])
        continue
      first = not ids
      ids += (event.get("choices") or [{}])[0].get("token_ids") or []
      if first and ids:
        on_first()
  return ids, errors, done


def test_a_replica_killed_mid_stream_ends_the_stream_and_the_next_go_to_the_live_one(pd):
  """Runs last: it kills the proxy (the router's first replica, a P/D pair behind it). The
  client's stream ends with an error event and [DONE]; the router counts the break and
  takes the replica out at once: the next requests go to the live one without trying it."""
  proxy, decode, router = pd["proxy"], pd["decode"], pd["router"]
  p = prompt(5, 40)
  want = pd["reference"].generate([p], 64)[0]

  def router_stats():
    return httpx.get(f"{router.base}/router/stats", timeout=30).json()

  def replicas():
    return {s["url"]: s for s in router_stats()["replicas"]}

  # Round robin's first turn is the first replica's, once both are seen healthy.
  helpers.wait_for(lambda: all(s["healthy"] for s in replicas().values()), 30,
                   "the router to see both replicas healthy", interval_s=0.2)
  # The pair behind the proxy has compiled the shapes this stream takes (run alone, this
  # test is the first to use them): the stream's 30 s read deadline is for a hang, not a
  # compile. Another prompt, sent to the proxy itself: the router's turns are untouched.
  r = complete(proxy.url, {"prompt": prompt(6, 40), "max_tokens": 64, "temperature": 0})
  assert r.status_code == 200, r.text
  before, log_start = router_stats(), os.path.getsize(router.log_path)
  body = {"model": MODEL, "prompt": p, "max_tokens": 64, "temperature": 0,
          "return_token_ids": True, "stream": True}
  killed = []

  def kill():
    os.killpg(proxy.proc.pid, signal.SIGKILL)
    killed.extend((time.monotonic(), router_stats()["health_checks"]))

  # A read that waits 30 s for a byte fails the test: a hang is an error here.
  with httpx.stream("POST", f"{router.url}/completions", json=body, headers=ALICE,
                    timeout=httpx.Timeout(30.0)) as r:
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == proxy.base, r.headers
    ids, errors, done = stream_ids(r, kill)
  assert len(ids) < len(want) and ids == want[:len(ids)], (len(ids), len(want))  # broken off
  # ... and said so: OpenAI's error object, then [DONE].
  assert done and len(errors) == 1, (done, errors)
  assert errors[0]["type"] == "server_error" and errors[0]["code"] == "upstream_stream_broken"
  assert f"replica {proxy.base} broke off this stream" in errors[0]["message"], errors
  # Counted and taken out before the error event was sent (no health check needed).
  after, state = router_stats(), replicas()
  assert after["streams_broken"] - before["streams_broken"] == 1, after
  assert after["replica_failures"] - before["replica_failures"] == 1, after
  assert state[proxy.base]["failures"] == 1 and not state[proxy.base]["healthy"], state
  for _ in range(2):  # neither tries the dead replica (a try would count a retry)
    r = complete(router.url, {"prompt": p, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers[REPLICA_HEADER] == decode.base
    assert r.json()["choices"][0]["token_ids"] == want[:6]
  last, state = router_stats(), replicas()
  assert (last["retries"], last["replica_failures"]) == (
      after["retries"], after["replica_failures"]), (after, last)
  assert not state[proxy.base]["healthy"] and state[decode.base]["healthy"], state
  # A whole health round has begun and ended since the kill (one may have been under way
  # at it), and the dead replica is still out.
  helpers.wait_for(lambda: router_stats()["health_checks"] >= killed[1] + 2, 30,
                   "a health round begun after the kill", interval_s=0.1)
  assert not replicas()[proxy.base]["healthy"]
  with open(router.log_path, "rb") as f:
    f.seek(log_start)
    log = f.read().decode("utf-8", "replace")
  # The break was logged. A round takes out (and logs "failed /health") only a replica it
  # finds in: a round under way at the kill may reach the dead replica before the broken
  # stream does, but none after it (the break took it out already).
  broke = log.find(f"replica {proxy.base} broke off a stream")
  assert broke >= 0 and f"{proxy.base} failed /health" not in log[broke:], log
