"""Small builders shared by tests."""

import os
import signal
import subprocess
import sys

import pytest
from flax import nnx

import jaxkv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(args, timeout_s=600):
  """A launch/ script as a user runs it: (exit status, stdout, stderr). Its process group is
  killed if it outlives ``timeout_s``."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # launchers set their own
  proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout_s)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, err = proc.communicate()
    pytest.fail(f"{args[0]} ran over {timeout_s} s; stderr ends:\n{err[-3000:]}")
  return proc.returncode, out, err


def tiny_model_config(**overrides) -> jaxkv.models.LlamaConfig:
  base = dict(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=8, mlp_dim=64)
  base.update(overrides)
  return jaxkv.models.LlamaConfig(**base)


def cache_config_for(mc: jaxkv.models.LlamaConfig, **overrides) -> jaxkv.CacheConfig:
  base = dict(model_name="test-llama", num_layers=mc.num_layers, num_kv_heads=mc.num_kv_heads,
              head_dim=mc.head_dim, page_size=4, pages_per_shard=64, max_pages_per_seq=32,
              attention_chunk_pages=4, dtype=mc.dtype)
  base.update(overrides)
  return jaxkv.CacheConfig(**base)


def make_engine(mesh, mc=None, *, seed=0, cache=None, tiers=None, scheduler=None, costs=None,
                stream=None, deployment_key=None, **engine_kw) -> jaxkv.Engine:
  """An engine over a tiny model. Lower-tier hits are always fetched unless a test asks
  for another scheduler policy (measured costs would make tier tests nondeterministic)."""
  mc = mc or tiny_model_config()
  cache = cache or cache_config_for(mc)
  model = jaxkv.models.Llama(mc, rngs=nnx.Rngs(seed))
  scheduler = scheduler or jaxkv.SchedulerConfig(policy="fetch")
  return jaxkv.Engine(model, jaxkv.KVCache(cache, mesh, tiers, deployment_key=deployment_key),
                      jaxkv.EngineConfig(**engine_kw),
                      scheduler=scheduler, costs=costs, stream=stream)


def reuse_and_fresh(mesh, **engine_kw):
  """Two engines over one tiny model and small pools: one reusing cached prefixes, one
  recomputing every prompt (the reference answers come from)."""
  mc = tiny_model_config()
  cc = cache_config_for(mc, pages_per_shard=24, max_pages_per_seq=16)
  return (make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, **engine_kw),
          make_engine(mesh, mc, cache=cc, max_seqs_per_shard=2, prefix_reuse=False))


def no_refs(engine, tiers=(jaxkv.Tier.DEVICE,)):
  """The index holds no reference in ``tiers`` (every pin and page was released) and its
  invariants hold."""
  index = engine.cache.index
  index.check_invariants()
  for tier in tiers:
    for s in range(engine.cache.num_shards if tier != jaxkv.Tier.DISK else 1):
      assert not index.held_slots(s, tier), (tier, s)


def forget_device_copies(engine):
  """Evicts every unreferenced device page, so the next lookup must come from lower tiers."""
  for s in range(engine.cache.num_shards):
    engine.cache.index.evict_all_unreferenced(s, jaxkv.Tier.DEVICE)
