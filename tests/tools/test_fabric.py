"""Real links on this machine (``jaxkv.tools.fabric``): nodes in network namespaces on one
bridge, each link shaped with tc; real TCP across them; nothing left behind, also by a run
killed with SIGKILL; and the fetch-or-recompute decision on such a link
(``jaxkv.tools.bench.fabric``): a lender serving a chat's first turns to an engine on another
node, the link fast and then slow. Needs root and iproute2 (CI runs as root): without them
these tests fail, naming what is missing."""

import os
import signal
import subprocess
import sys

import pytest

from jaxkv.errors import InputError
from jaxkv.tools import fabric
from jaxkv.tools.bench import fabric as fabric_bench
from jaxkv.tools.env import child_env

import helpers

ROOT = helpers.ROOT


def _mine() -> list[str]:
  """This process's fabric namespaces."""
  return [n for n in fabric.namespaces() if n.startswith(f"{fabric.PREFIX}{os.getpid()}")]


def _links() -> str:
  return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


def test_a_shaped_link_carries_real_tcp_at_its_rate_and_follows_a_retune():
  """Node ``a``'s link at 40 Mbit/s: TCP from ``b`` arrives at no more than the rate (and
  at some of it); retuned live to 400 it carries several times more. The caller's
  namespace gains no interface, a node has no route out of the fabric, and closing
  removes every namespace."""
  before = _links()
  with fabric.Fabric({"a": 40, "b": 10_000}) as f:
    assert len(_mine()) == 3  # a, b and the switch
    assert _links() == before
    routes = subprocess.run(["ip", "-n", f.node("a").netns, "route"], capture_output=True,
                            text=True, check=True).stdout
    assert "default" not in routes and routes.strip().startswith(f"{fabric.SUBNET}.0/24")
    slow = f.measure_mbit("b", "a")
    assert 10 < slow <= 40 * 1.1, slow
    f.set_rate("a", 400)
    fast = f.measure_mbit("b", "a")
    assert 3 * slow < fast <= 400 * 1.1, (slow, fast)
    sleeper = f.popen("a", ["sleep", "60"])
    assert f.kill("a") >= 1 and sleeper.wait(timeout=10) == -signal.SIGKILL
  assert _mine() == [] and _links() == before
  with pytest.raises(InputError, match="rate"):
    fabric.Fabric({"a": 0})


_KILLED = r"""
import sys
from jaxkv.tools import fabric
f = fabric.Fabric({"a": 100, "b": 100}, prefix=sys.argv[1])
f.popen("a", ["sleep", "300"])
print("READY", flush=True)
sys.stdin.readline()  # until the test kills it, or goes (its end of the pipe closes)
"""


def test_a_run_killed_with_sigkill_leaves_namespaces_the_next_fabric_removes():
  """SIGTERM: the fabric removes itself (and kills what it started). SIGKILL: nothing can,
  so its namespaces stay, named after the dead process; the next fabric removes them, and
  the processes left in them, before it builds its own."""
  for sig in (signal.SIGTERM, signal.SIGKILL):
    child = subprocess.Popen([sys.executable, "-c", _KILLED, "jxt"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, cwd=ROOT,
                             env=child_env(device_count=1), start_new_session=True)
    try:
      assert child.stdout.readline().strip() == "READY"
      theirs = [n for n in fabric.namespaces() if n.startswith(f"jxt{child.pid}")]
      assert len(theirs) == 3, theirs
      os.kill(child.pid, sig)
      child.wait(timeout=30)
    finally:
      if child.poll() is None:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
      child.stdin.close()
    left = [n for n in fabric.namespaces() if n.startswith(f"jxt{child.pid}")]
    if sig == signal.SIGTERM:
      assert left == []
      continue
    assert sorted(left) == sorted(theirs)
    with fabric.Fabric({"c": 100}, prefix="jxt") as f:
      assert sorted(f.removed_stale) == sorted(theirs)
    assert [n for n in fabric.namespaces() if n.startswith("jxt")] == []


def test_without_root_the_fabric_says_so_in_one_line():
  """A process that is not root gets ``FabricUnavailable`` (an ``InputError``: the launch
  scripts print it and exit 2) naming its uid and the fix."""
  code = ("import os; from jaxkv.tools import fabric\n"
          "os.setgid(65534); os.setuid(65534)\n"
          "try:\n  fabric.check_available()\nexcept fabric.FabricUnavailable as e:\n"
          "  print(type(e).__mro__[1].__name__, e)\n")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, env=child_env(device_count=1), timeout=60)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.startswith("InputError the fabric needs root") and "uid 65534" in out.stdout
  assert len(out.stdout.strip().splitlines()) == 1


def test_the_plan_fetches_over_a_fast_link_and_stops_over_a_slow_one():
  """A lender serves a chat's first turns to an engine on another node, its link at 5
  and then at 3200 Mbit/s. At each rate the plan's first request tries the link (fetches
  every cached block) and times it; then the plan learns a link over 10x faster at 3200
  than at 5 (under 100 Mbit/s there), stops fetching most of the prefix over the slow one,
  and fetches more of it over the fast one. Its answers are those of always recomputing,
  and nothing compiles after warm-up. (How much it fetches depends on how busy the
  machine's CPU is, which prices the recompute and the pull: at 25 Mbit/s a block takes
  10 ms to cross, what a loaded CI machine took to recompute one, and the plan rightly
  fetched 11 of 16 there. At 5 Mbit/s a block takes 52 ms: over 5x a loaded recompute's.)"""
  result = fabric_bench.run(reps=2, rates=[5.0, 3200.0], prefix=256, adapt=False,
                            policies=("recompute", "cost"))
  assert result["fabric_outputs_equal"] is True
  slow, fast = result["points"]
  blocks = result["prefix_tokens"] // fabric_bench.PAGE
  for point in (slow, fast):
    assert point["outputs_equal"] is True and point["compiles_after_warmup"] == 0, point
    assert point["measured_mbit"] <= point["mbit"] * 1.1
    assert point["per_request_fetched"][0] == blocks, point  # the try
  assert 0 < slow["plan_link_mbit_learned"] < 100, slow
  assert fast["plan_link_mbit_learned"] > 10 * slow["plan_link_mbit_learned"], (slow, fast)
  priced = slow["per_request_fetched"][1], fast["per_request_fetched"][1]
  assert priced[0] < blocks // 2 and priced[1] > priced[0], priced


def test_adaptation_counts_the_requests_until_the_plan_is_on_the_faster_policys_side():
  """The turn after each rate change is counted towards the fixed policy that measured
  faster at the new rate: a plan that keeps recomputing after a speed-up turned at once
  where recomputing was still faster (a store slower than the prefill at every rate), and
  never where fetching was."""
  def phase(*fetched):
    return {"mbit": 0, "requests": [{"blocks_fetched": f} for f in fetched]}
  phases = [phase(8, 8), phase(8, 8, 0, 0), phase(0, 0, 0, 0)]
  usual = fabric_bench._adaptation(phases, 8)  # pylint: disable=protected-access
  assert (usual["fabric_adapt_requests_after_slowdown"],
          usual["fabric_adapt_requests_after_speedup"], usual["fabric_adapt_requests"]) == (
              3, None, 5)
  slow_store = fabric_bench._adaptation(phases, 8, ("recompute", "recompute"))  # pylint: disable=protected-access
  assert (slow_store["fabric_adapt_requests_after_speedup"],
          slow_store["fabric_adapt_requests"]) == (1, 3)
  assert slow_store["fabric_adapt_targets"] == {"after_slowdown": "recompute",
                                                "after_speedup": "recompute"}
  turning = [phase(8), phase(8, 3), phase(0, 2, 4, 8)]
  got = fabric_bench._adaptation(turning, 8)  # pylint: disable=protected-access
  assert (got["fabric_adapt_requests_after_slowdown"],
          got["fabric_adapt_requests_after_speedup"]) == (2, 3)


def test_the_faster_fixed_policy_is_read_from_the_sweeps_slowest_and_fastest_rates():
  row = lambda f, r: {"fetch": {"ttft_s": [f, f, 9.0]}, "recompute": {"ttft_s": [r, r, 0.0]}}  # noqa: E731
  rows = [row(0.5, 0.2), row(0.3, 0.3), row(0.1, 0.2)]
  assert fabric_bench._better(rows, ("fetch", "recompute", "cost")) == ("recompute", "fetch")  # pylint: disable=protected-access
  assert fabric_bench._better(rows[:1], ("fetch", "recompute", "cost")) == (  # pylint: disable=protected-access
      "recompute", "recompute")
  assert fabric_bench._better(rows, ("cost",)) == ("recompute", "fetch")  # pylint: disable=protected-access
