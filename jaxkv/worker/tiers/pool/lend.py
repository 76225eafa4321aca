"""Lends this machine's memory to a pool without serving a model:

    python -m jaxkv.worker.tiers.pool.lend --pool=HOST:PORT [--pool_metadata=URL] --segment_mb=N

A node with idle memory (or a process that outlives the servers' restarts) mounts a segment
of N MiB; the master places other nodes' blocks there until this process ends (SIGTERM or
SIGINT unmounts it; its blocks leave the pool with it). Prints ``lending N MiB`` when mounted.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from jaxkv.errors import InputError
from jaxkv.worker.tiers.pool import native
from jaxkv.worker.tiers.pool.tier import check_reachable, local_address, metadata_url


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--pool", required=True, help="HOST:PORT of the Mooncake master")
  parser.add_argument("--pool_metadata", default=None, help="its HTTP metadata server's URL")
  parser.add_argument("--segment_mb", type=int, default=1024, help="MiB lent")
  parser.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
  args = parser.parse_args(argv)
  try:
    if args.segment_mb < 1:
      raise InputError(f"--segment_mb={args.segment_mb} must be at least 1.")
    check_reachable(args.pool, args.pool_metadata)
    store = native.load_store()
    client = store.MooncakeDistributedStore()
    rc = client.setup(local_address(args.pool), metadata_url(args.pool, args.pool_metadata),
                      args.segment_mb << 20, 16 << 20, args.protocol, "", args.pool)
    if rc != 0:
      raise InputError(f"--pool={args.pool}: mounting {args.segment_mb} MiB failed "
                       f"(Mooncake setup returned {rc}).")
  except InputError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  print(f"lending {args.segment_mb} MiB to {args.pool}", flush=True)
  while not stop.wait(3600):
    pass
  client.close()
  return 0


if __name__ == "__main__":
  sys.exit(main())
