"""Suite ``remote``: blocks pulled from another job against the physical path and recompute.

A serving job (a subprocess with 4 CPU devices) computes a long prefix and serves it with
``BlockServer``. In this job, interleaved:
- ``remote_fetch``: a ``RemoteClient`` fetches the prefix's blocks (one ZeroMQ round trip:
  the owner's gather, the blocks inline in the answer, CRC-32C on both sides) — against
  ``tcp``: the same number of bytes sent over a plain loopback TCP socket
  (``remote_vs_tcp``, a throughput ratio);
- ``remote_hit``: TTFT of a request on that prefix in a fresh engine that pulls it,
  against ``recompute``: the same request in a fresh engine without the peer
  (``remote_hit_speedup = recompute TTFT / remote-hit TTFT``).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np
from flax import nnx

from jaxkv import models
from jaxkv.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig, TierConfig
from jaxkv.engine import Engine
from jaxkv.pages import make_mesh

_OWNER = r"""
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
from jaxkv.bench import remote
engine = remote.build_engine(data=2, model=2, peers=())
engine.generate([remote.prompt(int(sys.argv[1]))], 1)
from jaxkv.tiers.remote import BlockServer
server = BlockServer(engine.cache)
print("ADDRESS", server.address, flush=True)
server.serve(float(sys.argv[2]))
"""

MODEL = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2,
             head_dim=32, mlp_dim=512)


def prompt(tokens: int) -> list[int]:
  return np.random.default_rng(7).integers(1, 512, tokens).tolist()


def build_engine(*, data: int, model: int, peers: tuple, devices=None) -> Engine:
  mesh = make_mesh(data=data, model=model, devices=devices)
  cache = CacheConfig(model_name="bench-llama", num_layers=4, num_kv_heads=2, head_dim=32,
                      page_size=16, pages_per_shard=160, max_pages_per_seq=160)
  return Engine(models.Llama(models.LlamaConfig(**MODEL), rngs=nnx.Rngs(0)),
                KVCache(cache, mesh, TierConfig(remote_peers=peers, read_deadline_s=30.0)),
                EngineConfig(max_seqs_per_shard=1, prefill_chunk_pages=4),
                scheduler=SchedulerConfig(policy="fetch"))


def _tcp_send(nbytes: int) -> float:
  """Seconds to push ``nbytes`` through a loopback TCP connection, received in full."""
  data = bytes(nbytes)
  srv = socket.socket()
  srv.bind(("127.0.0.1", 0))
  srv.listen(1)
  got = []

  def receive():
    conn, _ = srv.accept()
    n = 0
    while n < nbytes:
      chunk = conn.recv(1 << 20)
      if not chunk:
        break
      n += len(chunk)
    got.append(n)
    conn.close()

  t = threading.Thread(target=receive)
  t.start()
  t0 = time.perf_counter()
  with socket.create_connection(srv.getsockname()) as c:
    c.sendall(data)
  t.join()
  srv.close()
  assert got == [nbytes]
  return time.perf_counter() - t0


def run(*, quick: bool = False, reps: int = 5) -> dict:
  import jax
  tokens = 1024 if quick else 2048
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tokens), "3600"],
                           stdout=subprocess.PIPE, text=True, env=env)
  try:
    line = owner.stdout.readline()
    if not line.startswith("ADDRESS"):
      raise RuntimeError(f"the serving job did not start: {line!r}")
    addr = line.split()[1]
    devices = jax.devices()
    data, model = (4, 2) if len(devices) >= 8 else (len(devices), 1)
    mk = lambda peers: build_engine(data=data, model=model, peers=peers,
                                    devices=devices[:data * model])
    p = prompt(tokens)
    request = p + [3, 5, 7, 11]
    probe = mk((addr,))
    probe.warmup(max_seq_len=len(request) + 8)
    keys = probe.cache.index.block_keys(p, "default")
    client = probe.cache.remotes[0]
    nbytes = len(keys) * probe.cache.config.page_bytes
    fetch = lambda: client.fetch(keys, probe.cache.payload_shape, probe.cache.config.jnp_dtype,
                                 time.monotonic() + 60)
    wire = common.interleaved({"remote_fetch": fetch, "tcp": lambda: _tcp_send(nbytes)},
                              reps=reps)
    ttft = {"remote_hit": [], "recompute": []}
    outputs = {}
    for rep in range(reps + 1):
      for name, peers in (("remote_hit", (addr,)), ("recompute", ())):
        e = mk(peers)
        outputs[name] = e.generate([request], 4)
        if rep:  # the first round compiles
          ttft[name].append(e.stats()["ttft_s"][0])
        if name == "remote_hit":
          assert e.stats()["hits"]["remote"] == len(keys), e.stats()["hits"]
    hit, rec = statistics.median(ttft["remote_hit"]), statistics.median(ttft["recompute"])
    return {
        "remote_vs_tcp": common.ratio(wire["remote_fetch"], wire["tcp"]),
        "remote_hit_speedup": rec / hit,
        "remote_fetch": common.throughput(nbytes, wire["remote_fetch"]),
        "tcp": common.throughput(nbytes, wire["tcp"]),
        "ttft_remote_hit_s": hit, "ttft_recompute_s": rec,
        "prefix_tokens": tokens, "blocks": len(keys), "bytes": nbytes,
        "outputs_identical": outputs["remote_hit"] == outputs["recompute"],
        "serving_job": "a separate process, 4 CPU devices, loopback",
    }
  finally:
    owner.kill()
    owner.wait()
