"""A real two-process jax.distributed job on loopback: same outputs, same index, same plans,
one disk store shared by the job's processes, checkpoints saved and restored by the job."""

import collections
import json
import os
import re
import subprocess
import sys

import pytest

import helpers  # noqa: E402  (tests/ is on the path: conftest.py sits there)

ROOT = helpers.ROOT
# One layer, and one sequence per data shard (one row bucket): compiling the steps is most
# of each serve process's time, and the tier test starts five. The tiers still overflow
# (device hits, disk hits, records written by both processes; see that test).
SMALL = ["--nocompare", "--config.workload.chat.users=4", "--config.workload.chat.turns=2",
         "--config.workload.chat.system_prompt_tokens=40", "--config.workload.chat.max_new_tokens=6",
         "--config.workload.chat.user_tokens=(8, 30)", "--config.model.num_layers=1",
         "--config.engine.max_seqs_per_shard=1"]


def env():
  return helpers.child_env(drop=("JAX_PLATFORMS",))


PLANNER = r"""
import os, sys
sys.path.insert(0, ".")
from jaxkv import distributed
distributed.initialize()
import jax, numpy as np
from jaxkv.compiles import COMPILES
pid = jax.process_index()
out = open(os.path.join(sys.argv[1], f"p{pid}.txt"), "w")
# The collectives: payloads of many lengths (under, at and over a piece's room, and over
# several pieces), each carried by the programs warm_collectives compiled.
distributed.warm_collectives()
mark = COMPILES.mark()
made = lambda n, salt: ((np.arange(n) * 7 + n + salt) % 251).astype(np.uint8).tobytes()
for n in (0, 1, 247, 248, 249, 2047, 5000, 300_000):
  got = distributed.broadcast_bytes(made(n, 0) if pid == 0 else made(n + 1, 1))
  assert got == made(n, 0), (n, len(got))
for n in (0, 1, 64, 65, 40_000):
  rows = distributed.allgather_codes(np.arange(n, dtype=np.int32) * (pid + 1) - 5)
  assert rows.shape == (2, n) and rows.dtype == np.int32, (n, rows.shape, rows.dtype)
  assert all((rows[p] == np.arange(n) * (p + 1) - 5).all() for p in range(2)), n
assert (distributed.agree_reads(np.array([0, 1, 3 + pid]), unread=9) == [9, 1, 3]).all()
distributed.agree_digest("d" * 64, "a digest")
out.write(f"COLLECTIVES-OK compiled {COMPILES.names_since(mark)}\n")
from jaxkv.planning.costs import CostModel, LinkCost, PrefillCurve, agree_costs
from jaxkv.planning.plan import DISK, HOST, HOT, PlanInputs, plan
rng = np.random.default_rng(0)  # the same inputs everywhere
r, d, m = 16, 2, 12
tiers = rng.choice([HOT, HOST, DISK], size=(r, d, m)).astype(np.int32)
inputs = PlanInputs(tiers=tiers, block_bytes=np.full(tiers.shape, 2e6, np.float32),
    hot=np.zeros((r, d), np.int32), cached_end=np.full((r, d), m, np.int32),
    tail_tokens=np.full((r,), 32, np.int32), free_pages=np.full((d,), 64, np.int32),
    inflight_blocks=np.full((d,), 64, np.int32), link_group=np.zeros((d,), np.int32),
    valid=np.ones((r,), bool), page_size=16)
# Each host measured its own link (calibration differs from machine to machine).
local = CostModel(links={"host_to_device": LinkCost(1e-4, (1 + pid) * 1e8),
                         "disk_to_host": LinkCost(1e-3, 5e7)},
                  prefill=PrefillCurve(1e-3, 2e-5, 1e-9))
mine = distributed.plan_digest(plan(inputs, local.arrays()))
try:
  distributed.agree_digest(mine, "the plan")
  out.write("UNAGREED-COSTS-AGREE\n")
except ValueError:
  out.write("UNAGREED-COSTS-DIFFER\n")
agreed = agree_costs(local)
distributed.agree_digest(distributed.plan_digest(plan(inputs, agreed.arrays())), "the plan")
out.write(f"PLANS-IDENTICAL {agreed.links['host_to_device'].bytes_per_s}\n")
out.close()
"""


@pytest.fixture(scope="module")
def planner_job(tmp_path_factory):
  """What each process of one two-process job of PLANNER wrote (one job, two tests)."""
  work = tmp_path_factory.mktemp("planner")
  script = work / "planner.py"
  script.write_text(PLANNER)
  proc = subprocess.run([sys.executable, "launch/multihost.py", "--num_processes=2", "--",
                         str(script), str(work)], cwd=ROOT, env=env(), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return (work / "p0.txt").read_text() + (work / "p1.txt").read_text()


def test_plans_are_identical_on_every_process(planner_job):
  assert planner_job.count("UNAGREED-COSTS-DIFFER") == 2  # the check does catch a difference
  assert planner_job.count("PLANS-IDENTICAL 100000000.0") == 2  # both with process 0's costs


def test_collectives_carry_any_payload_with_the_programs_warmed_once(planner_job):
  # Broadcasts and gathers of many lengths arrived whole on both processes, and none
  # compiled a program after warm_collectives (a job's collectives compile nothing late).
  assert planner_job.count("COLLECTIVES-OK compiled []") == 2, planner_job


def test_a_failing_process_fails_the_job(tmp_path):
  proc = subprocess.run([sys.executable, "launch/multihost.py", "--num_processes=2", "--",
                         "launch/serve.py", "--config=configs/nope.py"], cwd=ROOT, env=env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode != 0 and "failed with exit status" in proc.stderr


class EventReader:
  """A SUB socket read on a thread until ``stop``: the held (hash, medium) pairs."""

  def __init__(self, endpoint):
    import threading
    import zmq
    self.sock = zmq.Context.instance().socket(zmq.SUB)
    self.sock.setsockopt(zmq.SUBSCRIBE, b"")
    self.sock.setsockopt(zmq.LINGER, 0)
    self.sock.connect(endpoint)
    self.held, self.done = set(), threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def _run(self):
    import msgspec
    while not self.done.is_set():
      if not self.sock.poll(100):
        continue
      _, _, payload = self.sock.recv_multipart()
      for ev in msgspec.msgpack.decode(payload)[1]:
        if ev["type"] == "AllBlocksCleared":
          self.held.clear()
        elif ev["type"] == "BlockStored":
          self.held.add((ev["block_hashes"][0], ev["medium"]))
        else:
          self.held.discard((ev["block_hashes"][0], ev["medium"]))

  def stop(self):
    self.done.set()
    self.thread.join(10)
    self.sock.close(0)


def test_two_process_job_with_host_and_disk_tiers_and_a_checkpoint(tmp_path):
  """One shared disk store for the job: each block written once (the processes take
  turns), the same index everywhere, outputs equal to one process with the same tiers;
  then a job restoring the checkpoint and reading the store gives the same outputs."""
  tiers = lambda d: ["--config.workload.chat.users=8", "--device_pages=8", "--host_pages=2",
                     "--config.scheduler.decision=fetch",
                     "--config.tiers.write_policy=write_through",
                     f"--disk_dir={d / 'disk'}", f"--checkpoint_dir={d / 'ckpt'}"]
  job = lambda *extra, out: subprocess.run(
      [sys.executable, "launch/multihost.py", "--num_processes=2", "--", "launch/serve.py",
       *SMALL, *tiers(tmp_path), *extra, f"--json_out={tmp_path / out}"], cwd=ROOT, env=env(),
      capture_output=True, text=True, timeout=900)
  # The job publishes KV events once (process 0; a second publisher could not bind the
  # endpoint), and a reader's view of the stream is what the job's index held at the end.
  endpoint = f"ipc://{tmp_path / 'events'}"
  reader = EventReader(endpoint)
  first = job(f"--kv_events={endpoint}", out="m.json")
  assert first.returncode == 0, first.stderr[-3000:]
  reader.stop()
  single = subprocess.run([sys.executable, "launch/serve.py", *SMALL, *tiers(tmp_path / "one"),
                           f"--json_out={tmp_path / 's.json'}"], cwd=ROOT, env=env(),
                          capture_output=True, text=True, timeout=900)
  assert single.returncode == 0, single.stderr[-3000:]
  p0, p1, one = (json.loads((tmp_path / n).read_text()) for n in ("m.p0.json", "m.p1.json",
                                                                   "s.json"))
  assert p0["process"] == {"index": 0, "count": 2} and p1["process"]["index"] == 1
  # Nothing compiled after warm-up: every collective's payload, every gather to the host
  # and every transfer was one of the shapes the warm-up compiled.
  for name, run in (("p0", p0), ("p1", p1), ("one process", one)):
    assert run["compiles_after_warmup"] == 0, (name, run["compiled_after_warmup"])
  assert len(p0["machine"]["devices"]) == 8
  assert p0["output_digest"] == p1["output_digest"] == one["output_digest"]
  assert p0["index_digest"] == p1["index_digest"]  # (serve also checks it across processes)
  assert p0["hits"]["device"] > 0 and p0["hits"]["disk"] > 0 and p0["verify_failures"] == 0
  records = [f for _, _, fs in os.walk(tmp_path / "disk" / "records") for f in fs]
  written = [p["stats"]["disk_writes"] for p in (p0, p1)]
  assert min(written) > 0 and sum(written) == len(records)  # each block once, both wrote
  assert p0["stats"]["demoted_disk"] == len(records)
  assert p1["kv_events"] is None and p0["kv_events"]["messages"] >= 2
  # The reader's view against counts the stream did not make: every disk record in the
  # store's directory is told as a DISK block (one store for the job), and device and host
  # blocks are no more than the tiers held at the end (summed over data shards, where one
  # block may sit on several; the stream tells it once).
  assert p0["kv_events"]["untold"] == 0
  told = collections.Counter(m for _, m in reader.held)
  held = p0["tier_occupancy_blocks"][-1]
  assert told["DISK"] == len(records) == held["disk"], (told, held)
  assert 0 < told["GPU"] <= held["device"] and 0 < told["CPU"] <= held["host"], (told, held)
  assert sum(told.values()) == p0["kv_events"]["held"]
  again = job("--restore", "--require_restore", out="r.json")
  assert again.returncode == 0, again.stderr[-3000:]
  restored = re.findall(r"restored step \d+: (\d+) blocks", again.stdout)
  assert restored and all(int(n) > 0 for n in restored), again.stdout[-2000:]
  r0, r1 = (json.loads((tmp_path / n).read_text()) for n in ("r.p0.json", "r.p1.json"))
  assert r0["output_digest"] == r1["output_digest"] == one["output_digest"]
  for name, run in (("restored p0", r0), ("restored p1", r1)):
    assert run["compiles_after_warmup"] == 0, (name, run["compiled_after_warmup"])
  assert r0["index_digest"] == r1["index_digest"]
  assert r0["hits"]["device"] > p0["hits"]["device"]  # the restored pages were reused
