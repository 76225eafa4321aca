"""A process that lends a segment to a pool and puts the blocks of the prompts it is given
(the test's other node): ``python tests/pool_lender.py MASTER METADATA PROMPTS_JSON``.
It prints ``READY <blocks put>`` once every put was tried, then waits to be killed."""

import json
import os
import sys
import time

# The test's own XLA flags (its optimization level gives the same weights, so the same
# fingerprint), with its 8 devices.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))

import jaxkv  # noqa: E402
import helpers  # noqa: E402


def main():
  master, metadata, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
  mesh = jaxkv.make_mesh(data=4, model=2)
  tiers = jaxkv.TierConfig(pool_master=master, pool_metadata=metadata, pool_segment_mb=16,
                           write_policy="write_through")
  engine = helpers.make_engine(mesh, tiers=tiers)
  engine.generate(prompts, 3)
  engine.cache.worker.pool.settle(60)
  print("READY", engine.stats()["pool_puts"], flush=True)
  while True:
    time.sleep(60)


if __name__ == "__main__":
  main()
