"""Replicas a router can see: two real launch/server.py replicas publish KV events, Dynamo's
standalone KV indexer (a reader we did not write) reads them, and launch/router.py sends
each request where the indexer says its prefix is. The indexer's scores equal what the
replica itself reports reusing, follow evictions down to host memory, and are rebuilt
after a restart; a replica killed mid-run has its requests answered by the other, exactly.
Tenants (API keys) stay isolated on every replica and in the router: it checks keys before
it routes, and asks the indexer with each tenant's own mapped ids, so no caller learns from
it what another tenant sent."""

import concurrent.futures
import json
import os
import runpy
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import helpers
from jaxkv.entrypoints.openai.router import REPLICA_HEADER, tenant_tokens
from jaxkv.tools.bench.http import ROOT, ServerProcess
from jaxkv.tools.bench.indexer import DynamoIndexer
from jaxkv.worker.tiers.pool.master import free_port

MODEL = "llama-tiny-random"
KEYS = {"key-alice-0123456789": "alice", "key-bob-0123456789ab": "bob"}
ALICE = {"authorization": "Bearer key-alice-0123456789"}  # a metrics tenant of the router
OVERRIDES = ("--config.cache.max_pages_per_seq=16", "--config.scheduler.decision=fetch")
PAGE = 16


def events_flags(ports):
  return [f"--kv_events=tcp://127.0.0.1:{ports[0]}",
          f"--kv_events_replay=tcp://127.0.0.1:{ports[1]}"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
  work = tmp_path_factory.mktemp("replicas")
  keys = work / "keys.json"
  keys.write_text(json.dumps(KEYS))
  os.chmod(keys, 0o600)
  ports = {"a": (free_port(), free_port()), "b": (free_port(), free_port())}
  # A: a small device budget over a host tier, so its blocks move down while it serves.
  a_args = [*OVERRIDES, f"--api_keys_file={keys}", "--device_pages=20", "--host_pages=96",
            "--metrics_tenants=alice", *events_flags(ports["a"])]
  b_args = [*OVERRIDES, f"--api_keys_file={keys}", *events_flags(ports["b"])]
  # C: one batch row and no waiting room, so a second request while one runs is a 429.
  c_args = [*OVERRIDES, "--config.mesh.data=1", "--config.mesh.model=1",
            "--config.engine.max_seqs_per_shard=1", "--max_waiting=0"]
  box = {"work": work, "a_args": a_args}
  with DynamoIndexer(log_dir=str(work)) as idx, \
       ServerProcess(a_args, workdir=str(work)) as a, \
       ServerProcess(b_args, workdir=str(work)) as b, \
       ServerProcess(c_args, workdir=str(work)) as c:  # all three compile at once
    box.update(idx=idx, a=a, b=b, c=c)
    for server in (a, b, c):
      server.wait_ready(600)
    spec = ",".join(f"tcp://127.0.0.1:{p[0]}@tcp://127.0.0.1:{p[1]}" for p in ports.values())
    with ServerProcess([f"--replicas={a.base},{b.base}", f"--indexer={idx.url}",
                        f"--replica_events={spec}", f"--block_size={PAGE}",
                        f"--api_keys_file={keys}", "--metrics_tenants=alice"],
                       script=os.path.join("launch", "router.py"), workdir=str(work)) as router:
      router.wait_ready(120)
      box["router"] = router
      yield box
      if box.get("a2") is not None:
        box["a2"].close()


@pytest.fixture(scope="module")
def reference():
  from jaxkv.tools import builder
  cfg = runpy.run_path(os.path.join(ROOT, "configs", "cpu_tiny.py"))["get_config"]()
  cfg.cache.max_pages_per_seq = 16
  return builder.build_engine(cfg, cache="nocache")


def complete(url, prompt, *, key="key-alice-0123456789", max_tokens=6, stream=False, timeout=120):
  body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
          "return_token_ids": True, "stream": stream, "temperature": 0}
  headers = {"authorization": f"Bearer {key}"} if key else {}
  if not stream:
    r = httpx.post(f"{url}/completions", json=body, headers=headers, timeout=timeout)
    return r
  ids, replica = [], None
  with httpx.stream("POST", f"{url}/completions", json=body, headers=headers,
                    timeout=timeout) as r:
    assert r.status_code == 200, r.read()
    replica = r.headers.get(REPLICA_HEADER)
    for line in r.iter_lines():
      if line.startswith("data: ") and line != "data: [DONE]":
        ids += json.loads(line[6:])["choices"][0].get("token_ids") or []
  return ids, replica


def words(seed, n):
  return [(seed * 37 + i * 11) % 250 + 1 for i in range(n)]


def alice(tokens):
  """``tokens`` as the replicas' events tell alice's blocks (and the router asks for them)."""
  return tenant_tokens(tokens, "alice")


def router_stats(router):
  r = httpx.get(f"{router.base}/router/stats", headers=ALICE)
  assert r.status_code == 200, r.text
  return r.json()


def held(idx, tokens, worker: int, tier: str = "device") -> int:
  """Tokens of alice's ``tokens`` the indexer says ``worker`` holds on ``tier``."""
  return idx.query(alice(tokens)).get(worker, {}).get(tier, 0)


def await_scores(idx, tokens, worker: int, want, what: str, timeout_s: float = 30.0) -> dict:
  """The indexer's scores for ``worker`` (``{"device": n, "host": n, "disk": n}``) once
  ``want(scores)`` holds: events reach it asynchronously. Past the deadline the test fails
  with the last scores seen."""
  seen = []
  try:
    helpers.wait_for(lambda: want(seen.append(idx.query(alice(tokens)).get(worker, {}))
                                  or seen[-1]), timeout_s, what, interval_s=0.1)
  except BaseException:
    print(f"the indexer's last scores for worker {worker}: {seen[-1:]}")
    raise
  return seen[-1]


def await_held(idx, tokens, worker: int, want, what: str, tier: str = "device") -> int:
  """``await_scores`` for one tier's score: ``want(score)``; returns the score."""
  return await_scores(idx, tokens, worker, lambda s: want(s.get(tier, 0)), what).get(tier, 0)


def device_blocks(server) -> int:
  """Blocks the replica itself says it holds on device (its /metrics, a metrics tenant's key)."""
  text = httpx.get(f"{server.base}/metrics", headers=ALICE, timeout=30).text
  return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "jaxkv_cached_blocks" and s.labels.get("tier") == "device"))


def test_the_indexer_scores_what_the_replica_reuses_and_follows_its_evictions(fleet):
  """What A reused for each turn is what the indexer comes to score for the part of the
  prompt A had seen (the earlier turns: the new words were never sent); after all turns the
  indexer's device score is every block A itself counts on device (its /metrics)."""
  a, idx = fleet["a"], fleet["idx"]
  history = []
  for turn in range(3):
    prompt = history + words(turn + 1, 23)
    r = complete(a.url, prompt)
    assert r.status_code == 200, r.text
    body = r.json()
    cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
    if turn:
      assert cached >= PAGE * (len(history) // PAGE) - PAGE and cached > 0
      # The indexer's score for A over the earlier turns is what A reused (the blocks this
      # turn added all hold new words, so they do not count for that prefix).
      await_held(idx, history, 1, lambda n, c=cached: n == c, f"A's score of {cached} tokens")
    else:
      assert cached == 0
    # Its prompt blocks reach the indexer as A's; B holds none of it.
    await_held(idx, prompt, 1, lambda n, p=prompt: n >= PAGE * (len(p) // PAGE),
               "A's prompt blocks in the indexer")
    assert held(idx, prompt, 2, "disk") == 0
    history = prompt + body["choices"][0]["token_ids"]
  # Nothing but this chat ran on A: every block A counts on device is one of its blocks.
  on_device = PAGE * device_blocks(a)
  assert on_device >= PAGE * 4
  before = await_held(idx, history + [1], 1, lambda n: n == on_device,
                      f"the indexer to score A's {on_device} device tokens")
  # Other traffic through A's 20 device pages pushes the chat down to host memory: the
  # indexer's device score falls and its host score keeps the whole prefix.
  for seed in range(40, 46):
    assert complete(a.url, words(seed, 120), max_tokens=2).status_code == 200
  # (the indexer's host score counts device or host)
  await_scores(idx, history + [1], 1,
               lambda n: n.get("device", 0) < before and n.get("host", 0) == before,
               f"the chat's device score below {before}, its host score {before}")


def test_the_router_sends_each_chat_where_its_prefix_is_and_answers_exactly(fleet, reference):
  router, idx = fleet["router"], fleet["idx"]
  chats = {s: [] for s in (101, 102, 103)}
  replicas = {s: set() for s in chats}
  for turn in range(3):
    for seed, history in chats.items():
      prompt = history + words(seed + turn, 21)
      stream = turn == 2 and seed == 101
      want = reference.generate([prompt], 6)[0]
      if stream:
        ids, replica = complete(router.url, prompt, stream=True)
      else:
        r = complete(router.url, prompt)
        assert r.status_code == 200, r.text
        ids, replica = r.json()["choices"][0]["token_ids"], r.headers[REPLICA_HEADER]
        if turn:
          assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= PAGE
      assert ids == want  # through the router, streamed or not: the recomputed tokens
      replicas[seed].add(replica)
      chats[seed] = prompt + ids
      worker = 1 if replica == fleet["a"].base else 2
      await_held(idx, prompt, worker, lambda n, p=prompt: n >= PAGE * (len(p) // PAGE),
                 "the chat's prompt blocks in the indexer, where they were computed")
  assert all(len(r) == 1 for r in replicas.values()), replicas  # every turn where turn 1 was
  # ... and the new chats were spread (a router that sends everything to one replica fails).
  assert set().union(*replicas.values()) == {fleet["a"].base, fleet["b"].base}, replicas
  stats = router_stats(router)
  assert stats["routed_by_prefix"] >= 6 and stats["indexer_errors"] == 0


def test_the_router_tells_no_caller_what_another_tenant_cached(fleet):
  """The router as a prompt oracle: a caller without a key learns nothing (401 before any
  routing: no replica header, no counter moved, no stats), and a tenant with a key sending
  another tenant's cached prompt is routed as for any new prompt (the indexer is asked
  with its own mapped ids), while the owner's repeat is routed by its prefix."""
  router, idx = fleet["router"], fleet["idx"]
  before = router_stats(router)
  for key in (None, "not-a-key-0123456789"):
    r = complete(router.url, words(7, 64), key=key)
    assert r.status_code == 401 and REPLICA_HEADER not in r.headers, r.headers
  assert httpx.get(f"{router.base}/router/stats").status_code == 401
  bob = {"authorization": "Bearer key-bob-0123456789ab"}
  assert httpx.get(f"{router.base}/router/stats", headers=bob).status_code == 403
  after = router_stats(router)
  assert after["requests"] == before["requests"]  # refused before it was routed
  assert after["unauthenticated"] == before["unauthenticated"] + 2
  prompt = words(8, 64)
  first = complete(router.url, prompt, key="key-alice-0123456789")
  assert first.status_code == 200, first.text
  where = first.headers[REPLICA_HEADER]
  worker = 1 if where == fleet["a"].base else 2
  await_held(idx, prompt, worker, lambda n: n >= 48, "alice's blocks, told under her ids")
  # Bob's ids for the same prompt match none of alice's blocks at the indexer ...
  assert all(not h.get("disk", 0) for h in idx.query(tenant_tokens(prompt, "bob")).values())
  routed = router_stats(router)["routed_by_prefix"]
  other = complete(router.url, prompt, key="key-bob-0123456789ab")
  assert other.status_code == 200, other.text
  # ... so the router placed his request as any new one: not by alice's prefix.
  assert router_stats(router)["routed_by_prefix"] == routed
  assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # bob's own
  assert other.json()["choices"][0]["token_ids"] == first.json()["choices"][0]["token_ids"]
  again = complete(router.url, prompt, key="key-alice-0123456789")
  assert router_stats(router)["routed_by_prefix"] == routed + 1  # alice's own: by prefix
  assert again.headers[REPLICA_HEADER] == where
  assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
  # Ids no tokenizer makes (what a forger's would be, mapped onto another tenant's) are
  # refused by the replica, and the refusal does not say where the router sent them.
  forged = complete(router.url, [1_000_000 + i for i in range(32)], key="key-bob-0123456789ab")
  assert forged.status_code == 400 and REPLICA_HEADER not in forged.headers, forged.headers


def test_a_replica_killed_mid_run_has_its_requests_answered_by_the_other_exactly(
    fleet, reference):
  router, a, idx = fleet["router"], fleet["a"], fleet["idx"]
  # Prompts whose prefix A holds (put there now, whatever ran before), so the router sends
  # them to A.
  prefixes = [words(40 + i, 120)[:100] for i in range(6)]
  for prefix in prefixes:
    assert complete(a.url, prefix, max_tokens=1).status_code == 200
  helpers.wait_for(lambda: all(idx.query(alice(p)).get(1, {}).get("disk", 0) >= 96
                               for p in prefixes), 30, "the indexer to learn A's prefixes",
                   interval_s=0.2)
  prompts = [p + words(200 + i, 10) for i, p in enumerate(prefixes)]
  want = reference.generate(prompts, 40)
  with concurrent.futures.ThreadPoolExecutor(6) as pool:
    futures = [pool.submit(complete, router.url, p, max_tokens=40) for p in prompts]
    helpers.wait_for(lambda: any(r["inflight"] and r["url"] == a.base
                                 for r in router_stats(router)["replicas"]), 60,
                     "requests in flight on A")
    os.killpg(a.proc.pid, signal.SIGKILL)
    answers = [f.result() for f in futures]
  assert [r.status_code for r in answers] == [200] * 6, [r.text for r in answers]
  assert [r.json()["choices"][0]["token_ids"] for r in answers] == want
  stats = router_stats(router)
  assert stats["replica_failures"] >= 1 and stats["retries"] >= 1
  state = {r["url"]: r for r in stats["replicas"]}
  assert not state[a.base]["healthy"] and state[fleet["b"].base]["healthy"]
  assert any(r.headers[REPLICA_HEADER] == fleet["b"].base for r in answers)


def test_after_a_restart_the_indexer_forgets_the_old_blocks_and_learns_the_new(fleet):
  idx, work = fleet["idx"], fleet["work"]
  prompt = words(40, 120)[:100]
  await_held(idx, prompt, 1, lambda n: n > 0, "killed A's blocks", tier="disk")
  a2 = fleet["a2"] = ServerProcess(fleet["a_args"], workdir=str(work))  # same event ports
  a2.wait_ready(600)
  # The restarted publisher continues above the old seqs: the indexer asks its replay
  # socket, whose answer starts with AllBlocksCleared.
  helpers.wait_for(lambda: idx.query(alice(prompt)).get(1, {}).get("disk", 0) == 0, 30,
                   "the indexer to clear the restarted replica's blocks")
  r = complete(a2.url, prompt)
  assert r.status_code == 200
  helpers.wait_for(lambda: idx.query(alice(prompt)).get(1, {}).get("device", 0) == 96, 30,
                   "the indexer to learn the restarted replica's new blocks")


def test_a_429_from_a_full_replica_is_tried_on_the_next(fleet, reference):
  work, b, c = fleet["work"], fleet["b"], fleet["c"]
  with ServerProcess([f"--replicas={c.base},{c.base},{b.base}", "--routing=round_robin"],
                     script=os.path.join("launch", "router.py"), workdir=str(work)) as rr:
    rr.wait_ready(120)
    prompts = [words(300 + i, 30) for i in range(4)]
    want = reference.generate(prompts, 48)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      answers = list(pool.map(lambda p: complete(rr.url, p, max_tokens=48), prompts))
    assert [r.status_code for r in answers] == [200] * 4
    assert [r.json()["choices"][0]["token_ids"] for r in answers] == want
    stats = httpx.get(f"{rr.base}/router/stats").json()
    assert stats["rejected_429"] >= 1 and stats["replica_failures"] == 0


def test_router_flags_that_cannot_work_are_refused_naming_the_fix(tmp_path):
  code, _, err = helpers.run_script(["launch/router.py", "--replicas=http://127.0.0.1:1"],
                                    timeout_s=120)
  assert code == 2 and "--indexer=http://HOST:PORT" in err
  code, _, err = helpers.run_script(
      ["launch/router.py", "--replicas=http://127.0.0.1:1,http://127.0.0.1:2",
       "--indexer=http://127.0.0.1:1", "--replica_events=tcp://127.0.0.1:5"], timeout_s=120)
  assert code == 2 and "one per replica" in err
  # Off loopback (192.0.2.1, a documentation address: nothing listens, the bind fails after
  # the warnings): without keys, and with tenants but no deployment key, it says INSECURE.
  keys = tmp_path / "keys.json"
  keys.write_text(json.dumps(KEYS))
  os.chmod(keys, 0o600)
  env = {"JAXKV_DEPLOYMENT_KEY_FILE": "", "JAXKV_DEPLOYMENT_KEY": ""}
  for extra, needle in (([], "without --api_keys_file"),
                        ([f"--api_keys_file={keys}"], "without a deployment key")):
    code, _, err = helpers.run_script(
        ["launch/router.py", "--replicas=http://127.0.0.1:1", "--routing=round_robin",
         "--host=192.0.2.1", *extra], timeout_s=120, env=env)
    insecure = [line for line in err.splitlines() if "INSECURE:" in line]
    assert code == 2 and len(insecure) == 1 and needle in insecure[0], err[-2000:]
