"""Suite ``fabric``: the fetch-or-recompute decision on real, shaped links.

Nodes of a ``jaxkv.tools.fabric.Fabric`` (network namespaces on one bridge, each link
shaped with ``tc``): a *lender* that holds the first turns of a multi-turn chat, and an
*engine* node where a fresh engine answers each conversation's next turn, whose prefix it
finds only across the lender's link. One row per tier the first turns are cached in:

- ``remote``: the lender computed them and serves their blocks (``BlockServer``, under a
  deployment key: it listens on the fabric's address, not loopback); the remote peer tier.
- ``pool``: a Mooncake pool. Its master runs as a service on a node of its own (``master``,
  unshaped), the memory is lent by a process on the lender's node, and a writer there put
  every block in that segment: the engines' gets cross the lender's link. Killing the
  lender loses the blocks, not the pool.
- ``s3``: an S3 server (moto) on the lender's node; a writer there wrote the first turns
  through to a disk tier in its bucket (each sweep point under a prefix of its own, since
  a disk tier reads every record of its prefix when it opens); the engines open the same
  prefix and read the records across the link (the plan's ``disk_to_host``).

At each link rate, from well below to well above the crossover, the same turns run under
three policies, each in a fresh engine (the same compiled steps): ``fetch`` (always fetch
the cached prefix), ``recompute`` (always prefill it) and ``cost`` (the plan, deciding per
request from its measured costs; it learns the link from the fetches it times).

The crossover is where fetching a turn's prefix takes as long as prefilling it: the
prefix's bytes over the prefill time the engine calibrated (``CostModel.prefill``), printed
as Mbit/s. Per point: TTFT p50/p90 per policy, tokens/s, and the plan's blocks fetched,
recomputed and split; outputs of every policy equal (greedy). The link's rate as measured
by real TCP beside the shaped one (``fabric_link_gbps_measured``).

    python launch/bench.py --suite=fabric --json_out=/tmp/fabric.json   # as root
    python launch/bench.py --suite=fabric --fabric_tiers=pool,s3 --quick
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from jaxkv.errors import InputError
from jaxkv.tools import fabric as fabric_lib
from jaxkv.tools.env import child_env

PAGE = 16
MODEL = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             head_dim=32, mlp_dim=512)
POLICIES = ("fetch", "recompute", "cost")
# Where the first turns are cached -> (the link the plan learns, the hit tier's name).
TIERS = {"remote": ("remote_to_host", "remote"), "pool": ("pool_to_host", "pool"),
         "s3": ("disk_to_host", "disk")}

# Shared by both nodes' processes: the same model, cache layout and prompts, so the engine's
# block keys are the lender's.
_COMMON = r"""
import json, os, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
import numpy as np
from flax import nnx
from jaxkv import models
from jaxkv.cache import KVCache
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig, TierConfig
from jaxkv.serving.engine import Engine
from jaxkv.worker.pages import make_mesh
ARGS = json.loads(sys.argv[1])
MODEL = ARGS["model"]

def tiers(peers=(), *, deadline_s=None, writer=False, store=None, bare=False):
  deadline_s = deadline_s or ARGS["deadline_s"]
  if bare:  # a reference that recomputes everything: no lower tier at all
    return TierConfig()
  if ARGS["tier"] == "s3":  # the bucket under the group's prefix (store); the writer writes
    # through from its host tier; an engine's device pool holds every block it computes, so
    # that none is written back to the bucket
    return TierConfig(disk_kvstore=dict(ARGS["s3"], path=store), disk_pages=ARGS["disk_pages"],
                      host_pages_per_shard=ARGS["host_pages"] if writer else 0,
                      read_deadline_s=deadline_s,
                      write_policy="write_through" if writer else "write_back")
  if ARGS["tier"] == "pool":  # every block lives in the lender's segment (this one lends none)
    return TierConfig(pool_master=ARGS["pool_master"], pool_metadata=ARGS["pool_metadata"],
                      pool_segment_mb=0, read_deadline_s=deadline_s,
                      write_policy="write_through" if writer else "write_back")
  return TierConfig(remote_peers=tuple(peers), read_deadline_s=deadline_s)

def engine(decision, peers, **tier_kw):
  cache = CacheConfig(model_name="bench-fabric", num_layers=MODEL["num_layers"],
                      num_kv_heads=MODEL["num_kv_heads"], head_dim=MODEL["head_dim"],
                      page_size=ARGS["page"], pages_per_shard=ARGS["pages"],
                      max_pages_per_seq=ARGS["max_pages"])
  return Engine(models.Llama(models.LlamaConfig(**MODEL), rngs=nnx.Rngs(0)),
                KVCache(cache, make_mesh(data=1, model=1), tiers(peers, **tier_kw),
                        deployment_key=bytes.fromhex(ARGS["key"])),
                EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=ARGS["chunk_pages"]),
                scheduler=SchedulerConfig(decision=decision))

def history(seed):
  return np.random.default_rng(seed).integers(1, MODEL["vocab_size"], ARGS["prefix"]).tolist()

def turn(seed):
  return history(seed) + np.random.default_rng(10_000 + seed).integers(
      1, MODEL["vocab_size"], ARGS["user"]).tolist()
"""

_LENDER = _COMMON + r"""
from jaxkv.worker.tiers.remote import BlockServer
e = engine("fetch", ())
for seed in ARGS["seeds"]:
  e.generate([history(seed)], 1)
server = BlockServer(e.cache, host=ARGS["host"], port=0)
server.warm()
print("ADDRESS", server.address, flush=True)
server.serve(ARGS["serve_s"])
"""

# The pool row's lender node: a lending process runs there already (the master runs on a
# node of its own); this engine (lending nothing) computes the first turns and puts every
# block in the lent segment.
_POOL_WRITER = _COMMON + r"""
e = engine("fetch", (), writer=True)
for seed in ARGS["seeds"]:  # each turn's puts settled before the next (none dropped)
  e.generate([history(seed)], 1)
  if not e.cache.worker.pool.settle(300):
    raise SystemExit("the pool's puts did not settle")
print("ADDRESS", ARGS["host"], e.stats()["pool_puts"], flush=True)
e.cache.worker.close()
"""

# The S3 row's lender node: the S3 server runs there already. Each group of conversations
# (a sweep point, the adaptation run, ...) is written through to the bucket under a prefix
# of its own, by an engine that opens that prefix, and drained before the next.
_S3_WRITER = _COMMON + r"""
import boto3
s3 = boto3.client("s3", endpoint_url=ARGS["s3"]["endpoint"], region_name="us-east-1")
s3.create_bucket(Bucket=ARGS["s3"]["bucket"])  # (the server answers: its port was waited for)
written = 0
for store, seeds in ARGS["groups"]:
  e = engine("fetch", (), store=store, writer=True)
  for seed in seeds:
    e.generate([history(seed)], 1)
  if e.flush(300) != 0 or e.stats()["disk_writes_dropped"]:
    raise SystemExit(f"the writes under {store} did not all reach the bucket")
  written += e.stats()["disk_writes"]
  e.cache.worker.close()
print("ADDRESS", ARGS["host"], written, flush=True)
"""

_CLIENT = r"""
KEPT = ("blocks_fetched", "blocks_recomputed", "blocks_split", "plan_s")
def run(point):
  # Every policy's engine is built and warmed first; then each conversation's turn is asked
  # of every policy in a row, a different policy first each time (A B C, B C A, ...): side
  # by side, so that the machine's drift over the point is every policy's.
  engines = {}
  for decision in point["policies"]:
    e = engine(decision, [ARGS.get("peer")], store=point.get("store"))
    e.warmup(max_seq_len=ARGS["prefix"] + ARGS["user"] + ARGS["new"])  # (calibrates: cost)
    engines[decision] = e
  for e in engines.values():  # (compiles are counted per process: from here, for every engine)
    e.mark_warm()
    e.reset_stats()
  answers = {d: [] for d in engines}
  per_request = {d: [] for d in engines}
  seconds = dict.fromkeys(engines, 0.0)
  order = list(engines)
  for i, seed in enumerate(point["seeds"]):
    for decision in order[i % len(order):] + order[:i % len(order)]:
      e = engines[decision]
      before = e.stats()
      t0 = time.perf_counter()
      answers[decision].append(e.generate([turn(seed)], ARGS["new"])[0])
      seconds[decision] += time.perf_counter() - t0
      after = e.stats()
      per_request[decision].append({k: after[k] - before[k] for k in KEPT})
  out = {}
  for decision, e in engines.items():
    s = e.stats()
    costs = e.costs
    out[decision] = {
        "ttft_s": s["ttft_s"], "seconds": seconds[decision],
        "tokens_per_s": len(point["seeds"]) * ARGS["new"] / seconds[decision],
        "blocks_fetched": s["blocks_fetched"], "blocks_recomputed": s["blocks_recomputed"],
        "blocks_split": s["blocks_split"], "hits": s["hits"].get(ARGS["hit_tier"], 0),
        "compiles_after_warmup": s["compiles_after_warmup"],
        "per_request": per_request[decision],
        "prefill_s": None if costs is None else costs.prefill.seconds(ARGS["prefix"], 0),
        "page_bytes": e.cache.config.page_bytes,
        "link_bytes_per_s": (costs.links[ARGS["link"]].bytes_per_s
                             if costs is not None and ARGS["link"] in costs.links else None),
        "link_latency_s": (costs.links[ARGS["link"]].latency_s
                           if costs is not None and ARGS["link"] in costs.links else None),
        "overlap": None if costs is None else costs.overlap,
        "splits_timed": s["splits_timed"]}
    e.cache.worker.close()
  first = next(iter(answers.values()))
  out["outputs_equal"] = all(a == first for a in answers.values())
  return out

ADAPT = {}

def adapt(cmd):  # one cost engine across the controller's rate changes: each request's figures
  if "engine" not in ADAPT:
    ADAPT["engine"] = engine("cost", [ARGS.get("peer")], store=cmd.get("store"))
    ADAPT["engine"].warmup(max_seq_len=ARGS["prefix"] + ARGS["user"] + ARGS["new"])
  e = ADAPT["engine"]
  out = []
  for seed in cmd["seeds"]:
    before = e.stats()
    e.generate([turn(seed)], ARGS["new"])
    after = e.stats()
    out.append({**{k: after[k] - before[k] for k in KEPT}, "ttft_s": after["ttft_s"][-1]})
  return {"requests": out}

def lost(cmd):  # the lender is gone: the same engine's answers, against recomputing's
  e, ref = ADAPT["engine"], engine("recompute", [], bare=True)
  ref.warmup(max_seq_len=ARGS["prefix"] + ARGS["user"] + ARGS["new"])
  before, out, ref_out, equal = e.stats(), [], [], True
  for seed in cmd["seeds"]:
    got = e.generate([turn(seed)], ARGS["new"])[0]
    equal = equal and got == ref.generate([turn(seed)], ARGS["new"])[0]
    out.append(e.stats()["ttft_s"][-1])
    ref_out.append(ref.stats()["ttft_s"][-1])
  after = e.stats()
  return {"ttft_s": out, "recompute_ttft_s": ref_out, "outputs_equal": equal,
          "hits": (after["hits"].get(ARGS["hit_tier"], 0)
                   - before["hits"].get(ARGS["hit_tier"], 0)),
          "failures_by_reason": {k: v - before["verify_failures_by_reason"].get(k, 0)
                                 for k, v in after["verify_failures_by_reason"].items()},
          "blocks_recomputed": after["blocks_recomputed"] - before["blocks_recomputed"]}

def down(cmd):  # one request over a link that may go down meanwhile (always fetch, short deadline)
  if "down" not in ADAPT:
    ADAPT["down"] = engine("fetch", [ARGS.get("peer")], deadline_s=ARGS["down_deadline_s"],
                           store=cmd.get("store"))
    ADAPT["down"].warmup(max_seq_len=ARGS["prefix"] + ARGS["user"] + ARGS["new"])
    ADAPT["ref"] = engine("recompute", [], bare=True)
    ADAPT["ref"].warmup(max_seq_len=ARGS["prefix"] + ARGS["user"] + ARGS["new"])
  e, seed = ADAPT["down"], cmd["seed"]
  before = e.stats()
  t0 = time.perf_counter()
  got = e.generate([turn(seed)], ARGS["new"])[0]
  seconds, after = time.perf_counter() - t0, e.stats()
  return {"ttft_s": after["ttft_s"][-1], "seconds": seconds,
          "outputs_equal": got == ADAPT["ref"].generate([turn(seed)], ARGS["new"])[0],
          **{k: after[k] - before[k] for k in KEPT},
          "hits": after["hits"].get(ARGS["hit_tier"], 0) - before["hits"].get(ARGS["hit_tier"], 0)}

def where(cmd):  # the lender's processes have started: where to find them
  ARGS.update(cmd["where"])
  return {}

# Compiles the steps while the lender's node starts (the engines built later reuse them).
_first = engine("recompute", [], bare=True)
_first.warmup(max_seq_len=ARGS["prefix"] + ARGS["user"] + ARGS["new"])
_first.cache.worker.close()
OPS = {"adapt": adapt, "lost": lost, "down": down, "where": where}
for line in sys.stdin:
  cmd = json.loads(line)
  print("RESULT " + json.dumps(OPS[cmd["op"]](cmd) if "op" in cmd else run(cmd)), flush=True)
"""


def _rates(quick: bool) -> list[float]:
  return [50.0, 400.0, 3200.0] if quick else [25.0, 50.0, 100.0, 200.0, 400.0, 800.0, 1600.0,
                                              3200.0]


def _pct(xs: list[float], q: float) -> float:
  return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def _tail(path: str) -> str:
  with open(path, errors="replace") as f:
    return f.read()[-2000:]


def _read_result(proc: subprocess.Popen, what: str, deadline_s: float, log: str,
                 prefix: str = "RESULT ") -> dict | str:
  """The next line of ``proc`` (a node's process, logging to ``log``) that starts with
  ``prefix``, within the deadline: a ``RESULT`` as its JSON, another line as its text."""
  import selectors
  sel = selectors.DefaultSelector()
  sel.register(proc.stdout, selectors.EVENT_READ)
  end = time.monotonic() + deadline_s
  while time.monotonic() < end:
    if not sel.select(timeout=max(0.0, end - time.monotonic())):
      break
    line = proc.stdout.readline()
    if not line:
      raise RuntimeError(f"a node's process exited during {what}: {_tail(log)}")
    if line.startswith(prefix):
      rest = line[len(prefix):]
      return json.loads(rest) if prefix == "RESULT " else rest.strip()
  raise TimeoutError(f"no {prefix.strip()} line for {what} within {deadline_s:.0f} s")


class _Client:
  """An engine node's client process: takes commands on stdin, answers ``RESULT`` lines."""

  def __init__(self, fabric, node: str, args: dict, env: dict, logdir: str):
    self.log = os.path.join(logdir, f"{node}.log")
    with open(self.log, "w") as err:  # (the child has its own copy of the file)
      self.proc = fabric.popen(node, [sys.executable, "-c", _COMMON + _CLIENT, json.dumps(args)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                               text=True, env=env)

  def send(self, cmd: dict) -> None:
    self.proc.stdin.write(json.dumps(cmd) + "\n")
    self.proc.stdin.flush()

  def read(self, what: str) -> dict:
    return _read_result(self.proc, what, 1800.0, self.log)

  def ask(self, cmd: dict, what: str) -> dict:
    self.send(cmd)
    return self.read(what)


# The pool row's master (a service on its own node, on its fabric address): Mooncake's ports.
POOL_RPC_PORT, POOL_HTTP_PORT = 50051, 8080
# The S3 row's server (on the lender's node) and its bucket.
S3_PORT, S3_BUCKET = 9000, "jaxkv-fabric"

_PROBE = r"""
import socket, sys, time
end = time.monotonic() + float(sys.argv[3])
while True:
  try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
    break
  except OSError:
    if time.monotonic() > end:
      sys.exit(1)
    time.sleep(0.1)
"""


def _wait_for_port(fabric, host: str, port: int, what: str, log) -> None:
  """Until ``host:port`` accepts TCP, asked from the engine node (the bench's own namespace
  has no route into the fabric), within a minute."""
  probe = fabric.popen("engine", [sys.executable, "-c", _PROBE, host, str(port), "60"])
  if probe.wait(90) != 0:
    raise RuntimeError(f"{what} did not answer on {host}:{port}: {_tail(log.name)}")


def _start_lender(fabric, args: dict, groups: list, env: dict, logdir: str) -> dict:
  """Starts the lender node's processes (and the pool row's master), which hold every
  group's conversations' first turns (``groups``: ``(store prefix, seeds)``; the link's
  rate fast meanwhile: a pool's puts cross it); returns what the engine nodes' clients
  need to find them. (Their output goes to one log file, each holding its own descriptor of
  it: this process's is closed on return.)"""
  seeds = [s for _, group in groups for s in group]
  common = dict(args, seeds=seeds, host=fabric.node("lender").address)
  with open(os.path.join(logdir, "lender.log"), "w") as log:
    if args["tier"] == "remote":  # (serves from its device pool: every block stays there)
      lender = fabric.popen("lender", [sys.executable, "-c", _LENDER, json.dumps(dict(
          common, serve_s=3600.0, pages=len(seeds) * (args["prefix"] // PAGE + 2) + 8))],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
      return {"peer": _read_result(lender, "the lender's start", 600.0, log.name, "ADDRESS ")}
    fabric.set_rate("lender", 100_000.0)
    if args["tier"] == "s3":
      return _start_s3(fabric, common, groups, env, log)
    return _start_pool(fabric, common, env, log)


def _start_pool(fabric, common: dict, env: dict, log) -> dict:
  """The master on the ``master`` node; on the lender's, a process lending the segment
  and a writer (lending nothing) that puts every block there."""
  from jaxkv.worker.tiers.pool import master, native  # pylint: disable=import-outside-toplevel
  native.fetch_libs()
  at = fabric.node("master").address
  fabric.popen("master", master.master_argv(at, POOL_RPC_PORT, POOL_HTTP_PORT),
               env=native.master_env(env), stdout=log, stderr=subprocess.STDOUT)
  for port in (POOL_RPC_PORT, POOL_HTTP_PORT):
    _wait_for_port(fabric, at, port, "the pool's master", log)
  where = {"pool_master": f"{at}:{POOL_RPC_PORT}",
           "pool_metadata": f"http://{at}:{POOL_HTTP_PORT}/metadata"}
  segment_mb = (2 * len(common["seeds"]) * (common["prefix"] // PAGE) * common["page_bytes"]
                // 2**20 + 64)
  lend = fabric.popen("lender", [sys.executable, "-m", "jaxkv.worker.tiers.pool.lend",
                                 f"--pool={where['pool_master']}",
                                 f"--pool_metadata={where['pool_metadata']}",
                                 f"--segment_mb={segment_mb}"],
                      stdout=subprocess.PIPE, stderr=log, text=True, env=env)
  _read_result(lend, "the pool's lender", 120.0, log.name, "lending ")
  writer = fabric.popen("lender", [sys.executable, "-c", _POOL_WRITER,
                                   json.dumps(dict(common, **where))],
                        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
  _read_result(writer, "the pool's writer", 900.0, log.name, "ADDRESS ")
  return where


def _start_s3(fabric, common: dict, groups: list, env: dict, log) -> dict:
  """The S3 server and the writer, both on the lender's node: each group's first turns
  written through to the bucket under the group's prefix."""
  host = common["host"]
  fabric.popen("lender", [sys.executable, "-m", "moto.server", "-H", host, "-p", str(S3_PORT)],
               env=env, stdout=log, stderr=subprocess.STDOUT)
  _wait_for_port(fabric, host, S3_PORT, "the S3 server", log)
  where = {"s3": {"driver": "s3", "bucket": S3_BUCKET, "endpoint": f"http://{host}:{S3_PORT}",
                  "aws_region": "us-east-1"}}
  writer = fabric.popen("lender", [sys.executable, "-c", _S3_WRITER,
                                   json.dumps(dict(common, **where, groups=groups))],
                        stdout=subprocess.PIPE, stderr=log, text=True, env=env)
  _read_result(writer, "the S3 row's writer", 900.0, log.name, "ADDRESS ")
  return where


def _s3_env(env: dict, logdir: str) -> dict:
  """The S3 row's processes: the S3 server's dummy credentials, and empty AWS config
  files."""
  from jaxkv.tools.bench.s3server import CREDENTIALS, empty_aws_config  # pylint: disable=import-outside-toplevel
  return dict(env, **CREDENTIALS, **empty_aws_config(logdir))


def check_tier(tier: str) -> None:
  """Raises ``InputError`` (one line) when row ``tier`` is unknown or cannot run here."""
  if tier not in TIERS:
    raise InputError(f"tier={tier!r} must be one of {tuple(TIERS)}.")
  if tier == "s3" and importlib.util.find_spec("moto") is None:
    raise InputError("the fabric's s3 row needs an S3 server: pip install 'moto[server]' (it "
                     "is in jaxkv's [test] extra), or leave s3 out of the tiers.")


def _groups(rates, turns: int, policies, quick: bool, adapt, shared, down) -> dict:
  """Every run's conversations (seeds), each group under the store prefix its engines
  open (the S3 row: an engine reads every record of its prefix when it opens); none for
  a run that does not happen."""
  per_phase = 4 if quick else 6
  phases = (0, 1, 2, 3) if adapt is True else (0, 3) if adapt == "lost" else ()
  return {
      "points": [(f"p{i}/", [1000 * i + t for t in range(turns)]) for i in range(len(rates))],
      # The adaptation run's four phases (the last with the lender lost): one engine.
      "adapt": ("adapt/", [[50_000 + 100 * i + t for t in range(per_phase if i in phases else 0)]
                           for i in range(4)]),
      # Two engine nodes' conversations at each shared rate, [rate][node][policy].
      "shared": [[[(f"shared{i}-{k}-{j}/",
                    [70_000 + 1000 * i + 100 * k + 10 * j + t for t in range(turns)])
                   for j in range(len(policies))] for k in range(2)]
                 for i in range(len(shared or ()))],
      "down": ("down/", [90_000 + t for t in range(4)] if down else []),
  }


def run(*, quick: bool = False, reps: int = 5, rates: list[float] | None = None,
        prefix: int | None = None, adapt: bool | str = True, policies=POLICIES,
        tier: str = "remote", shared: list[float] | None = None,
        down: float | None = None, compile_cache_dir: str | None = None) -> dict:
  """The sweep (see the module docstring); ``reps`` conversations per point and policy
  (at least 2); ``rates`` (Mbit/s), ``prefix`` (tokens of each turn's cached history),
  ``adapt`` (the rate-change and lost-lender runs; ``"lost"``: the fast phase and the
  lost lender alone) and ``policies`` (``cost`` and some of the fixed ones) override the
  suite's own, for the tests. ``tier``: the row, where the first turns are cached
  (``remote``, ``pool``, ``s3``: the module docstring). ``shared``: rates at which two
  engine nodes fetch over the lender's one link at once; ``down``: the rate at which the
  lender's link is set down in the middle of a fetch (None: neither run).
  ``compile_cache_dir``: where the nodes' processes keep their compiled steps (JAX's
  persistent compilation cache; default ``$JAX_COMPILATION_CACHE_DIR``, else a directory of
  the run's own): engines built after the first, and later runs, compile little. (No
  figure includes a compile: every engine warms up before it is timed.)"""
  if "cost" not in policies or not set(policies) <= set(POLICIES):
    raise InputError(f"policies={policies!r} must name 'cost' and any of {POLICIES}.")
  if adapt not in (True, False, "lost"):
    raise InputError(f"adapt={adapt!r} must be True, False or 'lost' (the lost lender alone).")
  check_tier(tier)
  fabric_lib.check_available()
  rates = sorted(rates or _rates(quick))
  turns = max(2, min(reps, 3 if quick else 8))
  prefix = prefix or (512 if quick else 1024)
  link, hit_tier = TIERS[tier]
  blocks = prefix // PAGE
  args = {"model": MODEL, "page": PAGE, "prefix": prefix, "user": 32, "new": 4,
          "chunk_pages": 8, "deadline_s": 30.0, "down_deadline_s": 3.0, "tier": tier,
          "link": link, "hit_tier": hit_tier, "key": secrets.token_bytes(32).hex(),
          "page_bytes": 2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * PAGE
                        * MODEL["head_dim"] * 4}
  g = _groups(rates, turns, policies, quick, adapt, shared, down)
  adapt_store, adapt_seeds = g["adapt"]
  groups = [(store, seeds) for store, seeds in (
      g["points"] + [(adapt_store, [s for p in adapt_seeds for s in p])]
      + [sj for r in g["shared"] for k in r for sj in k] + [g["down"]]) if seeds]
  biggest = max(len(seeds) for _, seeds in groups)
  args["max_pages"] = (prefix + args["user"] + args["new"]) // PAGE + 2
  # The S3 row: a disk tier that can adopt every record of its prefix; the writer's host
  # tier; engines whose device pool holds every block they compute (none written back).
  args["disk_pages"] = biggest * (blocks + 2) + 16
  args["host_pages"] = (biggest + 4) * (blocks + 4)
  # The engines' pages, and the pool's and S3's writers' (the same compiled steps).
  args["pages"] = (biggest + 1) * (blocks + 4) if tier == "s3" else 4 * (blocks + 4)
  env = child_env(device_count=1, drop=("JAX_PLATFORMS", "JAXKV_DEPLOYMENT_KEY",
                                       "JAXKV_DEPLOYMENT_KEY_FILE"))
  nodes = {"lender": rates[0], "engine": 100_000.0, **({"engine2": 100_000.0} if shared else {}),
           **({"master": 100_000.0} if tier == "pool" else {})}
  # The nodes' logs go to files (a pipe nobody reads would fill and stop them).
  with tempfile.TemporaryDirectory(prefix="jaxkv-fabric-") as logdir, \
       fabric_lib.Fabric(nodes) as fabric:
    env = dict(env, JAX_COMPILATION_CACHE_DIR=(compile_cache_dir or env.get(
        "JAX_COMPILATION_CACHE_DIR") or os.path.join(logdir, "jit")),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    env = _s3_env(env, logdir) if tier == "s3" else env
    clients = [_Client(fabric, n, args, env, logdir) for n in nodes
               if n not in ("lender", "master")]  # (they start while the lender does)
    where = _start_lender(fabric, args, groups, env, logdir)
    for c in clients:
      c.ask({"op": "where", "where": where}, "an engine node's start")
    rows = []
    for rate, (store, seeds) in zip(rates, g["points"]):
      fabric.set_rate("lender", rate)
      measured = fabric.measure_mbit("lender", "engine")
      got = clients[0].ask({"seeds": seeds, "policies": list(policies), "store": store},
                           f"the point at {rate:g} Mbit/s")
      rows.append({"mbit": rate, "measured_mbit": measured, **got})
      print(f"  {tier} {rate:7g} Mbit/s (measured {measured:7.1f}): " + "  ".join(
          f"{p} p50 {1e3 * statistics.median(got[p]['ttft_s']):6.0f} ms" for p in policies),
          flush=True)
    extra = {}
    if shared:
      extra["shared"] = _shared(fabric, clients, shared, g["shared"], policies)
    if down:
      extra["link_down"] = _link_down(fabric, clients[0], down, blocks * args["page_bytes"],
                                      g["down"][0])
    if adapt:
      extra.update(_adapt_and_lose(fabric, clients[0], rates, g["adapt"], blocks, args,
                                   full=adapt != "lost", better=_better(rows, policies)))
    for c in clients:
      c.proc.stdin.close()
  return {**_figures(rows, blocks, policies, tier), **extra}


def run_tiers(tiers=tuple(TIERS), *, quick: bool = False, reps: int = 5,
              shared: list[float] | None = None, down: float | None = None,
              compile_cache_dir: str | None = None) -> dict:
  """The suite: one row per tier in ``tiers`` (each ``run`` with its shared-link and
  link-down runs; their processes share one compilation cache, ``compile_cache_dir`` or a
  directory of this call's own). The JSON has each row's figures under ``tiers``, and the
  remote row's also at the top level, where the suite kept them before it had other rows."""
  if not tiers:
    raise InputError(f"tiers={tiers!r} must name at least one of {tuple(TIERS)}.")
  for tier in tiers:
    check_tier(tier)
  rows = {}
  with tempfile.TemporaryDirectory(prefix="jaxkv-fabric-jit-") as own:
    for tier in tiers:
      print(f"fabric: the {tier} row", flush=True)
      rows[tier] = run(quick=quick, reps=reps, tier=tier, shared=shared or None,
                       down=down or None, compile_cache_dir=compile_cache_dir or own)
  return {**rows.get("remote", {}), "tiers": rows}


def plot_tiers(result: dict, path: str) -> list[str]:
  """``plot`` for each row of ``run_tiers``'s result: at ``path`` when there is one row,
  else at ``path`` with ``-<tier>`` before its extension. Returns the paths written."""
  rows = result["tiers"]
  stem, ext = os.path.splitext(path)
  paths = {t: path if len(rows) == 1 else f"{stem}-{t}{ext}" for t in rows}
  for tier, row in rows.items():
    plot(row, paths[tier])
  return list(paths.values())


def _shared(fabric, clients, rates, seeds, policies) -> dict:
  """Both engine nodes fetch over the lender's one link at once, each policy in turn (a
  fresh engine per policy on each node): the sum of their TTFT p50s per policy, and the
  plan's over the best fixed policy's."""
  out = []
  for i, rate in enumerate(rates):
    fabric.set_rate("lender", rate)
    got = {}
    for j, policy in enumerate(policies):
      for k, c in enumerate(clients):  # at once: each runs its own conversations
        store, group = seeds[i][k][j]
        c.send({"seeds": group, "policies": [policy], "store": store})
      got[policy] = [c.read(f"the shared link at {rate:g} Mbit/s, {policy}")[policy]
                     for c in clients]
    total = {p: sum(statistics.median(g["ttft_s"]) for g in got[p]) for p in policies}
    fixed = [total[p] for p in policies if p != "cost"]
    row = {"mbit": rate, "engines": len(clients),
           **{f"{p}_ttft_p50_sum_s": total[p] for p in policies},
           "plan_vs_best_fixed": total["cost"] / min(fixed) if fixed else None,
           "plan_link_mbit_learned": [None if g["link_bytes_per_s"] is None
                                      else g["link_bytes_per_s"] * 8 / 1e6
                                      for g in got["cost"]],
           "plan_blocks_fetched": [g["blocks_fetched"] for g in got["cost"]],
           "plan_blocks_recomputed": [g["blocks_recomputed"] for g in got["cost"]]}
    out.append(row)
    print(f"  shared by {len(clients)} at {rate:g} Mbit/s: " + "  ".join(
        f"{p} sum {1e3 * total[p]:6.0f} ms" for p in policies), flush=True)
  return {"points": out,
          "fabric_shared_plan_vs_best_fixed_max": max(
              (r["plan_vs_best_fixed"] for r in out if r["plan_vs_best_fixed"]), default=None)}


def _link_down(fabric, client, rate: float, prefix_bytes: int, store: str) -> dict:
  """Requests that always fetch, with a short read deadline (after one that compiles):
  the first with the lender's link set down while its blocks are on the way (a third of
  the way, at the link's rate), the second while it is still down, the third after it is
  up again."""
  fabric.set_rate("lender", rate)
  client.ask({"op": "down", "seed": 90_000, "store": store},
             "the link-down engine's warm-up")  # (compiles)
  got = []
  for n, seed in enumerate((90_001, 90_002)):
    client.send({"op": "down", "seed": seed, "store": store})
    if n == 0:  # (the bench's own pacing: the fetch is under way)
      time.sleep(prefix_bytes * 8 / (rate * 1e6) / 3)
      fabric.link("lender", False)
    got.append(client.read(f"a request with the link down ({n})"))
  fabric.link("lender", True)
  got.append(client.ask({"op": "down", "seed": 90_003, "store": store},
                        "a request with the link up again"))
  return {"mbit": rate, "read_deadline_s": 3.0, "requests": got,
          "fabric_link_down_outputs_equal": all(g["outputs_equal"] for g in got)}


def _better(rows: list[dict], policies) -> tuple[str, str]:
  """The fixed policy that measured faster (TTFT p50) at the sweep's slowest and at its
  fastest rate: what the plan should turn to after the link slows, and after it speeds up
  again. Without both fixed policies in the sweep: recompute, then fetch."""
  if not {"fetch", "recompute"} <= set(policies):
    return ("recompute", "fetch")
  def faster(row):
    p50 = {p: statistics.median(row[p]["ttft_s"]) for p in ("fetch", "recompute")}
    return "fetch" if p50["fetch"] <= p50["recompute"] else "recompute"
  return faster(rows[0]), faster(rows[-1])


def _adapt_and_lose(fabric, client, rates, adapt, blocks, args, full: bool = True,
                    better: tuple[str, str] = ("recompute", "fetch")) -> dict:
  """The link fast, then slow, then fast again under one engine (``adapt``: its store
  prefix and each phase's seeds; not ``full``: the fast phase alone); then the lender's
  processes killed (its node and link stay; the pool row's master lives on its own node):
  misses, not waits."""
  store, adapt_seeds = adapt
  phases = []
  for i, rate in enumerate((rates[-1], rates[0], rates[-1]) if full else (rates[-1],)):
    fabric.set_rate("lender", rate)
    got = client.ask({"op": "adapt", "seeds": adapt_seeds[i], "store": store},
                     f"adaptation phase {i}")
    phases.append({"mbit": rate, "requests": got["requests"]})
  killed = fabric.kill("lender")
  lost = {"processes_killed": killed, "read_deadline_s": args["deadline_s"],
          **client.ask({"op": "lost", "seeds": adapt_seeds[3]}, "the lost lender")}
  # How long each request waited on the lost tier: its TTFT past recomputing's (same turn).
  lost["wait_s"] = [t - r for t, r in zip(lost["ttft_s"], lost["recompute_ttft_s"])]
  return {**(_adaptation(phases, blocks, better) if full else {"adaptation": phases}),
          "lender_lost": lost,
          "fabric_lost_outputs_equal": lost["outputs_equal"],
          # (within half a second of it: giving up a read is noticed, not instant)
          "fabric_lost_within_deadline": max(lost["wait_s"]) <= args["deadline_s"] + 0.5}


def _figures(rows: list[dict], blocks: int, policies=POLICIES, tier: str = "remote") -> dict:
  """The suite's JSON from the sweep's rows."""
  first = rows[0]["cost"]
  prefix_bytes = blocks * first["page_bytes"]
  prefill_s = statistics.median(r["cost"]["prefill_s"] for r in rows)
  crossover_mbit = prefix_bytes * 8 / prefill_s / 1e6
  table, ratios = [], []
  for r in rows:
    p50 = {p: statistics.median(r[p]["ttft_s"]) for p in policies}
    best = min(p50[p] for p in policies if p != "cost") if len(policies) > 1 else p50["cost"]
    ratios.append((r["mbit"], p50["cost"] / best))
    table.append({
        "mbit": r["mbit"], "measured_mbit": r["measured_mbit"],
        **{f"{p}_ttft_p50_s": p50[p] for p in policies},
        **{f"{p}_ttft_p90_s": _pct(r[p]["ttft_s"], 90) for p in policies},
        **{f"{p}_ttft_each_s": r[p]["ttft_s"] for p in policies},  # in the order asked
        **{f"{p}_tokens_per_s": r[p]["tokens_per_s"] for p in policies},
        "plan_blocks_fetched": r["cost"]["blocks_fetched"],
        "plan_blocks_recomputed": r["cost"]["blocks_recomputed"],
        "plan_blocks_split": r["cost"]["blocks_split"],
        **{f"{p}_hits": r[p]["hits"] for p in policies},  # found in the row's tier
        "per_request_fetched": [q["blocks_fetched"] for q in r["cost"]["per_request"]],
        # Seconds the plan took per request (0 where none ran: every block on device).
        "per_request_plan_ms": [round(q["plan_s"] * 1e3, 2) for q in r["cost"]["per_request"]],
        "plan_link_mbit_learned": (None if r["cost"]["link_bytes_per_s"] is None
                                   else r["cost"]["link_bytes_per_s"] * 8 / 1e6),
        "plan_link_latency_ms_learned": (None if r["cost"].get("link_latency_s") is None
                                         else r["cost"]["link_latency_s"] * 1e3),
        # How much of a split's recompute and fetch the plan found hidden (1 at start), from
        # how many splits it timed.
        "plan_overlap_learned": r["cost"].get("overlap"),
        "plan_splits_timed": r["cost"].get("splits_timed"),
        "plan_vs_best_fixed": p50["cost"] / best,
        "outputs_equal": r["outputs_equal"],
        "compiles_after_warmup": max(r[p]["compiles_after_warmup"] for p in policies)})
  # Where the fixed policies' measured lines cross: the first rate at which fetching wins.
  measured_cross = next((t["mbit"] for t in table if {"fetch", "recompute"} <= set(policies)
                         and t["fetch_ttft_p50_s"] <= t["recompute_ttft_p50_s"]), None)
  near = min(ratios, key=lambda mr: abs(np.log(mr[0] / crossover_mbit)))
  return {
      "tier": tier,
      "prefix_tokens": blocks * PAGE, "prefix_bytes": prefix_bytes,
      "prefill_s_calibrated": prefill_s,
      "crossover_mbit_predicted": crossover_mbit,
      "crossover_mbit_measured_first_fetch_win": measured_cross,
      "fabric_plan_vs_best_fixed_max": max(r for _, r in ratios),
      "fabric_plan_vs_best_fixed_at_crossover": near[1],
      "fabric_outputs_equal": all(t["outputs_equal"] for t in table),
      "fabric_link_gbps_measured": {f"{t['mbit']:g}": t["measured_mbit"] / 1e3 for t in table},
      "points": table,
  }


def _adaptation(phases: list[dict], blocks: int,
                better: tuple[str, str] = ("recompute", "fetch")) -> dict:
  """After each rate change, how many requests the plan took to turn to the fixed policy
  that measured faster at the new rate (``better``: at the slow rate, at the fast one; from
  the sweep): the first request (counted from 1) that fetched under half of its cached
  blocks where recomputing was faster, or at least half where fetching was. A plan already
  on the faster side counts 1 (where fetching loses at every rate, as it may on a slow
  store, nothing needs to turn back). ``None``: it did not turn within the phase."""
  def turned(phase, target):
    for n, r in enumerate(phase["requests"], 1):
      share = r["blocks_fetched"] / blocks
      if (share < 0.5) if target == "recompute" else (share >= 0.5):
        return n
    return None

  slowed, sped = turned(phases[1], better[0]), turned(phases[2], better[1])
  return {
      "fabric_adapt_requests": max(slowed or len(phases[1]["requests"]) + 1,
                                   sped or len(phases[2]["requests"]) + 1),
      "fabric_adapt_requests_after_slowdown": slowed,
      "fabric_adapt_requests_after_speedup": sped,
      # What each count waited for: the fixed policy that was faster at that rate.
      "fabric_adapt_targets": {"after_slowdown": better[0], "after_speedup": better[1]},
      "adaptation": phases,
  }


def plot(result: dict, path: str) -> None:
  """TTFT p50 against the link's rate, one line per policy (log-log), the predicted
  crossover and the first rate at which fetching measured faster marked; a PNG at
  ``path`` (needs matplotlib: ``pip install matplotlib``, or the ``[plot]`` extra)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  points = result["points"]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for policy, style in (("fetch", "s--"), ("recompute", "o--"), ("cost", "D-")):
    key = f"{policy}_ttft_p50_s"
    if key in points[0]:
      ax.plot([p["mbit"] for p in points], [1e3 * p[key] for p in points], style,
              label="the plan" if policy == "cost" else f"always {policy}")
  ax.axvline(result["crossover_mbit_predicted"], color="gray", linestyle=":",
             label=f"crossover predicted ({result['crossover_mbit_predicted']:.0f} Mbit/s)")
  if result.get("crossover_mbit_measured_first_fetch_win"):
    ax.axvline(result["crossover_mbit_measured_first_fetch_win"], color="black",
               linestyle="-.", linewidth=0.8, label="first rate where fetching won")
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("lender's link (Mbit/s, shaped with tc)")
  ax.set_ylabel("TTFT p50 (ms)")
  where = {"remote": "a remote peer", "pool": "a Mooncake pool", "s3": "S3"}
  ax.set_title(f"A {result['prefix_tokens']}-token prefix on {where[result['tier']]}")
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
