"""Aborting requests in the step loop, and the engine on its own thread (EngineService)."""

import threading
import time

import numpy as np
import pytest

import helpers
import jaxkv
from jaxkv.manager.index import Tier
from jaxkv.serving.service import Delta, Draining, EngineService, Overloaded


@pytest.fixture(scope="module")
def pair(mesh):
  return helpers.reuse_and_fresh(mesh)


def test_aborts_while_waiting_prefilling_and_decoding_free_every_page_and_change_no_other_answer(
    pair):
  engine, fresh = pair
  rng = np.random.default_rng(5)
  shared = rng.integers(1, 128, 9).tolist()
  prompts = [shared + rng.integers(1, 128, int(rng.integers(20, 40))).tolist()
             for _ in range(12)]
  sp = jaxkv.SamplingParams(max_new_tokens=12)
  want = fresh.generate(prompts, sp)
  handles = [engine.submit(p, sp) for p in prompts]
  engine.step()  # some are prefilling (chunks of 4 tokens), the rest wait for a row
  phase = {}
  for h in handles:
    phase[h.id] = "waiting" if not any(s.handle is h for s in engine.loop.running.values()) \
        else "prefill"
  victims = [h for h in handles if phase[h.id] == "waiting"][:2]
  victims += [h for h in handles if phase[h.id] == "prefill"][:2]
  assert len(victims) == 4
  for h in victims:
    engine.abort(h)
  outputs = engine.step()
  assert {o.handle.id for o in outputs if o.finished and not o.new_tokens} >= {
      h.id for h in victims}
  # One more, mid-decode.
  while not any(h.tokens and not h.finished for h in handles if h not in victims):
    engine.step()
  decoding = next(h for h in handles if h.tokens and not h.finished and h not in victims)
  engine.abort(decoding)
  victims.append(decoding)
  while engine.has_unfinished():
    engine.step()
  for h, w in zip(handles, want):
    if h in victims:
      assert h.finish_reason == "abort" and h.tokens == w[:len(h.tokens)]
    else:
      assert h.finish_reason == "length" and h.tokens == w
  assert engine.stats()["aborted_requests"] >= 5
  helpers.no_refs(engine)
  # The aborted prompts' published blocks stay cached: the same prompt hits now.
  again = engine.submit(prompts[handles.index(decoding)], sp)
  assert again.result() == want[handles.index(decoding)] and again.cached_tokens > 0
  engine.abort(again)  # finished already: nothing happens
  assert not engine.has_unfinished()


def test_an_abort_while_its_fetch_is_in_flight_waits_for_the_fetch(mesh, tmp_path):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=24, max_pages_per_seq=16)
  # A forced split: blocks [0, 6) are recomputed (two prefill chunks) while the
  # rest is fetched, so the fetch group stays in flight across steps.
  engine = helpers.make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2,
                               tiers=jaxkv.TierConfig(host_pages_per_shard=32),
                               scheduler=jaxkv.SchedulerConfig(decision="split", force_split=6))
  prompt = list(range(1, 30))
  first = engine.generate([prompt], 4)[0]
  engine.offload()  # the next request fetches its prefix from host memory
  h = engine.submit(prompt, 4)
  plan_steps = 0
  engine.abort(h)  # before its first step: it is still waiting, so it ends at once
  engine.step()
  assert h.finish_reason == "abort" and not h.tokens
  h = engine.submit(prompt, 4)
  while not engine.loop.groups and plan_steps < 5:  # admitted, its fetch group issued
    engine.step()
    plan_steps += 1
  assert engine.loop.groups, "the request was expected to fetch from the host tier"
  engine.abort(h)
  while engine.has_unfinished():
    engine.step()
  assert h.finish_reason == "abort"
  helpers.no_refs(engine, (Tier.DEVICE, Tier.HOST))
  assert engine.generate([prompt], 4)[0] == first


def collect():
  got, done = [], threading.Event()

  def sink(d: Delta):
    got.append(d)
    if d.finish_reason is not None:
      done.set()
  return got, done, sink


def test_the_service_runs_the_loop_on_its_thread_with_the_same_answers(pair):
  engine, fresh = pair
  service = EngineService(engine, max_waiting=2).start()
  try:
    rng = np.random.default_rng(8)
    prompts = [rng.integers(1, 128, int(rng.integers(5, 30))).tolist() for _ in range(6)]
    params = [jaxkv.SamplingParams(max_new_tokens=6, temperature=0.8, seed=i)
              for i in range(len(prompts))]
    want = fresh.generate(prompts, params)
    runs = [collect() for _ in prompts]
    threads = [threading.Thread(target=service.submit, args=(p, sp, "default", r[2]))
               for p, sp, r in zip(prompts, params, runs)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(120)  # (submit waits while the waiting room is full)
    assert not any(t.is_alive() for t in threads), "a submit still waits after 120 s"
    for (got, done, _), w in zip(runs, want):
      assert done.wait(120)
      assert [t for d in got for t in d.tokens] == w
      assert got[-1].finish_reason == "length" and got[-1].prompt_tokens > 0
    # Bad input comes back as the request's only delta; the service keeps going.
    got, done, sink = collect()
    service.submit([1, 10**6], jaxkv.SamplingParams(), "default", sink)
    assert done.wait(60) and got[-1].error and "vocabulary" in got[-1].error
    # Back-pressure: rows (4 shards x 2) + max_waiting (2) outstanding, then Overloaded.
    long = jaxkv.SamplingParams(max_new_tokens=40)
    held = [collect() for _ in range(service.rows + service.max_waiting)]
    tickets = [service.submit(prompts[0], long, "default", r[2]) for r in held]
    with pytest.raises(Overloaded, match="limit"):
      service.submit(prompts[0], long, "default", collect()[2])
    for t in tickets:
      service.abort(t)
    for got, done, _ in held:
      assert done.wait(120) and got[-1].finish_reason in ("abort", "length")
    assert service.outstanding == 0
    # Drain: running requests finish, new ones are refused.
    got, done, sink = collect()
    service.submit(prompts[1], jaxkv.SamplingParams(max_new_tokens=3), "default", sink)
    assert service.drain(timeout_s=60) == 0
    assert done.wait(1) and got[-1].finish_reason == "length"
    with pytest.raises(Draining):
      service.submit(prompts[1], jaxkv.SamplingParams(), "default", sink)
  finally:
    service.close()
  helpers.no_refs(engine)


def test_the_http_app_answers_504_past_the_request_timeout_and_aborts_it(pair):
  import asyncio

  import httpx

  from jaxkv.entrypoints.openai.server import OpenAIServer
  engine, _ = pair
  service = EngineService(engine).start()
  try:
    api = OpenAIServer(service, model_name="m", request_timeout_s=0.001)
    api.ready = True

    async def ask(stream):
      transport = httpx.ASGITransport(app=api.app)
      async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        return await c.post("/v1/completions", json={
            "model": "m", "prompt": [3, 4, 5], "max_tokens": 40, "temperature": 0,
            "stream": stream})

    r = asyncio.run(ask(False))
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
    r = asyncio.run(ask(True))  # a stream has begun: the deadline ends it with an event
    assert r.status_code == 200 and '"type":"timeout_error"' in r.text
    assert r.text.rstrip().endswith("data: [DONE]")
    end = time.monotonic() + 60
    while service.outstanding and time.monotonic() < end:
      time.sleep(0.01)
    assert service.outstanding == 0 and service.counts["abort"] == 2
  finally:
    service.close()
  helpers.no_refs(engine)


# ---- one request's failure is its own --------------------------------------------------------
def test_an_on_token_that_raises_ends_only_its_own_request(pair):
  engine, fresh = pair
  rng = np.random.default_rng(21)
  prompts = [rng.integers(1, 128, int(rng.integers(6, 30))).tolist() for _ in range(5)]
  sp = jaxkv.SamplingParams(max_new_tokens=8, temperature=0.7, seed=3)
  want = fresh.generate(prompts, sp)
  failed_before = engine.stats()["failed_requests"]
  seen = []

  def breaks_on_third(token):
    seen.append(token)
    if len(seen) == 3:
      raise RuntimeError("the caller's callback broke")

  handles = [engine.submit(p, sp, on_token=breaks_on_third if i == 2 else None)
             for i, p in enumerate(prompts)]
  while engine.has_unfinished():
    engine.step()  # never raises: the callback's error is its request's
  for i, (h, w) in enumerate(zip(handles, want)):
    if i == 2:
      assert h.finish_reason == "error" and h.tokens == w[:len(h.tokens)] and len(h.tokens) < 8
    else:
      assert h.finish_reason == "length" and h.tokens == w
  assert engine.stats()["failed_requests"] == failed_before + 1
  helpers.no_refs(engine)


def test_values_that_would_overflow_a_step_are_refused_where_they_enter(pair):
  engine, _ = pair
  for bad in ({"top_k": 2**31}, {"max_new_tokens": 2**31}, {"temperature": 1e30},
              {"stop_token_ids": (2**40,)}, {"seed": 2**32}):
    with pytest.raises(jaxkv.errors.InputError, match=next(iter(bad))):
      jaxkv.SamplingParams(**bad)
  with pytest.raises(jaxkv.errors.InputError, match="top_k=129 is more than the vocabulary"):
    engine.submit([1, 2, 3], jaxkv.SamplingParams(top_k=engine.vocab_size + 1))
  with pytest.raises(jaxkv.errors.InputError, match="lone surrogate"):
    engine.submit([1, 2, 3], 2, tenant="team\ud800")
  assert not engine.has_unfinished()
  h = engine.submit([1, 2, 3], jaxkv.SamplingParams(max_new_tokens=2, top_k=engine.vocab_size,
                                                    temperature=1.0))
  assert len(h.result()) == 2  # the largest top_k allowed runs


class _Failing:
  """Wraps a runner's ``execute``: raises ``error`` on the step that prefills a prompt
  starting with ``marker`` (fault injection around the real runner)."""

  def __init__(self, runner, marker, error):
    self.runner, self.marker, self.error = runner, list(marker), error
    self.real = runner.execute

  def __call__(self, plan):
    for c in plan.prefill:
      if c.start == 0 and list(c.tokens[:len(self.marker)]) == self.marker:
        raise self.error
    return self.real(plan)


def test_an_internal_error_in_a_step_stops_the_service_and_says_why(mesh):
  from jaxkv.errors import InvariantError
  from jaxkv.serving.service import EngineFailed
  engine, fresh = helpers.reuse_and_fresh(mesh)
  engine.runner.execute = _Failing(engine.runner, [9, 9, 9],
                                   InvariantError("injected: a slot nobody holds"))
  service = EngineService(engine).start()
  try:
    long = collect()
    service.submit([5, 6, 7, 8], jaxkv.SamplingParams(max_new_tokens=200), "a", long[2])
    helpers.wait_for(lambda: long[0], 60, "the first request decodes")
    bad = collect()
    service.submit([9, 9, 9, 1, 2], jaxkv.SamplingParams(max_new_tokens=4), "b", bad[2])
    assert service.wait_failed(120)
    assert "InvariantError: injected" in service.failure
    for got, done, _ in (long, bad):
      assert done.wait(60) and got[-1].finish_reason == "error"
    with pytest.raises(EngineFailed, match="InvariantError"):
      service.submit([1, 2], jaxkv.SamplingParams(), "a", collect()[2])
    assert not service.accepting and service.outstanding == 0
    # The HTTP app says so: /health and new requests get 503 with the reason.
    import asyncio

    import httpx

    from jaxkv.entrypoints.openai.server import OpenAIServer
    api = OpenAIServer(service, model_name="m")
    api.ready = True

    async def ask():
      transport = httpx.ASGITransport(app=api.app)
      async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        return (await c.get("/health"),
                await c.post("/v1/completions", json={"model": "m", "prompt": [3, 4]}))

    health, completion = asyncio.run(ask())
    assert health.status_code == 503 and "InvariantError" in health.json()["error"]["message"]
    assert completion.status_code == 503
    assert "internal error" in completion.json()["error"]["message"]
  finally:
    service.close()
  helpers.no_refs(engine)


def test_a_bug_while_submitting_fails_that_request_alone(pair, monkeypatch):
  engine, fresh = pair
  real = engine.submit

  def submit(prompt, *args, **kw):
    if prompt[:2] == [4, 4]:
      raise RuntimeError("injected bug in submit")
    return real(prompt, *args, **kw)

  monkeypatch.setattr(engine, "submit", submit)
  service = EngineService(engine).start()
  try:
    bad, good = collect(), collect()
    service.submit([4, 4, 4], jaxkv.SamplingParams(max_new_tokens=3), "default", bad[2])
    service.submit([3, 5, 7], jaxkv.SamplingParams(max_new_tokens=3), "default", good[2])
    assert bad[1].wait(60) and good[1].wait(60)
    assert bad[0][-1].finish_reason == "error" and bad[0][-1].error is None  # a 500, not a 400
    assert [t for d in good[0] for t in d.tokens] == fresh.generate([[3, 5, 7]], 3)[0]
    assert not service.failed.is_set() and service.accepting
  finally:
    service.close()


def test_a_tenants_share_holds_back_its_extra_requests_while_others_are_served(pair):
  engine, fresh = pair
  service = EngineService(engine, max_waiting=8, max_running_per_tenant=2,
                          max_waiting_per_tenant=1).start()
  try:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(1, 128, 12).tolist() for _ in range(5)]
    sp = jaxkv.SamplingParams(max_new_tokens=30)
    want = fresh.generate(prompts, sp)
    a = [collect() for _ in range(3)]
    tickets = [service.submit(p, sp, f"a{TENANT_SALT}{i}", r[2], quota="a")
               for i, (p, r) in enumerate(zip(prompts, a))]
    # Two of a's are in the engine, one waits for a's share; a fourth is over the share,
    # whatever salt it carries, while the server as a whole has room.
    with pytest.raises(Overloaded, match="tenant 'a' holds 3 requests, its share"):
      service.submit(prompts[3], sp, "a-other-salt", collect()[2], quota="a")
    assert service.outstanding == 3
    b = [collect() for _ in range(2)]
    for p, r in zip(prompts[3:], b):
      service.submit(p, sp, "b", r[2], quota="b")
    assert service.tenant_load() == {"a": (2, 1), "b": (2, 0)}  # a's third waits here
    for (got, done, _), w in zip(a + b, want):
      assert done.wait(120) and [t for d in got for t in d.tokens] == w
    # An abort of a held-back request ends it without it ever running.
    hold = [collect() for _ in range(3)]
    tickets = [service.submit(prompts[0], sp, "a", r[2], quota="a") for r in hold]
    service.abort(tickets[2])
    for got, done, _ in hold:
      assert done.wait(120)
    assert hold[2][0][-1].finish_reason == "abort" and not hold[2][0][-1].tokens
    assert [h[0][-1].finish_reason for h in hold[:2]] == ["length", "length"]
    assert service.outstanding == 0 and service.tenant_load() == {}
  finally:
    service.close()
  helpers.no_refs(engine)


TENANT_SALT = "\x1f"


def test_one_request_id_from_the_service_ticket_to_the_engines_step(pair):
  """The service's ticket is the engine's request id: the id the step's plan and every log
  line carry (and the server's response id ends with it)."""
  engine, _ = pair
  service = EngineService(engine).start()
  seen = {}  # ticket -> request ids the engine was running when its first delta came
  try:
    tickets, dones = [], []
    for i in range(3):
      done = threading.Event()

      def sink(delta, i=i, done=done):
        seen.setdefault(i, {s.handle.id for s in engine.loop.running.values()})
        if delta.finish_reason is not None:
          done.set()

      tickets.append(service.submit([5, 6, 7 + i], jaxkv.SamplingParams(max_new_tokens=4),
                                    "default", sink))
      dones.append(done)
    assert all(d.wait(60) for d in dones)
  finally:
    service.close()
  assert len(set(tickets)) == 3
  for i, ticket in enumerate(tickets):
    assert ticket in seen[i]
  # Ids are one space: the engine's own requests never take a ticket's id, and an id in use
  # is refused by name.
  ids = set()
  threads = [threading.Thread(target=lambda: ids.update(engine.new_request_id()
                                                        for _ in range(200))) for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(ids) == 800 and not ids & set(tickets)
  h = engine.submit([1, 2, 3], 2, request_id=engine.new_request_id())
  with pytest.raises(jaxkv.InputError, match=f"request_id={h.id} must be"):
    engine.submit([1, 2, 3], 2, request_id=h.id)
  assert h.result() and engine.submit([1, 2, 3], 2).id > h.id
  helpers.no_refs(engine)
