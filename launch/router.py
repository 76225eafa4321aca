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
starts; without it the indexer must already know them (its --workers). --policy=round_robin
routes in turn without asking the indexer. GET /router/stats counts the decisions; every
answer carries the replica that gave it in the x-jaxkv-replica header.
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
_POLICY = flags.DEFINE_enum("policy", "prefix", ["prefix", "round_robin"], "prefix: the "
                            "replica holding most of the prompt, less its load; round_robin: "
                            "in turn.")
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


def main(argv):
  del argv
  from jaxkv.entrypoints.openai import router as router_lib
  from jaxkv.errors import InputError
  _common.check_output(_READY_FILE.value, "ready_file")
  try:
    config = router_lib.RouterConfig(policy=_POLICY.value, indexer=_INDEXER.value and
                                     _INDEXER.value.rstrip("/"),
                                     indexer_model=_INDEXER_MODEL.value,
                                     load_tokens=_LOAD_TOKENS.value, timeout_s=_TIMEOUT.value)
    tokenizer = None
    if _MODEL_DIR.value:
      from jaxkv.entrypoints.openai.tokenizer import Tokenizer
      tokenizer = Tokenizer.from_dir(_MODEL_DIR.value)
    router = router_lib.Router([(u, i + 1) for i, u in enumerate(_REPLICAS.value)], config,
                               tokenizer)
  except InputError as e:
    raise app.UsageError(str(e)) from None
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
                    ready_file=_READY_FILE.value,
                    banner=f"router over {len(_REPLICAS.value)} replicas ({_POLICY.value})")

if __name__ == "__main__":
  _common.run(main)
