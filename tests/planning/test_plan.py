"""The jitted plan (``jaxkv.planning.plan``) against a brute-force search, the cost model's learning
(``jaxkv.planning.costs``) and the capacity planner (``jaxkv.tools.capacity``)."""

import math

import jax
import numpy as np
import pytest

from jaxkv.tools.capacity import capacity_plan, choose_window, stream_step_s
from jaxkv.planning.costs import LINKS, CostModel, LinkCost, PrefillCurve
from jaxkv.planning.plan import (ABSENT, DECISIONS, DISK, HOST, HOT, POOL, REMOTE, SHARD, PlanInputs,
                        build_inputs, plan)
from plan_oracle import brute_force, first_pass


def cost_model(rng) -> CostModel:
  links = {name: LinkCost(float(rng.uniform(0, 2e-3)), float(10 ** rng.uniform(7, 10)))
           for name in LINKS}
  curve = PrefillCurve(float(rng.uniform(0, 5e-3)), float(10 ** rng.uniform(-6, -3)),
                       float(10 ** rng.uniform(-10, -7)))
  o = float(rng.uniform())  # full overlap, none, or some
  return CostModel(links=links, prefill=curve, overlap=1.0 if o < 0.3 else 0.0 if o < 0.5 else o)


def random_inputs(rng, r, d, m, page_size=16, chunk_tokens=0, tail_widths=()):
  tiers = np.full((r, d, m), ABSENT, np.int32)
  hot = np.zeros((r, d), np.int32)
  end = np.zeros((r, d), np.int32)
  for i in range(r):
    for j in range(d):
      e = int(rng.integers(0, m + 1))
      h = int(rng.integers(0, e + 1))
      tiers[i, j, :h] = HOT
      tiers[i, j, h:e] = rng.choice([HOST, DISK, REMOTE, SHARD, POOL, ABSENT],
                                    size=e - h, p=[0.2, 0.2, 0.16, 0.16, 0.16, 0.12])
      hot[i, j], end[i, j] = h, e
  return PlanInputs(
      tiers=tiers, block_bytes=rng.uniform(1e5, 4e6, (r, d, m)).astype(np.float32), hot=hot,
      cached_end=end, tail_tokens=rng.integers(0, 200, r).astype(np.int32),
      free_pages=rng.integers(0, m + 4, d).astype(np.int32),
      inflight_blocks=rng.integers(1, m + 4, d).astype(np.int32),
      link_group=rng.integers(0, 2, d).astype(np.int32), valid=np.ones(r, bool),
      page_size=page_size, chunk_tokens=chunk_tokens, tail_widths=tail_widths)


@pytest.mark.parametrize("seed", range(12))
def test_plan_equals_brute_force_and_is_never_worse_than_either_pure_decision(seed):
  rng = np.random.default_rng(seed)
  costs = cost_model(rng)
  chunk, widths = ((0, ()), (16, ()), (48, ()), (128, (32, 64)))[seed % 4]
  inputs = random_inputs(rng, r=6, d=3, m=12, chunk_tokens=chunk, tail_widths=widths)
  out = jax.tree.map(np.asarray, plan(inputs, costs.arrays()))
  # The link sharing and the compute charged for the other requests, found from the
  # requests and shards by the oracle's own first pass (not read from the plan): the plan
  # must have found the same, and given them every split must be the brute-force optimum.
  link_users, others = first_pass(inputs, costs)
  np.testing.assert_array_equal(out.link_users, np.array(link_users, np.float32))
  np.testing.assert_allclose(out.others_s, np.array(others), rtol=2e-5, atol=1e-9)
  best = out.best_shard
  for i in range(6):
    for j in range(3):
      share = link_users[j]
      budget = int(min(inputs.inflight_blocks[j], inputs.free_pages[j]))
      s, t = brute_force(inputs.tiers[i, j], inputs.block_bytes[i, j], int(inputs.hot[i, j]),
                         int(inputs.cached_end[i, j]), int(inputs.tail_tokens[i]), budget,
                         share, costs, inputs.page_size, inputs.chunk_tokens,
                         others=others[i][j], tail_widths=inputs.tail_widths)
      assert math.isclose(out.t_pred_s[i, j], t, rel_tol=2e-5, abs_tol=1e-9), (i, j)
      # Equal cost at the chosen split (the argmin may differ only between exact ties).
      assert inputs.hot[i, j] <= out.split[i, j] <= inputs.cached_end[i, j]
      assert out.t_pred_s[i, j] <= out.t_recompute_all_s[i, j] * (1 + 1e-6) + 1e-9
      assert out.t_pred_s[i, j] <= out.t_fetch_all_s[i, j] * (1 + 1e-6) + 1e-9
      absent = [b for b in range(inputs.hot[i, j], inputs.cached_end[i, j])
                if inputs.tiers[i, j, b] == ABSENT]
      assert not absent or out.split[i, j] > max(absent)  # a block cached nowhere: recomputed
      # Capacity: never more blocks in flight than the shard allows.
      assert out.fetch_blocks[i, j].sum() == inputs.cached_end[i, j] - out.split[i, j] <= budget
      # The decision label agrees with the split point.
      h, e, sp = inputs.hot[i, j], inputs.cached_end[i, j], out.split[i, j]
      label = DECISIONS[out.decision[i, j]]
      assert label == ("recompute" if sp == e else "fetch" if sp == h else "split")
    assert out.t_pred_s[i, best[i]] == out.t_pred_s[i].min()


def test_linear_costs_give_the_closed_form_split():
  # 10 GB over 64 GB/s vs 20k tokens at 40 ms per 1k tokens: the example from the design brief.
  costs = CostModel(links={"host_to_device": LinkCost(0.0, 64e9)},
                    prefill=PrefillCurve(0.0, 40e-3 / 1000, 0.0))
  m, page = 1250, 16  # 20k tokens
  inputs = PlanInputs(
      tiers=np.full((1, 1, m), HOST, np.int32),
      block_bytes=np.full((1, 1, m), 10e9 / m, np.float32), hot=np.zeros((1, 1), np.int32),
      cached_end=np.full((1, 1), m, np.int32), tail_tokens=np.zeros(1, np.int32),
      free_pages=np.full(1, m, np.int32), inflight_blocks=np.full(1, m, np.int32),
      link_group=np.zeros(1, np.int32), valid=np.ones(1, bool), page_size=page)
  out = jax.tree.map(np.asarray, plan(inputs, costs.arrays()))
  t_f, t_r = 10e9 / 64e9, 20000 * 40e-6
  assert math.isclose(out.t_fetch_all_s[0, 0], t_f, rel_tol=1e-4)
  assert math.isclose(out.t_recompute_all_s[0, 0], t_r, rel_tol=1e-4)
  assert math.isclose(out.t_pred_s[0, 0], t_f * t_r / (t_f + t_r), rel_tol=2e-3)
  assert DECISIONS[out.decision[0, 0]] == "split"


def test_a_split_whose_halves_do_not_overlap_is_not_chosen_and_overlap_is_learned(tmp_path):
  """The closed-form example with recompute and fetch in series (overlap 0): a split costs
  the sum of its halves, so the plan fetches everything (0.16 s against 0.8 s of
  recompute). ``observe_split`` learns the overlap from what a split took beyond its longer
  half, clipped to [0, 1]; it round-trips through JSON and is validated."""
  m = 1250
  inputs = PlanInputs(
      tiers=np.full((1, 1, m), HOST, np.int32),
      block_bytes=np.full((1, 1, m), 10e9 / m, np.float32), hot=np.zeros((1, 1), np.int32),
      cached_end=np.full((1, 1), m, np.int32), tail_tokens=np.zeros(1, np.int32),
      free_pages=np.full(1, m, np.int32), inflight_blocks=np.full(1, m, np.int32),
      link_group=np.zeros(1, np.int32), valid=np.ones(1, bool), page_size=16)
  link, curve = {"host_to_device": LinkCost(0.0, 64e9)}, PrefillCurve(0.0, 40e-6, 0.0)
  chosen = lambda overlap: jax.tree.map(np.asarray, plan(inputs, CostModel(
      links=dict(link), prefill=curve, overlap=overlap).arrays()))
  serial, half, most = chosen(0.0), chosen(0.5), chosen(0.9)
  assert DECISIONS[serial.decision[0, 0]] == "fetch"
  assert math.isclose(serial.t_pred_s[0, 0], 10e9 / 64e9, rel_tol=1e-4)
  # Half hidden: a block moved from the fetch to the recompute saves 125 us of fetch and
  # adds half its 640 us of recompute: still fetch everything. Nine tenths hidden: it adds
  # 64 us, so a split pays, by less than with full overlap (0.1307 s, the closed form).
  assert DECISIONS[half.decision[0, 0]] == "fetch"
  assert DECISIONS[most.decision[0, 0]] == "split"
  assert 0.1307 * 1.05 < most.t_pred_s[0, 0] < 10e9 / 64e9
  parts = (most.t_recompute_s[0, 0], most.t_fetch_s[0, 0], most.t_tail_s[0, 0])
  assert math.isclose(most.t_pred_s[0, 0], max(parts[:2]) + 0.1 * min(parts[:2]) + parts[2],
                      rel_tol=1e-4)
  model = CostModel(links=dict(link), prefill=curve)
  assert model.overlap == 1.0
  for _ in range(20):  # 10 ms of recompute beside 30 ms of fetch took 35 ms: half hidden
    model.observe_split(0.010, 0.030, 0.035)
  assert model.overlap == pytest.approx(0.5, abs=1e-4)
  model.observe_split(0.010, 0.030, 0.020)  # faster than either half: full overlap seen
  assert model.overlap == pytest.approx(0.75, abs=1e-4)
  for _ in range(20):
    model.observe_split(0.010, 0.030, 0.100)  # slower than both in series: none seen
  assert model.overlap == pytest.approx(0.0, abs=1e-4)
  model.save(str(tmp_path / "costs.json"))
  assert CostModel.load(str(tmp_path / "costs.json")).overlap == model.overlap
  with pytest.raises(ValueError, match="overlap=1.5 must be in"):
    CostModel(links={}, prefill=curve, overlap=1.5)


def test_plan_compiles_once_per_bucket():
  rng = np.random.default_rng(0)
  costs = cost_model(rng).arrays()
  plan._clear_cache()
  for _ in range(4):
    plan(random_inputs(rng, r=8, d=4, m=16), costs)
  assert plan._cache_size() == 1


def test_cost_model_learns_and_round_trips(tmp_path):
  model = CostModel(links={"host_to_device": LinkCost(1e-4, 1e9)},
                    prefill=PrefillCurve(1e-3, 1e-5, 1e-9))
  for _ in range(40):
    model.observe_transfer("host_to_device", 1e8, 1e-4 + 0.05)  # the link is really 2 GB/s
    model.observe_prefill(1000, 0, 2 * model.prefill.seconds(1000, 0) / 2 * 3)
  assert model.links["host_to_device"].bytes_per_s == pytest.approx(2e9, rel=0.01)
  path = str(tmp_path / "costs.json")
  model.save(path)
  again = CostModel.load(path)
  assert again.links == model.links and again.prefill == model.prefill
  samples = [(n, c, 2e-3 + 3e-6 * n + 4e-10 * n * (c + (n - 1) / 2))
             for n in (16, 64, 256, 1024) for c in (0, 512, 4096)]
  fit = PrefillCurve.fit(samples)
  assert fit.t0_s == pytest.approx(2e-3, rel=1e-3)
  assert fit.per_token_context_s == pytest.approx(4e-10, rel=1e-3)
  with pytest.raises(ValueError, match="cannot read a CostModel"):
    CostModel.load(str(tmp_path / "missing.json"))
  with pytest.raises(ValueError, match="not among"):
    CostModel(links={"pcie": LinkCost(0, 1)}, prefill=fit)


def _remote_request(blocks: int, block_bytes: float) -> PlanInputs:
  """One request whose whole prefix is on a remote peer, on one shard with room."""
  return PlanInputs(
      tiers=np.full((1, 1, blocks), REMOTE, np.int32),
      block_bytes=np.full((1, 1, blocks), block_bytes, np.float32),
      hot=np.zeros((1, 1), np.int32), cached_end=np.full((1, 1), blocks, np.int32),
      tail_tokens=np.full((1,), 16, np.int32), free_pages=np.full((1,), 4 * blocks, np.int32),
      inflight_blocks=np.full((1,), 4 * blocks, np.int32), link_group=np.zeros((1,), np.int32),
      valid=np.ones((1,), bool), page_size=16)


def test_an_untried_link_is_tried_then_priced_as_measured_and_a_slowdown_turns_the_plan():
  """A remote link never used, on a machine without a host tier, is tried (the plan
  fetches) instead of looking unusable forever; one slow transfer observed prices it as
  measured (the plan recomputes). A link that was fast and slows down 64x turns the plan
  after two observed transfers, and back after two more (averaging bytes per second at
  0.2 took ~20 one way)."""
  inputs = _remote_request(64, 32768.0)  # 2 MiB of prefix, ~50 ms to prefill here
  curve = PrefillCurve(1e-3, 5e-5, 1e-10)
  def fetched(model):  # blocks the plan fetches over the remote link (of 64)
    out = plan(inputs, model.arrays())
    return int(np.asarray(out.fetch_blocks)[0, 0, REMOTE])

  untried = CostModel(links={}, prefill=curve)
  assert fetched(untried) == 64
  untried.observe_transfer("remote_to_host", 2 << 20, 2.0)  # 1 MB/s: 2 s for the prefix
  assert fetched(untried) <= 2  # (a split may fetch what arrives while the front computes)
  fast = CostModel(links={"remote_to_host": LinkCost(1e-4, 4e8)}, prefill=curve)
  assert fetched(fast) >= 48  # 5 ms against ~55 ms (a split may recompute a few)
  for _ in range(2):  # two transfers at the new speed
    fast.observe_transfer("remote_to_host", 2 << 20, 1e-4 + (2 << 20) / (4e8 / 64))
  assert fetched(fast) < 32, fast.links
  for _ in range(2):  # and back: two transfers at the old speed
    fast.observe_transfer("remote_to_host", 2 << 20, 1e-4 + (2 << 20) / 4e8)
  assert fetched(fast) >= 48, fast.links


def test_streaming_cost_and_window_choice():
  costs = CostModel(links={"host_to_device": LinkCost(0.0, 1e9)},
                    prefill=PrefillCurve(0.0, 1e-6, 0.0))
  # 100 cold pages of 1 MB over 1 GB/s: 0.1 s against 0.03 s of compute.
  assert stream_step_s(costs, cold_pages=100, page_bytes=1e6, compute_s=0.03) == (
      pytest.approx(0.1))
  assert stream_step_s(costs, cold_pages=100, page_bytes=1e6, compute_s=0.03,
                       overlap=0.0) == pytest.approx(0.13)
  # 120 device pages can keep at most 119 in the window: 80 pages still stream (0.08 s).
  pick = choose_window(costs, context_pages=200, device_pages=120, sink_pages=1,
                       page_bytes=1e6, compute_s=0.03)
  assert pick["window_pages"] == 119 and pick["step_s"] == pytest.approx(0.08)
  assert pick["options"][1] == pytest.approx(0.198)
  # With room for 180 pages the transfer is hidden once at most 30 pages stream: the
  # smallest window that gets there is chosen (the rest of the pool stays free).
  pick = choose_window(costs, context_pages=200, device_pages=180, sink_pages=1,
                       page_bytes=1e6, compute_s=0.03)
  assert pick["window_pages"] == 169 and pick["step_s"] == pytest.approx(0.03)


def test_requests_in_one_step_share_the_device_that_recomputes_them():
  # A latency-bound link (20 ms, then fast) against 256 tokens of recompute (10 ms alone).
  costs = CostModel(links={"host_to_device": LinkCost(0.02, 1e12)},
                    prefill=PrefillCurve(0.0, 4e-5, 0.0))
  m, page = 16, 16

  def plan_for(r):
    inputs = PlanInputs(
        tiers=np.full((r, 1, m), HOST, np.int32),
        block_bytes=np.full((r, 1, m), 1e6, np.float32), hot=np.zeros((r, 1), np.int32),
        cached_end=np.full((r, 1), m, np.int32), tail_tokens=np.zeros(r, np.int32),
        free_pages=np.full(1, m, np.int32), inflight_blocks=np.full(1, m, np.int32),
        link_group=np.zeros(1, np.int32), valid=np.ones(r, bool), page_size=page)
    return jax.tree.map(np.asarray, plan(inputs, costs.arrays()))

  alone, crowd = plan_for(1), plan_for(4)
  t_alone = 256 * 4e-5
  assert DECISIONS[alone.decision[0, 0]] == "recompute"
  assert math.isclose(alone.t_recompute_all_s[0, 0], t_alone, rel_tol=1e-5)
  # Four at once: each request's recompute waits for the other three's (4 x 10 ms), more
  # than the 20 ms fetch; before compute was shared, each saw 10 ms and recomputed.
  for i in range(4):
    assert math.isclose(crowd.others_s[i, 0, 0], 3 * t_alone, rel_tol=1e-5)
    assert math.isclose(crowd.t_recompute_all_s[i, 0], 4 * t_alone, rel_tol=1e-5)
    assert DECISIONS[crowd.decision[i, 0]] == "fetch"


def test_capacity_plan_charges_every_request_to_one_device():
  costs = CostModel(links={"host_to_device": LinkCost(0.0, 25e9)},
                    prefill=PrefillCurve(0.0, 20e-3 / 1000, 0.0))
  r = capacity_plan(kv_bytes=4e9, tokens=32768, costs=costs, requests=4)
  assert math.isclose(r["t_recompute_s"], 32768 * 20e-6, rel_tol=1e-3)  # 655 ms, not 164


def test_placed_requests_share_compute_only_with_their_own_device():
  costs = CostModel(links={"host_to_device": LinkCost(0.02, 1e12)},
                    prefill=PrefillCurve(0.0, 4e-5, 0.0))
  from jaxkv.manager.index import Tier
  reqs = [([[Tier.HOST] * 16], 300)] * 3
  for devices, shared in (([0, 1, 2], 0.0), ([1, 1, 1], 2 * 16 * 16 * 4e-5)):
    inputs = build_inputs(reqs, num_shards=1, page_size=16, page_bytes=1e6,
                          devices=devices)
    out = jax.tree.map(np.asarray, plan(inputs, costs.arrays()))
    for i in range(3):  # alone on its device: recompute (10 ms) beats the 20 ms fetch
      assert math.isclose(out.others_s[i, 0, 0], shared, rel_tol=1e-4, abs_tol=1e-9)
      want = "recompute" if not shared else "fetch"
      assert DECISIONS[out.decision[i, 0]] == want, (devices, i)


def test_a_noisy_calibration_never_reports_an_infinite_link():
  from jaxkv.planning import calibration
  link = calibration._line([(1e6, 0.004), (8e6, 0.003)])  # the larger copy measured faster
  assert link.bytes_per_s == pytest.approx(8e6 / 0.003) and link.latency_s == 0.0
  link = calibration._line([(1e6, 0.002), (8e6, 0.009)])
  assert link.bytes_per_s == pytest.approx(1e9) and link.latency_s == pytest.approx(0.001)
