"""Route each API request to the replica holding its prefix (jaxkv/entrypoints/openai/router.py).

  python -m dynamo.indexer --port 8090 &                       # Dynamo's standalone KV indexer
  python launch/server.py --port=8001 --kv_events=tcp://127.0.0.1:5557 \
      --kv_events_replay=tcp://127.0.0.1:5558 &                # each replica publishes
  python launch/server.py --port=8002 --kv_events=tcp://127.0.0.1:5567 \
      --kv_events_replay=tcp://127.0.0.1:5568 &
  python launch/router.py --port=8000 --indexer=http://127.0.0.1:8090 \
      --replicas=http://127.0.0.1:8001,http://127.0.0.1:8002 \
      --replica_events=tcp://127.0.0.1:5557@tcp://127.0.0.1:5558,\
tcp://127.0.0.1:5567@tcp://127.0.0.1:5568

The indexer knows replica i (0-based) as worker i+1. With --replica_events the router
registers each replica's event stream (and replay socket, after '@') at the indexer when it
starts; without it the indexer must already know them (its --workers). --routing=round_robin
routes in turn without asking the indexer.

Give the router what the replicas have: --api_keys_file (a request without a valid key is
refused here, before the indexer is asked or a replica chosen) and --deployment_key_file
(it keys the tenants' token mapping the events use). GET /router/stats counts the decisions
(with keys: for --metrics_tenants only); an answer a replica accepted carries the replica
that gave it in the x-jaxkv-replica header.
"""

from absl import app, flags

import _common

_REPLICAS = flags.DEFINE_list("replicas", None, "Base URLs of the replicas "
                              "(http://HOST:PORT), launch/server.py processes.", required=True)
_INDEXER = flags.DEFINE_string("indexer", None, "URL of the KV indexer (Dynamo's "
                               "standalone indexer, python -m dynamo.indexer).")
_REPLICA_EVENTS = flags.DEFINE_list(
    "replica_events", [], "Each replica's --kv_events endpoint, optionally '@' its "
    "--kv_events_replay endpoint, in --replicas order: registered at the indexer at start.")
_BLOCK_SIZE = flags.DEFINE_integer("block_size", 16, "The replicas' page size in tokens "
                                   "(with --replica_events: the indexer's block size).",
                                   lower_bound=1)
_INDEXER_MODEL = flags.DEFINE_string("indexer_model", "default", "The model name the "
                                     "replicas are registered under at the indexer.")
_ROUTING = flags.DEFINE_enum("routing", "prefix", ["prefix", "round_robin"], "prefix: the "
                             "replica holding most of the prompt, less its load; round_robin: "
                             "in turn.")
_POLICY = flags.DEFINE_enum("policy", None, ["prefix", "round_robin"], "Deprecated: "
                            "--routing's former name (still works, with a warning).")
_LOAD_TOKENS = flags.DEFINE_float("load_tokens", 256.0, "What one request in flight on a "
                                  "replica costs, in prompt tokens to compute.", lower_bound=0)
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "The replicas' checkpoint directory: its "
                                 "tokenizer turns text and chat requests into the token ids "
                                 "the indexer scores (without it they are placed by load).")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on.")
_PORT = flags.DEFINE_integer("port", 8000, "Port to listen on (0: any free port, written "
                             "to --ready_file).", lower_bound=0, upper_bound=65535)
_READY_FILE = flags.DEFINE_string("ready_file", None, "Write {\"port\": P} here once it listens.")
_TIMEOUT = flags.DEFINE_float("timeout_s", 600.0, "The longest a replica may take to answer.",
                              lower_bound=0.001)
_API_KEYS_FILE = flags.DEFINE_string(
    "api_keys_file", None, "The replicas' keys file (JSON {\"<api key>\": \"<tenant>\"}, mode "
    "600): the router refuses a request without a valid key before it routes it, and asks "
    "the indexer per tenant. Without it every request is tenant 'default'.")
_METRICS_TENANTS = flags.DEFINE_list(
    "metrics_tenants", [], "With --api_keys_file: the tenants whose keys may read "
    "/router/stats (it counts every tenant's requests).")
_DEPLOYMENT_KEY_FILE = flags.DEFINE_string(
    "deployment_key_file", None, "The replicas' deployment key file (mode 600): the tenants' "
    "token mapping in their KV events is keyed by it; default $JAXKV_DEPLOYMENT_KEY_FILE or "
    "$JAXKV_DEPLOYMENT_KEY.")
_RAW_TOKENS = flags.DEFINE_bool(
    "raw_tokens", False, "The replicas send raw token ids in their events "
    "(--config.tiers.kv_events_raw_tokens): ask the indexer with raw ids (one tenant only).")
_HTTP_LIMITS = _common.define_http_limit_flags()
_MAX_BODY_BYTES = flags.DEFINE_integer("max_body_bytes", 4 << 20, "The largest request body "
                                       "taken; larger ones get 413 before they are read.",
                                       lower_bound=1)


def _routing() -> str:
  """--routing, or the value of its former name --policy (with a warning)."""
  return _common.renamed_flag(_ROUTING, _POLICY)


def main(argv):
  del argv
  api_keys = _common.load_api_keys(_API_KEYS_FILE.value)
  from jaxkv import security
  from jaxkv.entrypoints.openai import router as router_lib
  from jaxkv.errors import InputError
  _common.check_output(_READY_FILE.value, "ready_file")
  if _METRICS_TENANTS.value and api_keys is None:
    raise app.UsageError("--metrics_tenants names tenants of --api_keys_file: give it too.")
  try:
    config = router_lib.RouterConfig(routing=_routing(), indexer=_INDEXER.value and
                                     _INDEXER.value.rstrip("/"),
                                     indexer_model=_INDEXER_MODEL.value,
                                     load_tokens=_LOAD_TOKENS.value, timeout_s=_TIMEOUT.value,
                                     max_body_bytes=_MAX_BODY_BYTES.value,
                                     raw_tokens=_RAW_TOKENS.value)
    tokenizer = None
    if _MODEL_DIR.value:
      from jaxkv.entrypoints.openai.tokenizer import Tokenizer
      tokenizer = Tokenizer.from_dir(_MODEL_DIR.value)
    router = router_lib.Router([(u, i + 1) for i, u in enumerate(_REPLICAS.value)], config,
                               tokenizer, api_keys=api_keys,
                               metrics_tenants=_METRICS_TENANTS.value,
                               deployment_key=security.load_deployment_key(
                                   _DEPLOYMENT_KEY_FILE.value))
  except InputError as e:
    raise app.UsageError(str(e)) from None
  if api_keys is None and not security.is_loopback(_HOST.value):
    security.warn_insecure(f"the router listens on {_HOST.value} without --api_keys_file: "
                           "whoever reaches it runs requests and reads /router/stats",
                           "give --api_keys_file (the replicas' keys) or --host=127.0.0.1")
  if len(set((api_keys or {}).values())) > 1 and not router.keyed:
    security.warn_insecure("tenants share this router without a deployment key: the token "
                           "mapping that keeps their prefixes apart follows from tenant names",
                           "give --deployment_key_file (the replicas' key)")
  if len(set((api_keys or {}).values())) > 1 and _RAW_TOKENS.value:
    security.warn_insecure("--raw_tokens with several tenants: the indexer matches every "
                           "tenant's request against every tenant's blocks, so one tenant's "
                           "prefixes steer (and reveal themselves to) another's requests",
                           "leave --raw_tokens off (and kv_events_raw_tokens on the replicas)")
  if _REPLICA_EVENTS.value:
    if len(_REPLICA_EVENTS.value) != len(_REPLICAS.value):
      raise app.UsageError(f"--replica_events names {len(_REPLICA_EVENTS.value)} endpoints for "
                           f"{len(_REPLICAS.value)} --replicas; give one per replica, in order.")
    if not _INDEXER.value:
      raise app.UsageError("--replica_events registers at the indexer: give --indexer too.")
    for i, spec in enumerate(_REPLICA_EVENTS.value):
      events, _, replay = spec.partition("@")
      try:
        router_lib.register(_INDEXER.value.rstrip("/"), i + 1, events, replay=replay or None,
                 block_size=_BLOCK_SIZE.value, model_name=_INDEXER_MODEL.value)
      except (InputError, OSError) as e:
        raise app.UsageError(f"--replica_events: {e}") from None
  _common.serve_app(router_lib.make_app(router), host=_HOST.value, port=_PORT.value,
                    ready_file=_READY_FILE.value, limits=_HTTP_LIMITS(),
                    banner=f"router over {len(_REPLICAS.value)} replicas ({config.routing})")

if __name__ == "__main__":
  _common.run(main)
