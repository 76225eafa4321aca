"""Prefill on one server, decode on another, through the pool: ``kv_transfer_params`` as
vLLM's disaggregation proxies send and read them.

A proxy sends the prompt to a prefill node with ``max_tokens=1`` and ``kv_transfer_params:
{"do_remote_decode": true}`` (a node started with ``--role=prefill`` hands off every
request, with or without it). The prefill node computes the prompt, its blocks go to the
pool as they are published (a prefill node writes through, every block soft-pinned for
``pool_pin_s``: eviction takes other values first until the pin's lease ends), and before
it answers it waits until they are in the pool. Its answer carries

    kv_transfer_params: {"do_remote_prefill": true, "do_remote_decode": false,
                         "remote_engine_id": <this server's run id>,
                         "remote_block_ids": [<a 64-bit id per block in the pool>],
                         "remote_host": <host this server serves on>, "remote_port": <port>,
                         "tp_size": 1}

``remote_host``/``remote_port`` are the server's own address (``--host``/``--port``, or
``--advertise_address``), never what a client's ``Host`` header says.

The wait is the request's own and short (``HAND_OFF_DEADLINE_S``): it waits for the puts of
its own blocks only (``PoolTier.placed_run``), never for the whole put queue, and it takes no
lookup slot of other tenants. A pool participant can make puts fail (a lender that keeps its
registration but stops serving transfers holds each put until the put's deadline, then trips
the pool's breaker); it cannot make answers wait. Blocks not placed by the deadline are not
promised: ``remote_block_ids`` lists the leading run that is in the pool (possibly none),
and ``pd_prefills_not_handed_off`` counts the answers that promise less than the whole
prompt. The decode node looks the prompt up in the pool itself and recomputes what is not
there, so its answer is the same either way.

The proxy sends the request on to a decode node with those params. A decode node needs
nothing from them to find the blocks: a block's pool name follows from the prompt's tokens
(and the tenant and deployment key), so its admission finds them in the pool like any
other cached prefix, and its plan fetches them, or recomputes where that is cheaper.
``remote_block_ids`` say how many blocks the prefill node left there (counted, compared).

The pool belongs to the engine: the HTTP side never touches it. The hand-off and the
decode side's count are engine commands (``HandOff``, ``Received``) that the server asks
its ``EngineClient`` to run (``call``), so they run in the engine's process — on a thread
beside its loop for ``HandOff``, which waits for puts, and between steps for ``Received`` —
whether the engine runs in the server's process or in a process of its own.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

ROLES = ("both", "prefill", "decode")
HAND_OFF_DEADLINE_S = 3.0  # the longest a prefill answer waits for its blocks' puts


class Refused(ValueError):
  """``kv_transfer_params`` this node does not take (``param`` names the field)."""

  def __init__(self, message: str, param: str = "kv_transfer_params"):
    super().__init__(message)
    self.param = param


def read_params(body: dict, role: str) -> tuple[bool, dict | None]:
  """``(hand_off, params)``: whether this request is a prefill to hand off, and the
  validated ``kv_transfer_params`` a decode request brings (None if none)."""
  params = body.get("kv_transfer_params")
  if params is None:
    if role == "prefill" and body.get("stream"):
      raise Refused("this node prefills (--role=prefill) and answers whole: send the request "
                    "with stream=false (the decode node streams).", "stream")
    return role == "prefill", None
  if not isinstance(params, dict):
    raise Refused(f"kv_transfer_params={params!r} must be an object (or null).")
  for name in ("do_remote_decode", "do_remote_prefill"):
    if not isinstance(params.get(name, False), bool):
      raise Refused(f"kv_transfer_params.{name}={params[name]!r} must be true or false.")
  ids = params.get("remote_block_ids", [])
  if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                          for i in ids) or len(ids) > 1 << 20:
    raise Refused("kv_transfer_params.remote_block_ids must be a list of integer block ids.")
  remote_decode = params.get("do_remote_decode", False)
  remote_prefill = params.get("do_remote_prefill", False)
  if remote_decode and remote_prefill:
    raise Refused("kv_transfer_params asks for both a remote prefill and a remote decode; a "
                  "request is one or the other.")
  if remote_decode and role == "decode":
    raise Refused("this node decodes (--role=decode): send requests with "
                  "do_remote_decode to a prefill node.")
  if remote_prefill and role == "prefill":
    raise Refused("this node prefills (--role=prefill): send requests with "
                  "do_remote_prefill to a decode node.")
  if remote_decode and body.get("stream"):
    raise Refused("a prefill to hand off is answered whole: send it with stream=false "
                  "(the decode node streams).", "stream")
  return remote_decode or role == "prefill", (params if remote_prefill else None)


def hand_off(cache, prompt: list[int], tenant: str, *, engine_id: str, host: str | None,
             port: int | None, deadline_s: float) -> dict:
  """Waits (up to ``deadline_s``) for the puts of the prompt's own blocks; returns the
  ``kv_transfer_params`` of the answer, promising the leading run placed by then. ``host``
  and ``port``: this server's own address. Runs off the event loop (it waits)."""
  usable = (len(prompt) - 1) // cache.config.page_size  # what a decode node can reuse
  keys = cache.index.block_keys(prompt, tenant)[:usable]
  ids = cache.placed_in_pool(keys, deadline_s)
  cache.stats.add("pd_prefills_handed_off" if len(ids) == len(keys)
                  else "pd_prefills_not_handed_off")
  cache.stats.add("pd_blocks_handed_off", len(ids))
  return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": engine_id,
          "remote_block_ids": ids,
          "remote_host": host, "remote_port": port, "tp_size": 1}


@dataclasses.dataclass(frozen=True, kw_only=True)
class HandOff:
  """The engine command of a prefill's hand-off (``hand_off`` with the engine's cache):
  its value is the answer's ``kv_transfer_params``. It waits for puts, so it runs beside
  the engine's loop (which goes on stepping, and so carries out the write-through)."""

  on_engine_thread: ClassVar[bool] = False
  prompt: tuple
  tenant: str
  engine_id: str
  host: str | None
  port: int | None
  deadline_s: float

  def __call__(self, engine) -> dict:
    return hand_off(engine.cache, list(self.prompt), self.tenant, engine_id=self.engine_id,
                    host=self.host, port=self.port, deadline_s=self.deadline_s)


@dataclasses.dataclass(frozen=True)
class Received:
  """The engine command that counts a decode request's hand-off: what it was promised
  (``len(kv_transfer_params["remote_block_ids"])``)."""

  on_engine_thread: ClassVar[bool] = True
  promised_blocks: int

  def __call__(self, engine) -> None:
    engine.cache.stats.add("pd_decodes_received")
    engine.cache.stats.add("pd_blocks_promised", self.promised_blocks)
