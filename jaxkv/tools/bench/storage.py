"""Storage many processes share: an object store, and writers racing on one store.

- ``object_store_read_vs_raw``: the disk tier on an S3 bucket (an S3-compatible server on
  loopback, ``s3server.LocalS3``) reading N blocks, verified, against a plain boto3 client
  getting the same objects from the same server with a thread pool (what a user writes).
- ``lost_blocks``: two writer processes write blocks into one store at once (each its own
  blocks, plus blocks both write, as two servers computing the same prompt do) while this
  process opens and scans the store again and again; then a full verify counts the blocks
  the writers committed that are not there, or not intact. Run on a local directory and on
  the S3 bucket.

  python launch/bench.py --suite=storage --json_out=/tmp/storage.json
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import subprocess
import sys
import tempfile
import time

import ml_dtypes
import numpy as np

from jaxkv.tools.bench import common
from jaxkv.tools.bench.s3server import LocalS3
from jaxkv.tools.env import child_env
from jaxkv.worker.tiers.disk import DiskTier

FINGERPRINT = hashlib.sha256(b"jaxkv storage bench").digest()
DTYPE = "bfloat16"


def _key(writer: str, i: int) -> bytes:
  return hashlib.sha256(f"{writer}/{i}".encode()).digest()


def _payload(key: bytes, shape) -> np.ndarray:
  """Bytes that depend on the key only: both writers of a shared block write the same."""
  rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
  return rng.standard_normal(shape).astype(np.float32).astype(ml_dtypes.bfloat16)


def _tier(spec, slots: int, shape) -> DiskTier:
  return DiskTier(spec, num_slots=slots, payload_shape=shape, dtype=DTYPE,
                  fingerprint=FINGERPRINT)


def writer_main(spec_json: str, writer: str, n: int, shared: int, shape_json: str) -> None:
  """One writer process: ``n`` blocks of its own and ``shared`` blocks every writer writes;
  prints what committed as JSON."""
  shape = tuple(json.loads(shape_json))
  keys = [_key(writer, i) for i in range(n)] + [_key("shared", i) for i in range(shared)]
  tier = _tier(json.loads(spec_json), len(keys), shape)
  writes = [(k, tier.write(k, _payload(k, shape), None)) for k in keys]
  committed, failed = [], 0
  for k, w in writes:
    try:
      w.result(timeout=300)
      committed.append(k.hex())
    except Exception:  # pylint: disable=broad-except  (counted)
      failed += 1
  tier.sync()
  print(json.dumps({"committed": committed, "failed": failed}), flush=True)


def lost_blocks(spec, *, n: int = 64, shared: int = 16, shape=(8, 2, 16, 32),
                writers: int = 2) -> dict:
  """Writers racing on one store, this process opening it meanwhile; then a full verify."""
  env = child_env(JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen(
      [sys.executable, "-m", "jaxkv.tools.bench.storage", "writer", json.dumps(spec), f"w{i}", str(n),
       str(shared), json.dumps(list(shape))], stdout=subprocess.PIPE, text=True, env=env)
      for i in range(writers)]
  opens = errors = deleted = 0
  while any(p.poll() is None for p in procs):  # open and verify while they write
    try:
      deleted += _tier(spec, writers * n + shared, shape).scan()[1]
      opens += 1
    except Exception:  # pylint: disable=broad-except  (what this measures)
      errors += 1
  results = []
  for p in procs:
    out, _ = p.communicate(timeout=300)
    if p.returncode != 0:
      raise RuntimeError(f"a writer process failed (exit {p.returncode})")
    results.append(json.loads(out.strip().splitlines()[-1]))
  committed = {k for r in results for k in r["committed"]}
  good, bad = _tier(spec, 10 * len(committed) + 1, shape).scan()
  present = {key.hex() for _, key, _ in good}
  return {"writers": writers, "blocks_per_writer": n + shared, "shared_blocks": shared,
          "committed": len(committed), "write_failures": sum(r["failed"] for r in results),
          "verified": len(present & committed), "lost_blocks": len(committed - present),
          "bad_records": bad, "opens_while_writing": opens, "open_errors": errors,
          "deleted_while_writing": deleted}


def object_store_read(s3: LocalS3, *, n: int, shape, reps: int, threads: int = 16) -> dict:
  spec = s3.kvstore("jaxkv-bench", "read/")
  tier = _tier(spec, n, shape)
  keys = [_key("read", i) for i in range(n)]
  for w in [tier.write(k, _payload(k, shape), None) for k in keys]:
    w.result(timeout=300)
  client = s3.client(max_connections=threads)
  names = ["read/records/" + tier.name(k) for k in keys]
  pool = concurrent.futures.ThreadPoolExecutor(threads)

  def jaxkv_read():
    tier.read_verified(keys, time.monotonic() + 300)

  def raw_get():
    list(pool.map(lambda name: client.get_object(Bucket="jaxkv-bench", Key=name)["Body"].read(),
                  names))

  res = common.interleaved({"jaxkv_read": jaxkv_read, "client_get": raw_get}, reps=reps)
  pool.shutdown()
  nbytes = n * tier.record_bytes
  return {"object_store_read_vs_raw": common.ratio(res["jaxkv_read"], res["client_get"]),
          "object_store": {k: common.throughput(nbytes, v) for k, v in res.items()},
          "object_store_blocks": n, "object_store_record_bytes": tier.record_bytes,
          "client_threads": threads}


def run(*, quick: bool = False, reps: int = 5) -> dict:
  shape = (8, 2, 16, 32) if quick else (32, 8, 16, 128)  # 16 KiB or 1 MiB per block
  n = 16 if quick else 64
  out = {}
  with LocalS3() as s3:
    out.update(object_store_read(s3, n=n, shape=shape, reps=reps))
    s3_race = lost_blocks(s3.kvstore("jaxkv-race"), n=n, shared=n // 4, shape=shape)
  with tempfile.TemporaryDirectory(prefix="jaxkv-storage-") as d:
    file_race = lost_blocks(d, n=n, shared=n // 4, shape=shape)
  out["lost_blocks"] = file_race["lost_blocks"] + s3_race["lost_blocks"]
  out["shared_store"] = {"file": file_race, "s3": s3_race}
  out["notes"] = ("object store: moto's server on loopback (Python, one process): both "
                  "candidates are limited by it; jaxkv verifies each record's header and "
                  "CRC-32C, the client only reads the bytes")
  return out


if __name__ == "__main__":
  if len(sys.argv) == 7 and sys.argv[1] == "writer":
    writer_main(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
  else:
    sys.exit("usage: python -m jaxkv.tools.bench.storage writer SPEC_JSON NAME N SHARED SHAPE_JSON")
