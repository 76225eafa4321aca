"""A two-process jax.distributed job (launch/multihost.py) with every part real: its tier is
a Mooncake pool (a master and a lender process on loopback; keyed names and sealed values
under a deployment key), it publishes KV events (process
0) to a reader in this process, and it saves a checkpoint mid-run. One member is killed
(SIGKILL) mid-run; the job is started again on the same checkpoint and pool.

- The killed job fails fast with a clear error and leaves no process behind.
- Both processes of the killed job put, each block by one of them only.
- The restarted job answers as a fresh engine that recomputes everything, and takes from
  the pool the blocks the killed job put there (the lender kept them).
- The event stream across the restart tells a router what it needs: the new run's seqs
  jump above the old run's, the replay a reader asks for at the jump starts with
  ``AllBlocksCleared``, the restored blocks are told again under the same hashes, chains
  and tokens, and the blocks the killed run held and the new one does not are gone from
  the reader's view.

One job start each (the killed run and the restart) serves every assertion: the module's
fixture runs both, the tests read what it recorded."""

import json
import os
import re
import signal
import sys
import threading
import time

import msgspec
import pytest
import zmq

import helpers
from jaxkv.worker.tiers.pool.master import LocalMaster

PAGE = 4  # helpers.cache_config_for's page size
PROMPTS = {"a": list(range(5, 19)), "b": list(range(20, 35)), "c": list(range(40, 51))}
NEW_TOKENS = 3
MAX_FRAME = 1 << 22  # what the reader takes in one frame (the publisher's are under 128 KiB)

# Each process of the job: an engine over the tiny model (helpers.make_engine: the same
# weights in every run), its tier the pool (it lends nothing: what it puts
# lives in the lender's segment), KV events on (process 0 publishes).
# "first": prompt a, a checkpoint, then b and c, every put tried; it writes what its index
# holds, then keeps serving prompt a (device hits: the index no longer changes) until killed.
# "again": the checkpoint restored, prompts a and b (b from the pool), then it ends.
JOB = r"""
import json, os, sys, time
sys.path.insert(0, "tests")
from jaxkv import distributed
distributed.initialize()
import jax, jaxkv, helpers
from jaxkv.manager.events import MEDIA, block_hash
from jaxkv.worker.checkpoint import Checkpointer
work, run, master, metadata, new_tokens = sys.argv[1:6]
prompts, new_tokens = json.loads(sys.argv[6]), int(new_tokens)
tiers = jaxkv.TierConfig(pool_master=master, pool_metadata=metadata, pool_segment_mb=0,
                         write_policy="write_through", kv_events=f"ipc://{work}/events",
                         kv_events_replay=f"ipc://{work}/replay")
engine = helpers.make_engine(jaxkv.make_mesh(data=2, model=1), tiers=tiers,
                             deployment_key=bytes(range(32)))  # keyed names, sealed values
checkpoint = Checkpointer(engine.cache, os.path.join(work, "ckpt"))

def report(tokens):
  index, events = engine.cache.index, engine.cache.events
  held = {(block_hash(k), MEDIA[t]) for t in MEDIA if index.has_tier(t)
          for s in range(engine.cache.num_shards) for k in index.cached_keys(s, t)}
  keys = {n: [block_hash(k) for k in index.block_keys(p, "default")] for n, p in prompts.items()}
  stats = engine.stats()
  path = os.path.join(work, f"{run}.p{jax.process_index()}.json")
  with open(path + ".tmp", "w") as f:
    json.dump({"pid": os.getpid(), "tokens": tokens, "held": sorted(held), "keys": keys,
               "hits": stats["hits"], "pool_puts": stats["pool_puts"],
               "pool_put_present": stats.get("pool_put_present", 0),
               "untold": None if events is None else events.untold}, f)
  os.replace(path + ".tmp", path)  # whole, or not there

if run == "first":
  tokens = engine.generate([prompts["a"]], new_tokens)
  checkpoint.save()
  tokens += [engine.generate([prompts[n]], new_tokens)[0] for n in "bc"]  # (one shape)
  assert engine.cache.worker.pool.settle(60), "the pool's puts did not finish in 60 s"
  report(tokens)
  end = time.monotonic() + 300  # (the test kills it long before)
  while time.monotonic() < end:
    engine.generate([prompts["a"]], new_tokens)
  sys.exit(3)
counts = checkpoint.restore()
assert counts["placed"] > 0, counts
report([engine.generate([prompts[n]], new_tokens)[0] for n in "ab"])
engine.cache.close()
"""


class StreamReader:
  """A router's reader of the job's KV events, on a thread: a SUB socket that keeps what
  the stream says is held ((hash, medium) -> the BlockStored map), as a reader that keeps
  the last seq it applied does. A message at or below that seq is dropped (stale); one
  past a gap is preceded by a replay from the seq after it (the replay socket's oldest
  kept message first where it no longer has that seq)."""

  def __init__(self, events: str, replay: str):
    self.replay_endpoint = replay
    self.sock = zmq.Context.instance().socket(zmq.SUB)
    self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    self.sock.setsockopt(zmq.SUBSCRIBE, b"")
    self.sock.setsockopt(zmq.LINGER, 0)
    self.sock.connect(events)
    self.held, self.last, self.stale, self.applied = {}, None, 0, set()
    self.replays = []  # (asked from, the answer's [(seq, events)])
    self.told = []  # every BlockStored applied, in order
    self.error = None
    self._lock, self._done = threading.Lock(), threading.Event()
    self.thread = threading.Thread(target=self._run, daemon=True)
    self.thread.start()

  def view(self) -> set:
    """The (hash, medium) pairs held now."""
    with self._lock:
      return set(self.held)

  def stored(self) -> dict:
    """hash -> the BlockStored map that told it, for every block held now."""
    with self._lock:
      return {h: ev for (h, _), ev in self.held.items()}

  def _run(self):
    try:
      while not self._done.is_set():
        if self.sock.poll(50):
          _, seq, payload = self.sock.recv_multipart()
          self._take(int.from_bytes(seq, "big", signed=True), payload)
    except Exception as e:  # pylint: disable=broad-except  (the test reads it)
      self.error = e

  def _take(self, seq: int, payload: bytes) -> None:
    if self.last is not None and seq <= self.last:
      self.stale += seq not in self.applied  # never seen: dropped
      return
    if self.last is not None and seq > self.last + 1:
      answer = self._replay(self.last + 1)
      self.replays.append((self.last + 1, answer))
      for s, events in answer:
        if s > self.last:
          self._apply(s, events)
      if seq <= self.last:
        return
    self._apply(seq, msgspec.msgpack.decode(payload)[1])

  def _apply(self, seq: int, events: list) -> None:
    with self._lock:
      self.last = seq
      self.applied.add(seq)
      for ev in events:
        if ev["type"] == "AllBlocksCleared":
          self.held.clear()
        elif ev["type"] == "BlockStored":
          self.held[ev["block_hashes"][0], ev["medium"]] = ev
          self.told.append(ev)
        else:
          self.held.pop((ev["block_hashes"][0], ev["medium"]), None)

  def _replay(self, start: int) -> list:
    """The replay socket's answer from ``start``: [(seq, events)] up to its end marker."""
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
      dealer.connect(self.replay_endpoint)
      dealer.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
      got, deadline = [], time.monotonic() + 10
      while time.monotonic() < deadline:
        if not dealer.poll(100):
          continue
        _, seq, payload = dealer.recv_multipart()
        seq = int.from_bytes(seq, "big", signed=True)
        if seq == -1:
          return got
        got.append((seq, msgspec.msgpack.decode(payload)[1]))
      raise TimeoutError(f"the replay from seq {start} did not end in 10 s")
    finally:
      dealer.close(0)

  def close(self):
    self._done.set()
    self.thread.join(10)
    self.sock.close(0)


def reports(work, run):
  return [json.loads((work / f"{run}.p{i}.json").read_text()) for i in (0, 1)]


def start_job(work, run, master):
  return helpers.start_process(
      [sys.executable, "launch/multihost.py", "--num_processes=2", "--devices=2",
       "--timeout_s=300", "--", str(work / "job.py"), str(work), run, master.address,
       master.metadata, str(NEW_TOKENS), json.dumps(PROMPTS)], env=helpers.child_env())


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
  """The killed job and its restart, with what each recorded, and the reader's view."""
  work = tmp_path_factory.mktemp("job")
  (work / "job.py").write_text(JOB)
  box = {}
  with LocalMaster(log_path=str(work / "master.log"), lease_ms=60_000) as master:
    lender = helpers.start_process([sys.executable, "-m", "jaxkv.worker.tiers.pool.lend",
                                    f"--pool={master.address}",
                                    f"--pool_metadata={master.metadata}", "--segment_mb=32"],
                                   env=helpers.child_env())
    reader = StreamReader(f"ipc://{work}/events", f"ipc://{work}/replay")
    first = None
    try:
      line = lender.stdout.readline()
      assert line.startswith("lending"), f"the lender did not mount its segment: {line!r}"
      first = start_job(work, "first", master)
      helpers.wait_for(lambda: all((work / f"first.p{i}.json").exists() for i in (0, 1))
                       or first.poll() is not None, 240, "the first job's reports")
      assert first.poll() is None, first.communicate()[1][-3000:]
      box["first"] = reports(work, "first")
      # The stream is read up to what process 0's index held when it reported (it keeps
      # serving prompt a, on device: its index holds the same from then on).
      held = {tuple(x) for x in box["first"][0]["held"]}
      helpers.wait_for(lambda: reader.view() == held, 30,
                       "the reader to see what the first job's index holds")
      box["first_view"], box["first_last"] = reader.view(), reader.last
      box["first_told"] = {ev["block_hashes"][0]: ev for ev in reader.told}
      os.kill(box["first"][1]["pid"], signal.SIGKILL)  # one member, mid-run
      t_kill = time.monotonic()
      box["killed"] = helpers.finish_process(first, 60, "the job with a killed member")
      box["fail_s"] = time.monotonic() - t_kill
      box["left"] = helpers.session_processes(first.pid)
      again = start_job(work, "again", master)
      box["again_exit"] = helpers.finish_process(again, 240, "the restarted job")
      assert box["again_exit"][0] == 0, box["again_exit"][2][-3000:]
      box["again"] = reports(work, "again")
      box["lender_alive"] = lender.poll() is None
      yield box, reader
    finally:
      reader.close()
      if first is not None and first.poll() is None:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
      lender.terminate()
      helpers.finish_process(lender, 30, "the lender")


def test_a_killed_member_fails_the_job_fast_with_a_clear_error_and_nothing_left(jobs):
  box, _ = jobs
  code, _, err = box["killed"]
  # launch/multihost.py's line names the process that ended the job, and how; process 0
  # is either stopped by it or fails on its own first (its collective's peer is gone).
  line = err.strip().splitlines()[-1]
  said = re.fullmatch(r"error: process\(es\) \[([\d, ]+)\] failed with exit status \[([^]]*)\]"
                      r"(; stopped the other process\(es\) \[0\])?", line)
  assert code == 1 and said, err[-2000:]
  status = dict(zip(said[1].split(", "), said[2].split(", ")))
  assert status["1"] == "-9 (killed by SIGKILL)", line
  assert said[3] or status["0"] != "0", line
  assert box["fail_s"] < 20, box["fail_s"]  # no wait for a collective's timeout
  assert box["left"] == [], box["left"]  # process 0 was stopped with it
  assert box["lender_alive"]


def test_the_restarted_job_answers_exactly_and_hits_what_the_killed_one_put(jobs):
  box, _ = jobs
  first, again = box["first"], box["again"]
  # The killed job reused nothing (a fresh pool, distinct prompts): its answers are a
  # recompute's, the reference for the restart's.
  for p in first:
    assert not any(p["hits"].values()), p["hits"]
  assert first[0]["tokens"] == first[1]["tokens"]
  assert min(p["pool_puts"] for p in first) > 0  # both processes put
  # Each block by one of them: neither found a block the other had put (nor one of its own).
  assert [p["pool_put_present"] for p in first] == [0, 0], first
  assert again[0]["tokens"] == again[1]["tokens"] == first[0]["tokens"][:2]
  full = lambda p: (len(p) - 1) // PAGE
  # a from the checkpoint (on device), b from the pool: every full block of each.
  for p in again:
    assert p["hits"]["device"] == full(PROMPTS["a"]), p["hits"]
    assert p["hits"]["pool"] == full(PROMPTS["b"]), p["hits"]


def test_the_event_stream_tells_a_router_what_the_restarted_job_holds(jobs):
  box, reader = jobs
  assert reader.error is None, reader.error
  first, again = box["first"][0], box["again"][0]
  # The block hashes of each prompt are the same in both runs (the router's keys).
  assert first["keys"] == again["keys"]
  # The restart's messages all came above the killed run's seqs (none dropped as stale);
  # the reader took the jump as a gap, and the replay it asked for starts with
  # AllBlocksCleared: what the old run told is gone.
  assert reader.stale == 0
  assert reader.replays, "the reader saw no gap at the restart"
  start, answer = reader.replays[0]
  assert start == box["first_last"] + 1 and answer and answer[0][0] > box["first_last"]
  assert answer[0][1][0] == {"type": "AllBlocksCleared"}, answer[0][1][:2]
  # What the stream says is held is what the restarted job's index holds, every block told.
  held = {tuple(x) for x in again["held"]}
  helpers.wait_for(lambda: reader.view() == held, 30,
                   "the reader to see what the restarted job's index holds")
  assert again["untold"] == 0
  # Prompt a's blocks, restored from the checkpoint, are told again as the killed run
  # told them: the same hash, parent and tokens (a router's tree links them as before).
  restored = {h for h in again["keys"]["a"]}
  view = reader.stored()
  assert restored <= set(view)
  for h in restored:
    assert view[h] == box["first_told"][h], h
  # Prompt c's blocks were held by the killed run only: gone from the reader's view.
  gone = box["first_view"] - held
  assert {h for h, _ in gone} >= set(first["keys"]["c"])
  assert not gone & reader.view()
