"""Suite ``remote``: blocks pulled from another job against the physical path and recompute.

A serving job (a subprocess with 4 CPU devices) computes a long prefix and serves it with
``BlockServer``. In this job, interleaved:
- ``remote_fetch``: a ``RemoteClient`` fetches the prefix's blocks (one ZeroMQ round trip:
  the owner's gather, the blocks inline in the answer, CRC-32C on both sides) — against
  ``tcp``: the same number of bytes sent over a plain loopback TCP socket
  (``remote_vs_tcp``, a throughput ratio);
- ``remote_hit``: TTFT of a request on that prefix in a fresh engine that pulls it,
  against ``recompute``: the same request in a fresh engine without the peer
  (``remote_hit_speedup = recompute TTFT / remote-hit TTFT``);
- ``keyed_cost_remote``: the same fetch from a second serving job that has a deployment key
  (answers tagged over header and blocks, AES-GCM/GMAC on both sides) over the keyless
  fetch (CRC-32C on both sides), and ``keyed_cost_remote_encrypted``: the blocks sealed
  (AES-256-GCM) as well. Same bytes (checked), same run, interleaved, medians.
"""

from __future__ import annotations

import secrets
import statistics
import subprocess
import sys
import time

import numpy as np
from flax import nnx

from jaxkv import models
from jaxkv.tools.bench import common
from jaxkv.cache import KVCache
from jaxkv.config import CacheConfig, EngineConfig, SchedulerConfig, TierConfig
from jaxkv.serving.engine import Engine
from jaxkv.manager.index import chain_keys, tenant_root_key
from jaxkv.tools.env import child_env
from jaxkv.worker.pages import make_mesh
from jaxkv.worker.tiers.remote import RemoteClient

_OWNER = r"""
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
from jaxkv.tools.bench import remote
engine = remote.build_engine(data=2, model=2, peers=())
engine.generate([remote.prompt(int(sys.argv[1]))], 1)
from jaxkv.worker.tiers.remote import BlockServer
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
                scheduler=SchedulerConfig(decision="fetch"))


def _start_owner(tokens: int, key: bytes | None) -> tuple[subprocess.Popen, str]:
  """A serving job (keyed when ``key`` is given) and its block server's address."""
  env = child_env(device_count=4, drop=("JAX_PLATFORMS", "JAXKV_DEPLOYMENT_KEY",
                                       "JAXKV_DEPLOYMENT_KEY_FILE"))
  if key is not None:
    env["JAXKV_DEPLOYMENT_KEY"] = key.hex()
  owner = subprocess.Popen([sys.executable, "-c", _OWNER, str(tokens), "3600"],
                           stdout=subprocess.PIPE, text=True, env=env)
  line = owner.stdout.readline()
  if not line.startswith("ADDRESS"):
    owner.kill()
    owner.wait()
    raise RuntimeError(f"the serving job did not start: {line!r}")
  return owner, line.split()[1]


def run(*, quick: bool = False, reps: int = 5) -> dict:
  import jax
  tokens = 1024 if quick else 2048
  key = secrets.token_bytes(32)
  owners = []
  try:
    owner, addr = _start_owner(tokens, None)
    owners.append(owner)
    keyed_owner, keyed_addr = _start_owner(tokens, key)
    owners.append(keyed_owner)
    devices = jax.devices()
    data, model = (4, 2) if len(devices) >= 8 else (len(devices), 1)
    mk = lambda peers: build_engine(data=data, model=model, peers=peers,
                                    devices=devices[:data * model])
    p = prompt(tokens)
    request = p + [3, 5, 7, 11]
    probe = mk((addr,))
    probe.warmup(max_seq_len=len(request) + 8)
    keys = probe.cache.index.block_keys(p, "default")
    client = probe.cache.worker.remotes[0]
    nbytes = len(keys) * probe.cache.config.page_bytes
    fetch = lambda: client.fetch(keys, probe.cache.payload_shape, probe.cache.config.jnp_dtype,
                                 time.monotonic() + 60)
    wire = common.interleaved({"remote_fetch": fetch, "tcp": lambda: common.loopback_tcp_seconds(nbytes)},
                              reps=reps)
    fp = probe.cache.config.fingerprint()
    keyed = RemoteClient(keyed_addr, fp, secret=key, deadline_s=60)
    sealed = RemoteClient(keyed_addr, fp, secret=key, encrypt=True, deadline_s=60)
    # Under a key a tenant's block keys are keyed too: the same blocks, other names.
    keyed_keys = chain_keys(tenant_root_key(fp, "default", key), p, probe.cache.config.page_size)
    fetch_from = lambda c: lambda: c.fetch(keyed_keys if c.encrypt or c is keyed else keys,
                                           probe.cache.payload_shape,
                                           probe.cache.config.jnp_dtype, time.monotonic() + 60)
    same = [fetch_from(c)().tobytes() for c in (client, keyed, sealed)]
    if not same[0] == same[1] == same[2]:
      raise RuntimeError("the keyed serving job sent other bytes than the keyless one")
    cost = common.interleaved({"keyless": fetch_from(client), "keyed": fetch_from(keyed),
                               "encrypted": fetch_from(sealed)}, reps=max(20, 4 * reps))
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
        "keyed_cost_remote": cost["keyed"]["median_s"] / cost["keyless"]["median_s"],
        "keyed_cost_remote_encrypted": (cost["encrypted"]["median_s"]
                                        / cost["keyless"]["median_s"]),
        "remote_fetch_keyless": common.throughput(nbytes, cost["keyless"]),
        "remote_fetch_keyed": common.throughput(nbytes, cost["keyed"]),
        "remote_fetch_encrypted": common.throughput(nbytes, cost["encrypted"]),
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
    for owner in owners:
      owner.kill()
      owner.wait()
