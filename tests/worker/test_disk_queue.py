"""A disk store that cannot keep up (``TierConfig.disk_queue_mb``, ``jaxkv.worker.journal``):
the S3 server on a node of a real fabric (``jaxkv.tools.fabric``) behind a 20 Mbit/s link,
written through faster than that link carries. The writes in flight stay within their
bound, the rest are dropped and counted, answers stay exact, and what was written drains,
is published and reads back. Needs root and iproute2, like tests/tools/test_fabric.py."""

import os
import select
import subprocess
import sys

import boto3
import pytest
from botocore.config import Config

import jaxkv
from jaxkv import Tier
from jaxkv.tools import fabric
from jaxkv.tools.bench.s3server import CREDENTIALS

import helpers

S3_PORT = 9000
LINK_MBIT = 20
QUEUE_MB = 1

# A TCP relay from the caller's namespace into the fabric (which adds nothing to the
# caller's namespace, so nothing there reaches a node): it runs in node "gw" and makes its
# listening socket in the caller's namespace (a socket stays in the namespace it was made
# in), then connects from "gw" to the server on node "s3", across that node's shaped link.
_RELAY = r"""
import ctypes, os, socket, sys, threading
libc = ctypes.CDLL(None, use_errno=True)
def enter(fd):
  if libc.setns(fd, 0x40000000):  # CLONE_NEWNET
    raise OSError(ctypes.get_errno(), "setns")
home = os.open("/proc/self/ns/net", os.O_RDONLY)
enter(os.open(f"/proc/{sys.argv[1]}/ns/net", os.O_RDONLY))
listener = socket.create_server(("127.0.0.1", 0))
enter(home)
print(listener.getsockname()[1], flush=True)
def pipe(src, dst):
  try:
    while data := src.recv(1 << 16):
      dst.sendall(data)
  except OSError:
    pass
  for s in (src, dst):
    try:
      s.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
def serve(client):
  try:
    upstream = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=10)
  except OSError:
    client.close()
    return
  upstream.settimeout(None)
  threading.Thread(target=pipe, args=(client, upstream), daemon=True).start()
  pipe(upstream, client)
while True:
  c, _ = listener.accept()
  threading.Thread(target=serve, args=(c,), daemon=True).start()
"""


@pytest.fixture
def slow_s3(tmp_path, monkeypatch):
  """A kvstore spec of a bucket on an S3 server behind a ``LINK_MBIT`` link."""
  for k, v in CREDENTIALS.items():
    monkeypatch.setenv(k, v)
  for var, name in (("AWS_CONFIG_FILE", "config"), ("AWS_SHARED_CREDENTIALS_FILE", "credentials")):
    (tmp_path / name).write_text("")  # empty: TensorStore's AWS library logs each one missing
    monkeypatch.setenv(var, str(tmp_path / name))
  with fabric.Fabric({"s3": LINK_MBIT, "gw": 10_000}) as f:
    address = f.node("s3").address
    f.popen("s3", [sys.executable, "-m", "moto.server", "-H", address, "-p", str(S3_PORT)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    relay = f.popen("gw", [sys.executable, "-c", _RELAY, str(os.getpid()), address,
                           str(S3_PORT)], stdout=subprocess.PIPE, text=True)
    if not select.select([relay.stdout], [], [], 30)[0]:
      pytest.fail("the relay into the fabric did not start within 30 s")
    line = relay.stdout.readline()
    assert line.strip().isdigit(), f"the relay into the fabric failed: {line!r}"
    endpoint = f"http://127.0.0.1:{int(line)}"
    client = _client(endpoint)

    def bucket_made():
      try:
        client.create_bucket(Bucket="slow")
        return True
      except Exception:  # pylint: disable=broad-except  (the server is still starting)
        return False

    helpers.wait_for(bucket_made, 30, "the S3 server on the fabric answers", interval_s=0.2)
    yield {"driver": "s3", "bucket": "slow", "endpoint": endpoint, "aws_region": "us-east-1",
           "path": "kv/"}


def _client(endpoint: str):
  return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                      config=Config(connect_timeout=2, read_timeout=5,
                                    retries={"max_attempts": 1}))


def test_a_store_slower_than_the_evictions_drops_writes_past_the_bound(mesh, slow_s3):
  """Four prompts of 10 blocks, one per data shard, prefilled a block a step and written
  through: 4 blocks of 64 KiB a step, while the 1 MiB bound holds 16 and the link carries
  about 38 a second (measured: the same run on an unshaped link dropped none)."""
  mc = helpers.tiny_model_config(num_layers=4, head_dim=64)
  cc = helpers.cache_config_for(mc, page_size=16, pages_per_shard=24, max_pages_per_seq=12)
  tiers = jaxkv.TierConfig(disk_kvstore=slow_s3, disk_pages=256, disk_queue_mb=QUEUE_MB,
                           write_policy="write_through")
  kw = dict(max_seqs_per_shard=1, prefill_chunk_pages=1)
  engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, **kw)
  fresh = helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=False, **kw)
  page = cc.page_size
  bound = QUEUE_MB << 20
  assert engine.cache.config.page_bytes == 64 << 10
  journal = engine.cache.worker.mover.journal
  assert journal.queue_bytes == bound
  prompts = [[1 + (7 * i + j) % 127 for j in range(10 * page + 3)] for i in range(4)]
  want = fresh.generate(prompts, 2)
  handles = [engine.submit(p, 2) for p in prompts]
  peak = most_a_step = 0
  counters = engine.cache.stats.counters
  for _ in range(200):  # far more steps than 11 chunks and a token take
    if all(h.finished for h in handles):
      break
    before = counters["disk_writes"] + counters["disk_writes_dropped"]
    engine.step()
    most_a_step = max(most_a_step,
                      counters["disk_writes"] + counters["disk_writes_dropped"] - before)
    peak = max(peak, journal.bytes_in_flight)
    assert journal.bytes_in_flight <= bound  # never more held than the bound
  assert all(h.finished for h in handles)
  assert [h.result() for h in handles] == want
  s = engine.stats()
  # Drops, though no step asked for more than the bound: earlier writes were still on the link.
  assert s["disk_writes_dropped"] > 0 and peak > 0, (s["disk_writes_dropped"], peak)
  assert 0 < most_a_step * cc.page_bytes < bound, most_a_step
  # Dropped writes gave their slots back; the rest drain and are published.
  assert engine.flush(30) == 0
  index = engine.cache.index
  index.check_invariants()
  assert not index.held_slots(0, Tier.DISK)
  written = s["disk_writes"]
  assert written > 0 and engine.stats()["demoted_disk"] == written
  keys = [index.block_keys(p, "default") for p in prompts]
  on_disk = [[index.slot_of(0, k, Tier.DISK) is not None for k in row] for row in keys]
  published = [k for row, disk_row in zip(keys, on_disk) for k, d in zip(row, disk_row) if d]
  assert len(published) == index.num_cached(0, Tier.DISK) == written
  disk = engine.cache.worker.disk
  assert all(disk.kv.read(disk.name(k)).result(timeout=30).state == "value" for k in published)
  # And read back through the cache: a prompt's leading published blocks are fetched (the
  # first one missing ends what its lookup finds), verified, and the answers stay exact.
  leading = sum(next((i for i, d in enumerate(row) if not d), len(row)) for row in on_disk)
  assert leading > 0
  helpers.forget_device_copies(engine)
  engine.reset_stats()
  assert engine.generate(prompts, 2) == want
  s = engine.stats()
  assert s["hits"]["disk"] == s["blocks_fetched"] == leading and s["verify_failures"] == 0
  assert engine.flush(30) == 0


def test_disk_queue_mb_is_checked():
  with pytest.raises(ValueError, match=r"disk_queue_mb=0 .*disk_kvstore=None"):
    jaxkv.TierConfig(disk_queue_mb=0)
  with pytest.raises(ValueError, match=r"disk_queue_mb=1.5"):
    jaxkv.TierConfig(disk_queue_mb=1.5)
