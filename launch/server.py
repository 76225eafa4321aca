"""Serve an OpenAI-compatible HTTP API (jaxkv.entrypoints.openai.server) over one engine.

  python launch/server.py --port=8000                          # configs/cpu_tiny.py, token ids
  python launch/server.py --model_dir=/ckpt/llama --port=8000  # text and chat
  python launch/server.py --checkpoint_dir=/ckpt/kv --restore  # warm start; saved at SIGTERM
  python launch/multihost.py --num_processes=2 -- launch/server.py --port=8000

The port opens at once; /health says 503 until the engine is compiled (and restored),
then 200. SIGTERM (or Ctrl-C) drains: new requests get 503, running ones finish within
--drain_timeout_s (the rest are aborted), the tiers are flushed and, with
--checkpoint_dir, the cache is saved, so the next start with --restore is warm. A second
signal exits at once, and so does one that comes before the engine is warm (nothing runs
yet; the process ends as SIGTERM's default does). Under launch/multihost.py process 0 serves HTTP and every process
runs the same steps.
"""

import os
import signal
import socket
import sys
import threading
import time

import uvicorn
from absl import app, flags, logging

import _common
import _flags

_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every "
                            "interface; put an API key file in front of it).")
_PORT = flags.DEFINE_integer("port", 8000, "TCP port to listen on (0: any free port, "
                             "printed at start).", lower_bound=0, upper_bound=65535)
_API_KEYS_FILE = flags.DEFINE_string(
    "api_keys_file", None, "JSON object {\"<api key>\": \"<tenant>\"}: requests then need "
    "'Authorization: Bearer <key>' and run as its tenant (tenants never share cached "
    "prefixes). Must not be readable by group or others (chmod 600).")
_MAX_WAITING = flags.DEFINE_integer("max_waiting", 64, "Requests that may wait for a batch "
                                    "row beyond the running ones; more get 429.", lower_bound=0)
_DRAIN = flags.DEFINE_float("drain_timeout_s", 30.0, "At SIGTERM: how long running requests "
                            "may take to finish before they are aborted.", lower_bound=0.0)
_TIMEOUT = flags.DEFINE_float("request_timeout_s", 600.0, "The longest a request may wait for "
                              "its answer (then 504; a stream ends with an error event).",
                              lower_bound=0.001)
_MODEL_NAME = flags.DEFINE_string("served_model_name", None, "The model's name in the API "
                                  "(default: the config's model name).")
_BLOCK_ADDRESS = flags.DEFINE_string(
    "block_address", None, "Also serve this cache's device and host blocks to other jobs' "
    "remote tiers (their --config.tiers.remote_peers) on HOST:PORT, answered between steps. "
    "Needs a deployment key unless HOST is loopback or --allow_insecure is given.")
_ALLOW_INSECURE = flags.DEFINE_bool(
    "allow_insecure", False, "Serve blocks on a non-loopback --block_address without a "
    "deployment key: anyone who reaches it can test which prompts were served and pull their "
    "KV. For isolated test networks only.")
_READY_FILE = flags.DEFINE_string("ready_file", None, "Write {\"port\": P} here once the "
                                  "server takes requests (for scripts that start it; with "
                                  "--block_address also \"block_address\"; with the engine "
                                  "in its own process, its \"core_pid\").")
_RUNNING_PER_TENANT = flags.DEFINE_integer(
    "max_running_per_tenant", -1, "Requests one tenant (API key) may have in the engine at "
    "once; its others wait (at most --max_waiting_per_tenant), so one tenant cannot hold "
    "every row. -1: half the rows when the API keys name two or more tenants, else no "
    "limit; 0: no limit.", lower_bound=-1)
_WAITING_PER_TENANT = flags.DEFINE_integer(
    "max_waiting_per_tenant", -1, "Requests one tenant may have waiting beyond its "
    "--max_running_per_tenant (then 429 for that tenant). -1: half of --max_waiting.",
    lower_bound=-1)
_WARMUP = flags.DEFINE_enum(
    "warmup", "background", ["background", "all"], "background: /health is 200 once the "
    "smallest step bucket is compiled; the others compile while the engine is idle (a "
    "request that needs one first compiles it), and /health's 'warm' turns true when all "
    "are. all: every bucket before /health is 200. A multi-process job compiles all first.")
_WARMUP_STREAM_TOKENS = flags.DEFINE_integer(
    "warmup_stream_tokens", 0, "With --stream_long_contexts: also compile, before "
    "serving, the streamed steps of sequences up to this many tokens (their shapes grow "
    "with the length); longer ones compile when they first come. 0: none.", lower_bound=0)
_METRICS_TENANTS = flags.DEFINE_list(
    "metrics_tenants", [], "With --api_keys_file: the tenants whose keys may read /metrics "
    "(its counters are every tenant's). Others get 403.")
_METRICS_PORT = flags.DEFINE_integer(
    "metrics_port", None, "Also serve /metrics without a key on 127.0.0.1:P (loopback only: "
    "for a scraper on this host).", lower_bound=0, upper_bound=65535)
_MAX_CONNECTIONS = flags.DEFINE_integer(
    "max_connections", None, "HTTP connections open at once; more are answered 503 and "
    "closed (default: half the file-descriptor limit, at most 1000).", lower_bound=1)
_HEADER_TIMEOUT = flags.DEFINE_float(
    "header_timeout_s", 10.0, "A request's line and headers must arrive within this (408).",
    lower_bound=0.001)
_BODY_TIMEOUT = flags.DEFINE_float(
    "body_timeout_s", 30.0, "A request's body must arrive within this after its headers "
    "(408).", lower_bound=0.001)
_MAX_HEADER_BYTES = flags.DEFINE_integer(
    "max_header_bytes", 64 * 1024, "The most bytes of request line and headers read (431).",
    lower_bound=1024)
_ENGINE_PROCESS = flags.DEFINE_bool(
    "engine_process", True, "Run the engine core (the step loop, the cache and its tiers) "
    "in a process of its own, started by this one, which parses, authenticates, "
    "tokenizes, detokenizes and streams: the two do not share one Python lock. A "
    "multi-process job keeps the engine in this process.")
_CORE_DIR = flags.DEFINE_string(
    "core_dir", None, "(Set by the server for its engine core: the directory of the "
    "sockets it answers on.)")
_ADVERTISE = flags.DEFINE_string(
    "advertise_address", None, "HOST or HOST:PORT that a prefill's kv_transfer_params name "
    "as remote_host/remote_port (--role=prefill): where a proxy reaches this server. "
    "Default: --host and the port it listens on (this machine's host name when --host is "
    "0.0.0.0 or ::). Never taken from a request's Host header.")
_KEEP_ALIVE = flags.DEFINE_float("keep_alive_s", 5.0, "An idle keep-alive connection is "
                                 "closed after this.", lower_bound=0.001)


def _api_keys(path: str | None) -> dict | None:
  return _common.load_api_keys(path)


def _advertised() -> tuple[str | None, int | None]:
  """``--advertise_address`` as (host, port); either None where the listening address
  gives it."""
  value = _ADVERTISE.value
  if value is None:
    return None, None
  host, sep, port = value.rpartition(":")
  if not sep or "]" in port or (":" in host and not host.startswith("[")):  # HOST, [V6], V6
    host, port = value, ""
  host = host.strip("[]")
  if not host or any(c in host for c in "/?#@ ") or (port and (
      not port.isdigit() or not 0 < int(port) < 65536)):
    raise app.UsageError(f"--advertise_address={value!r} must be HOST or HOST:PORT (port "
                         "1-65535), e.g. prefill-1.internal:8100.")
  return host, int(port) if port else None


def _hand_off_address(port: int) -> tuple[str, int]:
  """(host, port) of a prefill's hand-off: --advertise_address, else --host (a wildcard:
  this machine's host name) and ``port``, the port the server listens on."""
  host, advertised_port = _advertised()
  if host is None:
    host = _HOST.value if _HOST.value not in ("0.0.0.0", "::", "") else socket.gethostname()
  return host, advertised_port or port


def _block_address(deployment_key) -> tuple[str | None, int]:
  """``--block_address`` as (host, port), refused when it would serve blocks to anyone."""
  if not _BLOCK_ADDRESS.value:
    return None, 0
  host, _, port = _BLOCK_ADDRESS.value.rpartition(":")
  if not host or not port.isdigit() or int(port) > 65535:
    raise app.UsageError(f"--block_address={_BLOCK_ADDRESS.value} must be HOST:PORT "
                         "(port 0: any free one).")
  from jaxkv import security
  if deployment_key is None and not security.is_loopback(host) and not _ALLOW_INSECURE.value:
    raise app.UsageError(f"--block_address={_BLOCK_ADDRESS.value} without a deployment key "
                         "would let anyone who reaches it test which prompts were served and "
                         "pull their KV: give --deployment_key_file (or --allow_insecure on an "
                         "isolated network).")
  return host, int(port)


def _tenant_shares(api_keys: dict | None, rows: int) -> tuple[int, int]:
  """``--max_running_per_tenant`` and ``--max_waiting_per_tenant`` with their defaults
  resolved: with two or more tenants, each may hold half the rows (``rows``: the batch's,
  over every data shard) and half the waiting slots (rounded up), so that a second
  tenant is always served."""
  tenants = len(set(api_keys.values())) if api_keys else 1
  running, waiting = _RUNNING_PER_TENANT.value, _WAITING_PER_TENANT.value
  if running < 0:
    running = -(-rows // 2) if tenants >= 2 else 0
  if waiting < 0:
    waiting = -(-_MAX_WAITING.value // 2) if running else _MAX_WAITING.value
  if running:
    logging.info("per-tenant share: %d of %d rows running, %d of %d waiting slots", running,
                 rows, waiting, _MAX_WAITING.value)
  return running, waiting


def _check_port(host: str, port: int) -> None:
  """Refuses, before anything is compiled, an address this process cannot listen on."""
  try:
    with socket.create_server((host, port)):
      pass
  except OSError as e:
    raise app.UsageError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another "
                         "--port (0: any free one) or --host.") from None


def main(argv):
  del argv
  if _CORE_DIR.value:  # the engine core of a server's front (below)
    return _core_main()
  _flags.check_restore_flags()
  api_keys = _api_keys(_API_KEYS_FILE.value)
  unknown = set(_METRICS_TENANTS.value) - set((api_keys or {}).values())
  if unknown:
    raise app.UsageError(f"--metrics_tenants={','.join(_METRICS_TENANTS.value)}: "
                         f"{sorted(unknown)} hold no key in --api_keys_file (without API "
                         "keys /metrics is open; with them, name tenants of the keys file).")
  _common.check_output(_READY_FILE.value, "ready_file")
  _advertised()  # a malformed --advertise_address is refused before anything starts
  if os.environ.get("JAXKV_PROCESS_ID", "0") == "0":
    _check_port(_HOST.value, _PORT.value)
  cfg = _common.load_config(_flags.CONFIG)
  _flags.apply_tier_flags(cfg)
  _flags.apply_role(cfg)
  if _engine_in_its_own_process():
    return _front_main(cfg, api_keys)
  _common.start_jax(cfg)  # (before anything imports jaxkv: it imports JAX)
  _flags.check_pool(cfg)
  import jax
  from jaxkv import distributed, metrics
  from jaxkv.serving.service import EngineService
  multi = distributed.initialize()
  if api_keys is None and jax.process_index() == 0:
    _warn_if_open()
  _common.check_platform(cfg)
  engine, tokenizer, block_server, checkpointer, warm_up = _build(cfg, multi)
  running_share, waiting_share = _tenant_shares(
      api_keys, engine.config.max_seqs_per_shard * engine.cache.num_shards)
  service = EngineService(engine, max_waiting=_MAX_WAITING.value,
                          between_steps=block_server.poll if block_server else None,
                          max_running_per_tenant=running_share,
                          max_waiting_per_tenant=waiting_share,
                          idle_work=None if multi else engine.warm_next)
  if jax.process_index() != 0:  # the others run process 0's steps
    # A signal to every process of the job (Ctrl-C, a cluster's stop) drains through
    # process 0, which broadcasts the end; the others keep stepping until then.
    for sig in (signal.SIGTERM, signal.SIGINT):
      signal.signal(sig, lambda *_: logging.info("signal received: this process stops when "
                                                 "process 0 has drained"))
    warm_up()
    service.follow()
    _finish(engine, checkpointer, multi)
    return

  registry = metrics.registry({"jaxkv": engine}, labels={"config": cfg.name})
  if _METRICS_PORT.value is not None:
    metrics.serve(registry, _METRICS_PORT.value, addr="127.0.0.1")

  def warm():
    warm_up()
    service.start()
    return True

  _serve_http(service, tokenizer, api_keys, registry, _MODEL_NAME.value or cfg.model.name,
              warm, {"block_address": block_server.address} if block_server else {})
  if block_server is not None:
    block_server.close()
  _finish(engine, checkpointer, multi)


def _engine_in_its_own_process() -> bool:
  """--engine_process, where the core can take it: one process (not a multi-host job:
  there every process runs the steps). A pool and a P/D role go with either: the
  hand-off is an engine command, run where the engine runs."""
  return _ENGINE_PROCESS.value and not os.environ.get("JAXKV_COORDINATOR")


def _warn_if_open() -> None:
  from jaxkv import security
  if not security.is_loopback(_HOST.value):
    security.warn_insecure(f"the HTTP server listens on {_HOST.value} without "
                           "--api_keys_file: whoever reaches it runs requests and reads "
                           "their cache hits", "give --api_keys_file (or --host=127.0.0.1)")


def _build(cfg, multi: bool, tokenizer: bool = True):
  """The engine and what runs beside it (a block server, a checkpointer); returns them
  with the tokenizer (None without ``tokenizer``: an engine core's front has it) and
  ``warm_up`` (compiles, and restores with --restore)."""
  from jaxkv import security
  from jaxkv.tools import builder
  deployment_key = security.load_deployment_key(_flags.DEPLOYMENT_KEY_FILE.value)
  block_host, block_port = _block_address(deployment_key)
  restore = _flags.should_restore()
  tokenizer = _flags.use_model_dir(cfg, tokenizer=tokenizer)
  engine = builder.build_engine(cfg, deployment_key=deployment_key)
  if _flags.ROLE.value == "prefill":
    engine.cache.pin_pool_puts()  # kept until the decode node has them, or the pin ends
  block_server = None
  if block_host:
    if multi:
      raise app.UsageError("--block_address serves one process's blocks: run it in a "
                           "single-process job (each job is one peer).")
    from jaxkv.worker.tiers.remote import BlockServer
    block_server = BlockServer(engine.cache, block_host, block_port,
                               allow_insecure=_ALLOW_INSECURE.value)
    print(f"serving blocks on {block_server.address}", flush=True)
  checkpointer = None
  if _flags.CHECKPOINT_DIR.value:
    from jaxkv.worker.checkpoint import Checkpointer
    checkpointer = Checkpointer(engine.cache, _flags.CHECKPOINT_DIR.value)

  def warm_up():  # every process, in the same order (calibration agrees across them)
    t0 = time.perf_counter()
    engine.warmup(shapes=1 if _WARMUP.value == "background" and not multi else None,
                  stream_tokens=_WARMUP_STREAM_TOKENS.value)
    if multi and engine.costs is not None:
      from jaxkv.planning.costs import agree_costs
      engine.costs = agree_costs(engine.costs)
    if block_server is not None:
      block_server.warm()  # a peer's first fetch of each size does not wait for a compile
    if restore:
      counts = checkpointer.restore()
      logging.info("restored step %d: %d blocks, %d kept windows (%d in host memory; %d "
                   "failed their checksum)", counts["step"], counts["placed"],
                   counts["windows_kept"] + counts["windows_kept_host"],
                   counts["windows_kept_host"], counts["failed_checksum"])
    engine.mark_warm()  # agreeing costs and a restore are one-off work, not a step's compile
    logging.info("compiled in %.1f s", time.perf_counter() - t0)

  return engine, tokenizer, block_server, checkpointer, warm_up


# ---- the engine core in its own process -------------------------------------------------------
def _front_main(cfg, api_keys) -> None:
  """The server's process when the engine core runs in its own: HTTP, keys, tokenizer,
  detokenizing and streaming here; the step loop (and the cache, the tiers, the
  checkpoint) in the core, a child started with this command line and --core_dir."""
  from absl import logging as absl_logging
  if not flags.FLAGS["verbosity"].present:
    absl_logging.set_verbosity(absl_logging.INFO)
  from jaxkv import security
  from jaxkv.errors import InputError
  from jaxkv.serving import core
  # What can be refused without a device is refused here, before a core starts.
  _block_address(security.load_deployment_key(_flags.DEPLOYMENT_KEY_FILE.value))
  try:
    tokenizer = _flags.load_tokenizer(cfg)
  except InputError as e:
    raise app.UsageError(str(e)) from None
  process = core.CoreProcess()
  try:
    process.start(core.core_argv(process.directory))
    import jax
    jax.config.update("jax_platforms", "cpu")  # the front computes nothing on a device
    if api_keys is None:
      _warn_if_open()
    info = process.wait_info(3600)
  except core.EngineFailed:
    status = process.proc.returncode
    process.kill()
    process.close()
    if status is not None:  # the core refused (its one line is above) or failed: the same
      sys.exit(status)
    raise
  except BaseException:
    process.kill()
    process.close()
    raise
  running_share, waiting_share = _tenant_shares(api_keys, info["engine"].rows)
  service = core.CoreClient(process, info["engine"], max_waiting=_MAX_WAITING.value,
                            max_running_per_tenant=running_share,
                            max_waiting_per_tenant=waiting_share)
  from prometheus_client import CollectorRegistry
  _serve_http(service, tokenizer, api_keys, CollectorRegistry(auto_describe=True),
              _MODEL_NAME.value or info["model_name"],
              lambda: service.wait_ready(None),
              {"core_pid": process.proc.pid, **({"block_address": info["block_address"]}
                                                 if info["block_address"] else {})},
              core_metrics=service.metrics_text)


def _core_main() -> None:
  """The engine core: builds, compiles and runs the engine for the front that started it
  (its parent), taking requests and sending answers over --core_dir's sockets. Signals
  are the front's to handle: it drains, then stops the core, which then flushes the tiers
  and saves the checkpoint as a server does."""
  for sig in (signal.SIGTERM, signal.SIGINT):  # (Ctrl-C reaches the whole process group)
    signal.signal(sig, signal.SIG_IGN)
  cfg = _common.load_config(_flags.CONFIG)
  _flags.apply_tier_flags(cfg)
  _flags.apply_role(cfg)
  _common.start_jax(cfg)
  _flags.check_pool(cfg)
  from prometheus_client import generate_latest

  from jaxkv import metrics
  from jaxkv.serving import EngineInfo, EngineLoop, core
  link = core.CoreLink(_CORE_DIR.value)
  engine, _, block_server, checkpointer, warm_up = _build(cfg, multi=False, tokenizer=False)
  link.send("info", {"engine": EngineInfo.of(engine), "model_name": cfg.model.name,
                     "block_address": block_server.address if block_server else None})
  registry = metrics.registry({"jaxkv": engine}, labels={"config": cfg.name})
  if _METRICS_PORT.value is not None:
    metrics.serve(registry, _METRICS_PORT.value, addr="127.0.0.1")
  link.metrics = lambda: generate_latest(registry)
  warm_up()

  def idle_work() -> bool:  # the buckets left to compile, the front told of each
    more = engine.warm_next()
    link.send("warm", engine.runner.warm_progress())
    return more

  # Back-pressure and tenants' shares are the front's: the core's loop takes what it is sent.
  loop = EngineLoop(engine, deliver=link.deliver, lockstep=False, idle_work=idle_work,
                    between_steps=block_server.poll if block_server else None).start()
  link.serve(loop)
  link.send("ready", engine.runner.warm_progress())
  loop.wait_stopped()
  if loop.failed.is_set():
    link.send("failed", loop.failure)
    link.close()
    sys.exit(1)
  if block_server is not None:
    block_server.close()
  _finish(engine, checkpointer, False)
  link.close()


# ---- HTTP ---------------------------------------------------------------------------------------
def _serve_http(service, tokenizer, api_keys, registry, model_name, warm, ready_extra,
                core_metrics=None) -> None:
  """Serves the API over ``service`` until a signal drains it (or the engine fails: then
  the process exits with status 1). ``warm()`` runs while the port is already open (503
  until it returns True); ``ready_extra``: more of the ready file's fields."""
  from jaxkv.entrypoints.openai import limits as httplimits
  from jaxkv.entrypoints.openai.server import OpenAIServer
  api = OpenAIServer(service, model_name=model_name, tokenizer=tokenizer, api_keys=api_keys,
                     registry=registry, request_timeout_s=_TIMEOUT.value,
                     metrics_tenants=_METRICS_TENANTS.value, role=_flags.ROLE.value,
                     core_metrics=core_metrics,
                     hand_off_address=_hand_off_address(_PORT.value) if _PORT.value else None)
  limits = httplimits.HttpLimits(
      **({} if _MAX_CONNECTIONS.value is None else {"max_connections": _MAX_CONNECTIONS.value}),
      max_head_bytes=_MAX_HEADER_BYTES.value, head_timeout_s=_HEADER_TIMEOUT.value,
      body_timeout_s=_BODY_TIMEOUT.value, keep_alive_s=_KEEP_ALIVE.value)
  config = httplimits.uvicorn_config(api.app, limits, host=_HOST.value, port=_PORT.value,
                                     log_level="warning", timeout_graceful_shutdown=5,
                                     access_log=False)
  server = _Server(config, service, api, _DRAIN.value)
  failure = []

  def start():
    try:
      if not warm():
        server.should_exit = True
        return
      deadline = time.monotonic() + 60
      while not server.started:  # uvicorn binds the port while the engine compiles
        if server.should_exit or time.monotonic() > deadline:
          return
        time.sleep(0.01)
      port = server.servers[0].sockets[0].getsockname()[1]
      api.hand_off_address = _hand_off_address(port)  # (--port=0: known only now)
      api.ready = True  # (no request is served before: hand-offs name the address)
      print(f"serving {api.model_name} on http://{_HOST.value}:{port}/v1", flush=True)
      if _READY_FILE.value:  # whole or absent: written aside, then renamed
        _common.write_json(_READY_FILE.value + ".tmp", {"port": port, **ready_extra})
        os.replace(_READY_FILE.value + ".tmp", _READY_FILE.value)
    except BaseException as e:  # the server cannot run: stop listening, fail the run
      failure.append(e)
      server.should_exit = True

  def watch():  # an internal error stopped the engine: stop serving, exit non-zero
    if service.wait_failed(None):
      server.should_exit = True

  starter = threading.Thread(target=start, name="jaxkv-warmup", daemon=True)
  starter.start()
  threading.Thread(target=watch, name="jaxkv-watch", daemon=True).start()
  server.run()
  starter.join(3600)  # (a failed start: the warmup thread has ended)
  if failure:
    service.close()
    raise failure[0]
  if service.failed.is_set():
    print(f"error: the engine stopped on an internal error ({service.failure}); see the "
          "traceback above. Exiting with status 1.", file=sys.stderr, flush=True)
    sys.exit(1)
  service.close()
  print(f"stopped: requests by how they ended {dict(service.counts)}", flush=True)


def _finish(engine, checkpointer, multi) -> None:
  """After the last step: lower-tier writes flushed, the cache saved when asked."""
  engine.flush()
  if multi:
    from jaxkv import distributed
    distributed.agree_digest(engine.cache.index.digest(), "the PrefixIndex")
  if checkpointer is not None:
    step = checkpointer.save()
    checkpointer.close()
    print(f"saved the cache as step {step} in {_flags.CHECKPOINT_DIR.value}", flush=True)
  engine.cache.close()  # the pool's queued puts finished, its segment unmounted


class _Server(uvicorn.Server):
  """uvicorn's server whose first SIGTERM/SIGINT drains the engine before it stops."""

  def __init__(self, config, service, api, drain_s: float):
    super().__init__(config)
    self.service, self.api, self.drain_s = service, api, drain_s
    self.draining = False

  def handle_exit(self, sig, frame):
    if self.draining or not self.api.ready:  # a second signal, or nothing to drain yet
      return super().handle_exit(sig, frame)
    self.draining = True
    threading.Thread(target=self._drain, name="jaxkv-drain", daemon=True).start()

  def _drain(self):
    aborted = self.service.drain(self.drain_s)
    logging.info("drained: %d requests aborted at the deadline", aborted)
    self.should_exit = True


if __name__ == "__main__":
  _common.run(main)
