"""An OpenAI-compatible router in front of replicas, sending each request where its prefix is.

The replicas are ``launch/server.py`` processes (or jobs, whose process 0 serves HTTP) that
publish KV events (``--kv_events``); a KV indexer we did not write (Dynamo's standalone
indexer, ``python -m dynamo.indexer``) reads the events and answers, for a request's token
ids, how much of its prefix each replica holds on device, in host memory and on disk. The
decision is the indexer's answer and the replicas' load, nothing of the router's own:

    cost(replica) = prompt tokens - held(replica) + load_tokens * requests in flight there

where ``held`` counts device tokens whole and tokens only in host memory or on disk at
``host_weight`` and ``disk_weight`` (a fetch is cheaper than a prefill, dearer than a hit).
The cheapest healthy replica takes the request; ties go to the less loaded, then in turn.
With ``routing="round_robin"`` the indexer is not asked (the baseline).

Failures: a replica whose ``/health`` is not 200, or that does not answer a request, is
taken out until ``/health`` answers 200 again, and the request goes to the next replica in
cost order (before any byte of an answer was passed on). A stream that breaks midway (the
replica died, reset the connection, or closed it before ``[DONE]``) cannot be retried: the
client gets the whole events that came, then an error event (OpenAI's error object, code
``upstream_stream_broken``, as a server's own mid-stream error) and ``[DONE]``
(``upstream.relay_events``); the replica is counted (``replica_failures``,
``streams_broken`` and its own ``failures`` in ``/router/stats``) and taken out at once, as
one that did not answer (a health check begun before the break does not put it back). A
replica's own error event followed by its ``[DONE]`` is its answer: passed on, not counted. A 429 tries the next replica; the last one's 429 is the answer. An
indexer that does not answer within ``indexer_timeout_s`` leaves the choice to load alone
(counted). Streams pass through as they come, event by event.

Tenants: with ``api_keys`` (the replicas' own keys file) the router checks a request's key
before it does anything for it: a caller without a valid key gets 401, and the indexer is
not asked, no replica is chosen, no counter moves. The indexer matches token ids and knows
no tenants, so the router asks it with the request's ids *mapped under its tenant's salt*
(``jaxkv.security.routing_tokens``; the tenant narrowed by the request's ``cache_salt``),
as the replicas' KV events tell their blocks: a tenant's request is scored only against its
own tenant's blocks, and the router's choice says nothing about another tenant's prompts.
Give the router the replicas' ``--deployment_key_file`` (the salts are keyed by it; without
one they follow from tenant names). The Authorization header still goes to the replica,
which checks it too. ``/router/stats`` answers only a ``metrics_tenants`` key when keys are
on; ``x-jaxkv-replica`` (which replica answered) goes only with answers the replica
accepted (a refusal, 401 or 400, does not say where the request went).

Token ids: a ``/v1/completions`` prompt given as token ids is used as is; text and chat
need ``tokenizer`` (the replicas' own, ``launch/router.py --model_dir``), without which such
requests are placed by load alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import math
import time

import httpx
from absl import logging
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from jaxkv import security
from jaxkv.config import renamed_fields
from jaxkv.entrypoints.openai.auth import ApiKeys
from jaxkv.entrypoints.openai.protocol import (MAX_BODY_BYTES, ApiError, chat_messages,
                                               parse_body, read_body, request_tenant)
from jaxkv.entrypoints.openai.upstream import relay_events
from jaxkv.errors import InputError

ROUTINGS = ("prefix", "round_robin")  # what RouterConfig.routing may be
POLICIES = ROUTINGS  # its former name
REPLICA_HEADER = "x-jaxkv-replica"


def parse_query(answer: dict) -> dict[int, dict[str, int]]:
  """``/query``'s answer as ``{worker id: {"device": tokens, "host": tokens, "disk": tokens}}``,
  each the longest prefix held in that medium or a faster one (workers holding none are
  left out)."""
  out = {}
  for worker, m in (answer.get("instances") or {}).items():
    out[int(worker)] = {"device": int(m.get("gpu", 0)), "host": int(m.get("cpu", 0)),
                        "disk": int(m.get("disk", m.get("longest_matched", 0)))}
  return out


def tenant_tokens(tokens, tenant: str = "default", *, cache_salt: str | None = None,
                  deployment_key: bytes | None = None) -> list[int]:
  """``tokens`` as a replica's KV events tell ``tenant``'s blocks of them (and as the router
  asks the indexer for them): mapped under the salt of the tenant narrowed by
  ``cache_salt``, keyed by the deployment key (``security.routing_tokens``)."""
  salt = security.tenant_salt(request_tenant(tenant, cache_salt), deployment_key)
  return security.routing_tokens(salt, tokens)


def register(url: str, worker: int, endpoint: str, *, replay: str | None = None,
             block_size: int, model_name: str = "default") -> None:
  """Subscribes the indexer at ``url`` to a replica's events as worker ``worker``."""
  body = {"instance_id": worker, "endpoint": endpoint, "model_name": model_name,
          "block_size": block_size}
  if replay:
    body["replay_endpoint"] = replay
  try:
    r = httpx.post(f"{url}/register", json=body, timeout=10.0)
  except httpx.HTTPError as e:
    raise InputError(f"the indexer at {url} did not answer /register ({e}).") from None
  if r.status_code not in (200, 201):
    raise InputError(f"the indexer at {url} refused to register worker {worker} at "
                     f"{endpoint}: {r.status_code} {r.text}")


@dataclasses.dataclass
class Replica:
  url: str  # base, e.g. http://127.0.0.1:8001
  worker: int  # its id at the indexer
  healthy: bool = False
  inflight: int = 0
  routed: int = 0
  failures: int = 0


@renamed_fields(policy="routing")
@dataclasses.dataclass(frozen=True, kw_only=True)
class RouterConfig:
  """How the router picks a replica. ``routing``: ``prefix`` asks the indexer and ranks by
  cost (above); ``round_robin`` takes turns (the baseline). Its former name ``policy``
  still works, with a DeprecationWarning."""

  routing: str = "prefix"
  indexer: str | None = None
  indexer_model: str = "default"
  indexer_timeout_s: float = 0.5
  load_tokens: float = 256.0
  host_weight: float = 0.9
  disk_weight: float = 0.6
  health_interval_s: float = 1.0
  timeout_s: float = 600.0
  max_body_bytes: int = MAX_BODY_BYTES
  raw_tokens: bool = False  # the replicas send raw ids (TierConfig.kv_events_raw_tokens)

  def __post_init__(self):
    if self.routing not in ROUTINGS:
      raise InputError(f"RouterConfig.routing={self.routing!r} must be one of {ROUTINGS}.")
    if self.routing == "prefix" and not self.indexer:
      raise InputError("routing='prefix' needs the KV indexer's URL (--indexer=http://HOST:PORT)"
                       "; or route with --routing=round_robin.")
    for name in ("host_weight", "disk_weight"):
      if not 0 <= getattr(self, name) <= 1:
        raise InputError(f"{name}={getattr(self, name)!r} must be in [0, 1].")
    for name in ("indexer_timeout_s", "health_interval_s", "timeout_s"):
      if not getattr(self, name) > 0:
        raise InputError(f"{name}={getattr(self, name)!r} must be > 0 seconds.")
    if not self.load_tokens >= 0:
      raise InputError(f"load_tokens={self.load_tokens!r} must be >= 0.")
    if not isinstance(self.max_body_bytes, int) or self.max_body_bytes < 1:
      raise InputError(f"max_body_bytes={self.max_body_bytes!r} must be an integer >= 1.")


class Router:
  """The routing state and decision; ``make_app`` serves it over HTTP."""

  def __init__(self, replicas: list[tuple[str, int]], config: RouterConfig, tokenizer=None, *,
               api_keys: dict[str, str] | None = None, metrics_tenants=(),
               deployment_key: bytes | None = None):
    """``api_keys``: ``{key: tenant}``, the replicas' keys (None: no keys, every request is
    tenant "default"); ``metrics_tenants``: who may read ``/router/stats`` when keys are on;
    ``deployment_key``: the replicas' (it keys the tenants' salts)."""
    if not replicas:
      raise InputError("give at least one replica (--replicas=http://HOST:PORT,...).")
    for url, _ in replicas:
      if not url.startswith(("http://", "https://")):
        raise InputError(f"replica {url!r} is not an http://HOST:PORT URL.")
    self.replicas = [Replica(url.rstrip("/"), worker) for url, worker in replicas]
    self.config, self.tokenizer = config, tokenizer
    self.keys = ApiKeys(api_keys)
    self.metrics_tenants = self.keys.check_metrics_tenants(metrics_tenants)
    self._deployment_key = security.check_key(deployment_key)
    self.keyed = self._deployment_key is not None  # the tenants' salts are secret
    self._turn = itertools.count()
    self.stats = {"requests": 0, "routed_by_prefix": 0, "indexer_errors": 0,
                  "retries": 0, "replica_failures": 0, "streams_broken": 0, "rejected_429": 0,
                  "no_tokens": 0, "unauthenticated": 0, "health_checks": 0}
    self.client: httpx.AsyncClient | None = None
    # url -> time.monotonic() of its last failed request: a health check begun before it
    # does not put the replica back.
    self._failed_at: dict[str, float] = {}

  # ---- the decision ----------------------------------------------------------------------------
  def tokens_of(self, path: str, body: dict) -> list[int] | None:
    """The request's prompt token ids, as the replica will see them (None: unknown here)."""
    try:
      if path.endswith("/chat/completions"):
        if self.tokenizer is None:
          return None
        return list(self.tokenizer.encode_chat(chat_messages(body.get("messages"))))
      prompt = body.get("prompt")
      if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
        prompt = prompt[0]
      if isinstance(prompt, list) and prompt and all(
          isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
      if isinstance(prompt, str) and self.tokenizer is not None:
        return list(self.tokenizer.encode(prompt))
    except (ApiError, InputError):  # bad messages or text: the replica names what is wrong
      return None
    return None

  def query_tokens(self, tokens: list[int] | None, tenant: str, cache_salt) -> list[int] | None:
    """``tokens`` as the indexer knows ``tenant``'s blocks (mapped under the salt of the
    tenant narrowed by ``cache_salt``, as the replicas' events tell them); None when they
    cannot be scored (no tokens, ids outside 32 bits, a ``cache_salt`` the replica refuses)."""
    if tokens is None or (cache_salt is not None and not isinstance(cache_salt, str)):
      return None
    if self.config.raw_tokens:
      return tokens
    try:
      return tenant_tokens(tokens, tenant, cache_salt=cache_salt,
                           deployment_key=self._deployment_key)
    except (InputError, OverflowError, TypeError):  # the replica names what is wrong
      return None

  async def held(self, tokens: list[int]) -> dict[int, dict[str, int]] | None:
    """The indexer's answer for ``tokens`` (None: it did not answer in time)."""
    try:
      r = await self.client.post(f"{self.config.indexer}/query", json={
          "token_ids": tokens, "model_name": self.config.indexer_model},
                                 timeout=self.config.indexer_timeout_s)
      r.raise_for_status()
      return parse_query(r.json())
    except (httpx.HTTPError, ValueError) as e:
      self.stats["indexer_errors"] += 1
      logging.warning("the KV indexer did not answer (%s); placing by load", e)
      return None

  def ranked(self, n_tokens: int, held: dict[int, dict[str, int]] | None) -> list[Replica]:
    """Healthy replicas, cheapest first (every replica when none is healthy: one may be
    back before its next health check)."""
    c = self.config
    pool = [r for r in self.replicas if r.healthy] or list(self.replicas)
    turn = next(self._turn)
    order = {id(r): (i - turn) % len(pool) for i, r in enumerate(pool)}
    if c.routing == "round_robin":
      return sorted(pool, key=lambda r: order[id(r)])

    def cost(r: Replica) -> tuple:
      h = (held or {}).get(r.worker, {})
      dev, host, disk = h.get("device", 0), h.get("host", 0), h.get("disk", 0)
      reuse = dev + c.host_weight * (host - dev) + c.disk_weight * (disk - host)
      return (n_tokens - reuse + c.load_tokens * r.inflight, r.inflight, order[id(r)])
    return sorted(pool, key=cost)

  # ---- health ------------------------------------------------------------------------------------
  async def check_health(self) -> None:
    async def one(r: Replica):
      started = time.monotonic()
      try:
        ok = (await self.client.get(f"{r.url}/health", timeout=2.0)).status_code == 200
      except httpx.HTTPError:
        ok = False
      if ok and self._failed_at.get(r.url, -math.inf) >= started:
        return  # it failed a request meanwhile: the next check says whether it is back
      if r.healthy and not ok:
        logging.warning("replica %s failed /health; its requests go elsewhere", r.url)
      elif ok and not r.healthy:
        logging.info("replica %s is healthy", r.url)
      r.healthy = ok
    await asyncio.gather(*(one(r) for r in self.replicas))
    self.stats["health_checks"] += 1  # rounds finished: a reader can wait for the next one

  async def health_loop(self) -> None:
    while True:
      await self.check_health()
      await asyncio.sleep(self.config.health_interval_s)

  # ---- forwarding --------------------------------------------------------------------------------
  async def relay(self, request: Request, path: str) -> Response:
    """One API request: its key checked, its body read (bounded), placed, sent, and retried
    on the next replica where it may be."""
    auth = request.headers.get("authorization")
    try:
      tenant = self.keys.tenant(auth)  # before anything is done on the caller's behalf
    except ApiError as e:
      self.stats["unauthenticated"] += 1
      return e.response()
    try:
      raw = await read_body(request, self.config.max_body_bytes)
      body = await parse_body(raw)
    except ApiError as e:
      return e.response()
    self.stats["requests"] += 1
    held = None
    if self.config.routing == "prefix":
      # Tokenizing (a chat template, a long text) and mapping run off the event loop.
      tokens = await asyncio.to_thread(self.tenant_tokens, path, body, tenant)
      if tokens is None:
        self.stats["no_tokens"] += 1
      else:
        held = await self.held(tokens)
    else:
      tokens = None
    candidates = self.ranked(len(tokens or ()), held)
    if held and held.get(candidates[0].worker, {}).get("disk", 0) > 0:
      self.stats["routed_by_prefix"] += 1
    headers = {"content-type": "application/json", **({"authorization": auth} if auth else {})}
    last = None
    for i, r in enumerate(candidates):
      if i:
        self.stats["retries"] += 1
      answer, last = await self._try(r, path, raw, headers, more=i + 1 < len(candidates))
      if answer is not None:
        return answer
    return last or _error(503, "no replica answered.")

  def tenant_tokens(self, path: str, body: dict, tenant: str) -> list[int] | None:
    """The ids the indexer is asked for this request of ``tenant`` (``query_tokens``)."""
    return self.query_tokens(self.tokens_of(path, body), tenant, body.get("cache_salt"))

  def _failed(self, r: Replica, why: str) -> Response:
    r.inflight -= 1
    r.failures += 1
    r.healthy = False  # until its /health answers 200 again
    self._failed_at[r.url] = time.monotonic()
    self.stats["replica_failures"] += 1
    logging.warning("replica %s failed a request (%s); trying the next", r.url, why)
    return _error(502, f"replica {r.url} did not answer: {why}")

  def _broke(self, r: Replica, why: str) -> str:
    """A stream ``r`` broke before its ``[DONE]``: counted, and ``r`` taken out at once
    (until its /health answers 200 again), so that the next request goes elsewhere without
    waiting for a health check. Returns what the client's error event says."""
    r.failures += 1
    r.healthy = False
    self._failed_at[r.url] = time.monotonic()
    self.stats["replica_failures"] += 1
    self.stats["streams_broken"] += 1
    logging.warning("replica %s broke off a stream (%s); its requests go elsewhere", r.url, why)
    return (f"replica {r.url} broke off this stream ({why}); the answer is incomplete: "
            "retry the request.")

  async def _try(self, r: Replica, path: str, raw: bytes, headers: dict, *, more: bool):
    """``(answer, None)`` once ``r`` answered, else ``(None, the error to give if no other
    replica answers)``: it did not answer, broke off a whole answer, or said 429."""
    r.inflight += 1
    req = self.client.build_request("POST", f"{r.url}{path}", content=raw, headers=headers)
    try:
      resp = await self.client.send(req, stream=True)
    except httpx.HTTPError as e:
      return None, self._failed(r, str(e) or type(e).__name__)
    if resp.status_code == 429 and more:
      self.stats["rejected_429"] += 1
      r.inflight -= 1
      await resp.aclose()
      return None, None
    r.routed += 1
    kind = resp.headers.get("content-type", "application/json")
    if "text/event-stream" not in kind:
      try:
        content = await resp.aread()
      except httpx.HTTPError as e:  # it died while answering: nothing was passed on yet
        return None, self._failed(r, f"broke off its answer: {e}")
      finally:
        await resp.aclose()
      r.inflight -= 1
      return Response(content, status_code=resp.status_code, media_type=kind,
                      headers=_replica_header(r, resp.status_code)), None

    async def passthrough():
      try:
        async for chunk in relay_events(resp, functools.partial(self._broke, r)):
          yield chunk
      finally:
        r.inflight -= 1
        await resp.aclose()

    return StreamingResponse(passthrough(), status_code=resp.status_code, media_type=kind,
                             headers=_replica_header(r, resp.status_code)), None


def _replica_header(r: Replica, status: int) -> dict:
  """Which replica answered, on an answer it accepted (status < 400). None on a refusal: a
  caller without a key learns nothing of where a request would have gone, nor does one
  whose ids only a forger would send (without a deployment key, a tenant who computes ids
  that map onto another tenant's could have them placed by that tenant's blocks; such ids
  are almost surely out of the vocabulary, and the replica's 400 says nothing of where
  they went)."""
  return {REPLICA_HEADER: r.url} if status < 400 else {}


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
  return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                 "code": None}}, status_code=status)


def make_app(router: Router) -> FastAPI:
  @contextlib.asynccontextmanager
  async def lifespan(_):
    router.client = httpx.AsyncClient(timeout=router.config.timeout_s,
                                      limits=httpx.Limits(max_connections=1024))
    await router.check_health()
    task = asyncio.create_task(router.health_loop())
    try:
      yield
    finally:
      task.cancel()
      await router.client.aclose()

  api = FastAPI(title="jaxkv router", docs_url=None, redoc_url=None, openapi_url=None,
                lifespan=lifespan)

  @api.post("/v1/completions")
  async def completions(request: Request):
    return await router.relay(request, "/v1/completions")

  @api.post("/v1/chat/completions")
  async def chat(request: Request):
    return await router.relay(request, "/v1/chat/completions")

  @api.get("/v1/models")
  async def models(request: Request):
    auth = request.headers.get("authorization")
    try:
      router.keys.tenant(auth)
    except ApiError as e:
      return e.response()
    for r in router.ranked(0, None):
      try:
        resp = await router.client.get(f"{r.url}/v1/models",
                                       headers={"authorization": auth} if auth else {})
      except httpx.HTTPError:
        continue
      return Response(resp.content, status_code=resp.status_code,
                      media_type=resp.headers.get("content-type"))
    return _error(503, "no replica answered.")

  @api.get("/health")
  async def health():
    up = [r.url for r in router.replicas if r.healthy]
    if not up:
      return _error(503, "no replica is healthy.")
    return {"status": "ok", "healthy": up}

  @api.get("/router/stats")
  async def stats(request: Request):
    try:
      router.keys.metrics_reader(request.headers.get("authorization"),
                                 router.metrics_tenants, "/router/stats")
    except ApiError as e:
      return e.response()
    return {**router.stats, "replicas": [dataclasses.asdict(r) for r in router.replicas]}

  return api
