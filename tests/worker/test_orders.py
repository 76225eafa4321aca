"""A plan's copies down as the worker carries them out: issued before the step that reuses
their pages, and the bytes below the host waited for only after that step is dispatched.

Real parts: a tiny engine whose device pool is small enough that every turn evicts, a disk
tier in a temporary directory and no host tier (so every evicted block is a disk write).
The journal's write is wrapped (fault injection around the real one) to note when it runs.
"""

import numpy as np

import helpers
import jaxkv


def test_evicted_blocks_are_written_to_disk_after_the_evicting_step_is_dispatched(
    mesh, tmp_path):
  mc = helpers.tiny_model_config()
  cc = helpers.cache_config_for(mc, pages_per_shard=12, max_pages_per_seq=12)
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "disk"), disk_pages=256)
  engine = helpers.make_engine(mesh, mc, cache=cc, tiers=tiers, max_seqs_per_shard=1)
  fresh = helpers.make_engine(mesh, mc, cache=cc, prefix_reuse=False, max_seqs_per_shard=1)
  worker = engine.cache.worker
  mover, journal = worker.mover, worker.mover.journal
  steps = lambda: engine.stats()["prefill_steps"] + engine.stats()["decode_steps"]  # noqa: E731
  seen = []  # (steps dispatched when the orders were issued, when their disk write ran)
  issued = []
  real_carry_out, real_write = mover.carry_out, journal.write

  def carry_out(pools, orders, **kw):
    issued.append(steps())
    return real_carry_out(pools, orders, **kw)

  def write(stack, per, n, slots):
    if slots:
      seen.append((issued[-1], steps()))
    return real_write(stack, per, n, slots)

  mover.carry_out, journal.write = carry_out, write
  rng = np.random.default_rng(5)
  prompts = [rng.integers(1, 128, 30).tolist() for _ in range(8)]  # 7 full blocks each
  got = [engine.generate([p], 3)[0] for p in prompts]  # each evicts what came before
  assert got == fresh.generate(prompts, 3)
  assert engine.flush(30) == 0
  assert seen and engine.stats()["demoted_disk"] > 0
  # Each write ran once the step that took the evicted pages had been dispatched.
  assert all(after > before for before, after in seen), seen
  # What was written is what a hit reads back, exactly.
  again = engine.generate(prompts[:2], 3)
  assert again == got[:2] and engine.stats()["hits"]["disk"] > 0
  helpers.no_refs(engine, tiers=(jaxkv.Tier.DEVICE, jaxkv.Tier.DISK))
