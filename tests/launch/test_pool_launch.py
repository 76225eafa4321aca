"""--pool on the launch scripts, as a user runs them: a second serve.py run (a restart, a new
process) hits the blocks the first one lent; two OpenAI servers on one pool answer exactly,
the second from the first's blocks; a bad --pool is one line and exit 2 before any compile."""

import json
import subprocess
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

import helpers
from jaxkv.tools.bench.http import ServerProcess
from jaxkv.worker.tiers.pool.master import LocalMaster, free_port

ROOT = helpers.ROOT
SMALL = ["--config.workload.chat.users=3", "--config.workload.chat.turns=2",
         "--config.workload.chat.system_prompt_tokens=40",
         "--config.workload.chat.user_tokens=(8, 30)",
         "--config.workload.chat.max_new_tokens=4", *helpers.SERVE_SHAPES]
KEY = bytes(range(40, 80))


@pytest.fixture(scope="module")
def master(tmp_path_factory):
  with LocalMaster(log_path=str(tmp_path_factory.mktemp("pool") / "master.log"),
                   lease_ms=60_000) as m:
    yield m


@pytest.fixture(scope="module")
def key_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("key") / "deployment.key"
  path.write_text(KEY.hex())
  path.chmod(0o600)
  return str(path)


def serve(tmp_path, name, *flags):
  out = tmp_path / f"{name}.json"
  proc = subprocess.run([sys.executable, "launch/serve.py", *SMALL, f"--json_out={out}",
                         "--nocompare", *flags], cwd=ROOT, env=helpers.child_env(),
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def lender(master):
  """A node that lends memory and serves no model (it outlives the serve runs' restarts)."""
  proc = helpers.start_process([sys.executable, "-m", "jaxkv.worker.tiers.pool.lend",
                                f"--pool={master.address}", f"--pool_metadata={master.metadata}",
                                "--segment_mb=64"], env=helpers.child_env())
  line = proc.stdout.readline()
  if not line.startswith("lending"):
    helpers.finish_process(proc, 5)
    pytest.fail(f"the lender did not mount its segment: {line!r}")
  yield proc
  proc.terminate()
  helpers.finish_process(proc, 30, "the lender")


def test_a_second_serve_run_hits_the_pool_the_first_filled_with_the_same_outputs(
    tmp_path, master, key_file, lender):
  """The runs lend nothing: what they put lives in the lender's segment, so it outlives
  them (a process's own segment, and the blocks in it, leave the pool with it)."""
  pool = [f"--pool={master.address}", f"--pool_metadata={master.metadata}",
          "--pool_segment_mb=0", "--config.tiers.write_policy=write_through",
          f"--deployment_key_file={key_file}", "--config.scheduler.decision=fetch"]
  plain = serve(tmp_path, "plain")
  first = serve(tmp_path, "first", *pool)
  second = serve(tmp_path, "second", *pool)
  assert first["output_digest"] == second["output_digest"] == plain["output_digest"]
  assert first["hits"]["pool"] == 0 and second["hits"]["pool"] > 0
  # The first turn of every user is a pool hit in the second run (its system prompt at least).
  assert second["hits"]["pool"] >= 3 * (40 // 16)


def master_count(master, name: str) -> float:
  """One of the Mooncake master's own counters (its metrics port): a count jaxkv did not keep."""
  text = httpx.get(f"http://127.0.0.1:{master.metrics_port}/metrics", timeout=10).text
  return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == name)


def server_counts(server) -> dict:
  """The server's block hits by tier and its computed tokens, from its /metrics."""
  text = httpx.get(server.base + "/metrics", timeout=30).text
  counts = {}
  for family in text_string_to_metric_families(text):
    for s in family.samples:
      if s.name == "jaxkv_block_hits_total":
        counts[s.labels["tier"]] = counts.get(s.labels["tier"], 0) + s.value
      elif s.name == "jaxkv_computed_tokens_total":
        counts["computed"] = counts.get("computed", 0) + s.value
  return counts


def test_two_servers_on_one_pool_the_second_answers_from_the_firsts_blocks(
    tmp_path, master, key_file):
  """b is asked only once a's blocks are in the pool (the master's own key count says so), so
  b's one answer must come from them: b's metrics show pool hits for every full block of the
  prompt, no device hits, and only the partial last block computed; its tokens are a's, which
  a computed with nothing cached."""
  flags = [f"--pool={master.address}", f"--pool_metadata={master.metadata}",
           "--pool_segment_mb=32", "--config.tiers.write_policy=write_through",
           f"--deployment_key_file={key_file}", "--config.cache.max_pages_per_seq=16",
           "--config.scheduler.decision=fetch"]  # hits fetched whatever the machine's load
  prompt = [(i * 13 + 5) % 250 + 1 for i in range(100)]
  full_blocks = len(prompt) // 16  # (page_size 16: the last 4 tokens are no full block)
  body = {"model": "llama-tiny-random", "prompt": prompt, "max_tokens": 5, "temperature": 0,
          "return_token_ids": True}
  with ServerProcess(flags, workdir=str(tmp_path)) as a, \
       ServerProcess(flags, workdir=str(tmp_path)) as b:
    a.wait_ready(600)
    b.wait_ready(600)
    keys_before = master_count(master, "master_key_count")
    first = httpx.post(f"{a.url}/completions", json=body, timeout=120).json()
    assert "usage" in first, first
    # a's blocks reach the pool behind the answer.
    helpers.wait_for(lambda: master_count(master, "master_key_count") >= keys_before + full_blocks,
                     60, f"a's {full_blocks} blocks in the pool", interval_s=0.2)
    assert server_counts(b).get("pool", 0) == 0
    second = httpx.post(f"{b.url}/completions", json=body, timeout=120).json()
    counts = server_counts(b)
  assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
  assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 16 * full_blocks, second
  assert counts.get("pool", 0) == full_blocks and counts.get("device", 0) == 0, counts
  assert counts["computed"] == len(prompt) - 16 * full_blocks, counts
  ids = first["choices"][0]["token_ids"]
  assert len(ids) == 5
  assert second["choices"][0]["token_ids"] == ids


def test_a_pool_nobody_answers_is_one_line_and_exit_2():
  port = free_port()
  code, out, err = helpers.run_script(["launch/serve.py", f"--pool=127.0.0.1:{port}",
                                       *SMALL], timeout_s=300)
  assert code == 2, err[-2000:]
  lines = [l for l in err.strip().splitlines() if "--pool" in l]
  assert lines and "no Mooncake master answers" in lines[-1], err[-2000:]
  assert "compiled" not in out
  code, _, err = helpers.run_script(["launch/serve.py", "--pool=nohost", *SMALL], timeout_s=300)
  assert code == 2 and "is not HOST:PORT" in err
