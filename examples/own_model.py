"""Your own Flax NNX model on jaxkv: one attention layer holds a jaxkv.nnx.PagedKV.

  python examples/own_model.py

A deliberately small decoder written here, not imported from jaxkv.models, served by
jaxkv.Engine with prefix reuse; the second call reuses the first call's prompt blocks.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):  # 8 CPU devices
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import jaxkv  # noqa: E402


class TinyDecoder(nnx.Module):
  """Embedding -> one attention layer (keys and values in jaxkv pages) -> logits."""

  def __init__(self, vocab: int, dim: int, heads: int, kv_heads: int, head_dim: int, *,
               rngs: nnx.Rngs):
    self.vocab_size = vocab
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.q = nnx.Linear(dim, heads * head_dim, rngs=rngs)
    self.k = nnx.Linear(dim, kv_heads * head_dim, rngs=rngs)
    self.v = nnx.Linear(dim, kv_heads * head_dim, rngs=rngs)
    self.out = nnx.Linear(heads * head_dim, vocab, rngs=rngs)
    self.kv = jaxkv.nnx.PagedKV(num_kv_heads=kv_heads, head_dim=head_dim)

  def __call__(self, tokens, batch: jaxkv.nnx.PageBatch):
    b, t = tokens.shape
    x = self.embed(tokens)
    q = self.q(x).reshape(b, t, self.heads, self.head_dim)
    k = self.k(x).reshape(b, t, self.kv_heads, self.head_dim)
    v = self.v(x).reshape(b, t, self.kv_heads, self.head_dim)
    # Positions come with the batch (no RoPE here, to keep the example short).
    attended = self.kv(q, k, v, batch)  # writes k, v into pages, attends over all of them
    return self.out(attended.reshape(b, t, -1)).astype(jnp.float32)


def main() -> list:
  model = TinyDecoder(vocab=100, dim=32, heads=4, kv_heads=2, head_dim=8, rngs=nnx.Rngs(0))
  # The cache's shapes come from the model's PagedKV layers (1 layer, 2 kv heads of 8).
  cache = jaxkv.KVCache(
      jaxkv.CacheConfig.for_model(model, model_name="tiny-decoder", page_size=4,
                                  pages_per_shard=32, max_pages_per_seq=16),
      jaxkv.make_mesh(data=4, model=2))
  engine = jaxkv.Engine(model, cache)
  prompt = [5, 17, 42, 8, 99, 3, 61, 7, 20, 11]
  first = engine.generate([prompt], max_new_tokens=5)
  again = engine.generate([prompt], max_new_tokens=5)
  stats = engine.stats()
  print("tokens:", first[0], "| reused blocks:", stats["hits"]["device"],
        "| devices:", len(jax.devices()))
  assert first == again and stats["hits"]["device"] == 2
  return first


if __name__ == "__main__":
  main()
