"""Streamed attention: hot pages on device + cold pages streamed from host memory equal
attention over every page at once."""

import functools
import types

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxkv
from jaxkv.worker import pages as pages_lib
from jaxkv.manager.index import Tier
from jaxkv.ops import paged_attention_reference, write_pages_reference


def cfg(hkv, page, chunk, impl="jnp"):
  return jaxkv.CacheConfig(model_name="m", num_layers=1, num_kv_heads=hkv, head_dim=8,
                           page_size=page, pages_per_shard=24, max_pages_per_seq=24,
                           attention_chunk_pages=chunk, attention_impl=impl)


@pytest.mark.parametrize("impl", ["jnp", "pallas_gpu"])  # hot pages on either path
@pytest.mark.parametrize("hq,hkv,page,attn_chunk,stream_chunk,q_len", [
    (4, 2, 4, 4, 3, 1),  # GQA, stream chunk does not divide the cold length
    (2, 2, 8, 2, 2, 3),  # MHA, several queries (a prefill chunk)
    (8, 2, 4, 8, 5, 1),
])
def test_streamed_equals_all_pages_at_once(mesh, impl, hq, hkv, page, attn_chunk, stream_chunk,
                                           q_len):
  c = cfg(hkv, page, attn_chunk, impl)
  rng = np.random.default_rng(hq * 7 + page)
  shards, rows_per_shard, host_pages = 4, 1, 16
  b = shards * rows_per_shard
  sink, window = 2, 3
  # Ragged: full and partial last blocks, 2 to 11 cold pages per row.
  lens = ((sink + window + np.array([4, 2, 7, 11])) * page - np.array([0, 3, 1, page - 1]))
  lens = lens.astype(np.int32)
  n_blocks = -(-lens // page)
  width = 24
  # The whole sequence, block by block: [rows, blocks, kv_heads, page, head_dim].
  k_all = rng.standard_normal((b, width, hkv, page, 8)).astype(np.float32)
  v_all = rng.standard_normal((b, width, hkv, page, 8)).astype(np.float32)
  q = rng.standard_normal((b, q_len, hq, 8)).astype(np.float32)
  positions = (lens[:, None] - q_len + np.arange(q_len)[None]).astype(np.int32)
  k_new = rng.standard_normal((b, q_len, hkv, 8)).astype(np.float32)
  v_new = rng.standard_normal((b, q_len, hkv, 8)).astype(np.float32)

  # Reference: every block in one device pool (global ids), all entries valid.
  full_k = np.zeros((hkv, shards * 24, page, 8), np.float32)
  full_v = np.zeros_like(full_k)
  full_table = np.zeros((b, width), np.int32)
  # Streamed: sinks + window on device, the rest in a host pool, per shard.
  dev_k = np.zeros_like(full_k)
  dev_v = np.zeros_like(full_k)
  table = np.zeros((b, width), np.int32)
  valid = np.zeros((b, width), bool)
  host = np.zeros((2, hkv, shards * host_pages, page, 8), np.float32)
  cold_width = -(-host_pages // stream_chunk) * stream_chunk
  slots = np.zeros((b, cold_width), np.int32)
  first = np.full((b,), sink, np.int32)
  count = np.zeros((b,), np.int32)
  for r in range(b):
    s = r // rows_per_shard
    pages = rng.permutation(24)
    hslots = rng.permutation(host_pages)
    n = n_blocks[r]
    for j in range(n):
      full_table[r, j] = s * 24 + pages[j]
      full_k[:, s * 24 + pages[j]] = k_all[r, j].transpose(0, 1, 2)
      full_v[:, s * 24 + pages[j]] = v_all[r, j]
      if j < sink or j >= n - window:
        table[r, j] = pages[j]
        valid[r, j] = True
        dev_k[:, s * 24 + pages[j]] = k_all[r, j]
        dev_v[:, s * 24 + pages[j]] = v_all[r, j]
      else:
        i = j - sink
        slots[r, i] = hslots[i]
        host[0, :, s * host_pages + hslots[i]] = k_all[r, j]
        host[1, :, s * host_pages + hslots[i]] = v_all[r, j]
        count[r] += 1
  want_k = write_pages_reference(full_k, k_new, full_table, positions)
  want_v = write_pages_reference(full_v, v_new, full_table, positions)
  want = np.asarray(paged_attention_reference(q, want_k, want_v, full_table, positions, lens))

  rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data", *([None] * (x.ndim - 1)))))
  # The host tier's page-major layout [slots, arrays, kv_heads, page, head_dim].
  paged = NamedSharding(mesh, pages_lib.host_spec(c)).with_memory_kind("pinned_host")
  host_bits = jax.device_put(np.ascontiguousarray(np.moveaxis(host.view(np.uint32), 2, 0)),
                             paged)
  stream = types.SimpleNamespace(block_valid=rows(valid), host_pool=host_bits,
                                 cold_slots=rows(slots), cold_first=rows(first),
                                 cold_count=rows(count), pages_per_chunk=stream_chunk,
                                 k_index=0, v_index=1)
  fn = jax.jit(functools.partial(pages_lib.write_and_attend, mesh=mesh, config=c, stream=stream))
  out, kp, _ = fn(rows(q), rows(k_new), rows(v_new),
                  jax.device_put(dev_k, pages_lib.pool_sharding(mesh, c)),
                  jax.device_put(dev_v, pages_lib.pool_sharding(mesh, c)), rows(table),
                  rows(positions), rows(lens))
  np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=2e-5)
  assert count.sum() > 0 and (count > 0).all()  # every row really streamed something


# ---- the engine: contexts several times the device budget ------------------------------------
import helpers  # noqa: E402
from numpy_llama import NumpyLlama  # noqa: E402


def stream_engine(mesh, host_pages=64, source="host", disk_dir=None, impl="jnp"):
  """An engine whose device holds 12 pages a shard and streams the rest of a sequence."""
  mc = helpers.tiny_model_config()
  small = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12,
                                   attention_impl=impl)
  tiers = jaxkv.TierConfig(host_pages_per_shard=host_pages,
                           disk_kvstore=disk_dir, disk_pages=256 if disk_dir else 0)
  return helpers.make_engine(mesh, mc, cache=small, prefill_chunk_pages=2, tiers=tiers,
                             stream=jaxkv.StreamConfig(sink_pages=1, window_pages=4,
                                                       chunk_pages=3, source=source))


# 3.3x and 4.4x the 12-page device budget, plus a short prompt served normally.
_RNG = np.random.default_rng(1)
LONG_PROMPTS = [_RNG.integers(1, 128, 150).tolist(), [5, 6, 7, 8, 9],
                _RNG.integers(1, 128, 205).tolist()]


@pytest.fixture(scope="module")
def all_on_device(mesh):
  """The long prompts' tokens and logits with every page on device (96 a shard), by the
  jnp path: what each streamed engine, whatever its source or kernel, must give."""
  mc = helpers.tiny_model_config()
  big = helpers.cache_config_for(mc, pages_per_shard=96, max_pages_per_seq=96)
  everything = helpers.make_engine(mesh, mc, cache=big, prefill_chunk_pages=2)
  return everything.generate(LONG_PROMPTS, 8, return_logits=True)


@pytest.mark.parametrize("source,impl", [("host", "jnp"), ("disk", "jnp"), ("host", "pallas_gpu")])
def test_long_context_streams_to_the_same_tokens_as_all_on_device(mesh, tmp_path, all_on_device,
                                                                  source, impl):
  engine = stream_engine(mesh, source=source, impl=impl,
                         disk_dir=str(tmp_path / "d") if source == "disk" else None)
  prompts = LONG_PROMPTS
  got, got_logits = engine.generate(prompts, 8, return_logits=True)
  want, want_logits = all_on_device
  assert got == want
  for a, b in zip(got_logits, want_logits):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)
  s = engine.stats()
  assert s["streamed_requests"] == 2 and s["streamed_pages"] > 2 * 24
  if source == "disk":  # every step read its cold pages back from disk records
    assert s["stream_disk_reads"] > 8 * s["streamed_pages"]
    assert not engine.cache.index.held_slots(0, Tier.DISK)
    assert engine.cache.index.num_cached(0, Tier.DISK) == 0  # no stray records published
  engine.cache.index.check_invariants()
  for sh in range(4):  # every device page and host slot a stream held is back
    assert not engine.cache.index.held_slots(sh, Tier.DEVICE)
    assert not engine.cache.index.held_slots(sh, Tier.HOST)
  # The same long request again compiles nothing new: staging shapes are fixed per bucket.
  # Its log-probabilities come from the logits that chose each token, on the host.
  before = dict(engine.trace_counts)
  handle = engine.submit(prompts[0], jaxkv.SamplingParams(max_new_tokens=8, logprobs=2))
  assert handle.result() == want[0]
  assert dict(engine.trace_counts) == before
  # The reference: a NumPy forward of the model's weights (shares no code with jaxkv).
  lsm = NumpyLlama(engine.model).log_softmax(prompts[0] + want[0][:-1])[len(prompts[0]) - 1:]
  for i, (lp, top) in enumerate(handle.logprobs):
    assert abs(lp - lsm[i, want[0][i]]) < 1e-4 and len(top) == 2
    assert top[0][0] == want[0][i] and abs(top[0][1] - lsm[i].max()) < 1e-4
  with pytest.raises(jaxkv.InputError, match="prompt_logprobs need every prompt token"):
    engine.submit(prompts[0], jaxkv.SamplingParams(max_new_tokens=2, prompt_logprobs=1))


def test_a_request_no_tier_can_hold_is_refused_before_any_work(mesh):
  engine = stream_engine(mesh, host_pages=16)
  engine.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9]], 2)
  digest = engine.cache.index.digest()
  with pytest.raises(jaxkv.CapacityError, match="prompt 1 needs 35 pages in host memory"):
    engine.generate([[3] * 60, [7] * 157], 4)  # the first would stream; the second cannot
  assert engine.cache.index.digest() == digest  # nothing else was touched
  engine.stream = None
  with pytest.raises(ValueError, match="StreamConfig"):
    engine.generate([[7] * 157], 4)


def test_stream_config_is_validated(mesh):
  with pytest.raises(ValueError, match="window_pages=0"):
    jaxkv.StreamConfig(window_pages=0)
  mc = helpers.tiny_model_config()
  with pytest.raises(ValueError, match="needs a host tier"):
    helpers.make_engine(mesh, mc, cache=helpers.cache_config_for(mc),
                        stream=jaxkv.StreamConfig())


def test_a_streamed_sequence_keeps_the_cached_blocks_its_pages_evict(mesh):
  """The device pages a streamed sequence takes held other requests' cached blocks: they
  are copied down to host slots the manager chose (write-back, as a step's evictions are),
  not lost, so the same prompts hit afterwards."""
  engine = stream_engine(mesh)
  rng = np.random.default_rng(7)
  short = [rng.integers(1, 128, 41).tolist() for _ in range(4)]  # 10 full blocks each
  first = engine.generate(short, 2)
  cached = {sh: engine.cache.index.num_cached(sh, Tier.DEVICE) for sh in range(4)}
  assert sum(cached.values()) >= 4 * 10 and engine.stats()["demoted_host"] == 0
  engine.generate([LONG_PROMPTS[0]], 2)  # 7 of a shard's 12 pages: cached blocks evicted
  assert engine.stats()["streamed_requests"] == 1
  demoted = engine.stats()["demoted_host"]
  assert demoted > 0  # before: the stream's allocation dropped what it evicted
  hits_before = engine.stats()["hits"]["host"]
  again = engine.generate(short, 2)
  assert again == first
  # Every block the stream demoted is served again from its host slot (shards the stream
  # did not touch still hold theirs on device).
  assert engine.stats()["hits"]["host"] - hits_before >= demoted
  engine.cache.index.check_invariants()
