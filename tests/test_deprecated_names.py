"""The names "policy" once had (issue #50): each meaning has its own name now, and every old
spelling a user may have still works with a deprecation warning naming the new one.

- ``SchedulerConfig.decision`` (the fetch-or-recompute decision): ``SchedulerConfig(policy=)``,
  ``.policy``, ``SCHEDULER_POLICIES``, a config's ``scheduler.policy`` key and
  ``--config.scheduler.policy=`` on an old command line;
- ``RouterConfig.routing``: ``RouterConfig(policy=)``, ``.policy``, ``router.POLICIES``,
  ``launch/router.py --policy``;
- the serve run's cache: ``build_engine(policy=)``, ``builder.POLICIES``,
  ``launch/serve.py --policy``, the JSON key ``policy`` beside ``cache``.

The new spellings warn about nothing. jaxkv's own code using an old spelling is an error
under the tests (pyproject.toml's filterwarnings), checked here against each message.
"""

import os
import re
import subprocess
import sys
import tomllib
import warnings

import pytest
from absl import flags
from ml_collections import config_flags

import helpers
from jaxkv import config as config_lib
from jaxkv import metrics
from jaxkv.entrypoints.openai import router
from jaxkv.errors import InputError
from jaxkv.tools import builder

sys.path.insert(0, os.path.join(helpers.ROOT, "launch"))
import device_check  # noqa: E402  (launch/ is not a package)

ROOT = helpers.ROOT


def no_warning(fn, *args, **kwargs):
  """``fn(*args, **kwargs)`` where any warning fails the test."""
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    return fn(*args, **kwargs)


def test_scheduler_config_policy_is_decision():
  new = no_warning(config_lib.SchedulerConfig, decision="split", force_split=2)
  assert no_warning(lambda: new.decision) == "split"
  with pytest.warns(DeprecationWarning, match=r"SchedulerConfig\(policy=\) is deprecated: "
                    r"it is SchedulerConfig\(decision=\)"):
    old = config_lib.SchedulerConfig(policy="split", force_split=2)
  assert old == new
  with pytest.warns(DeprecationWarning, match=r"SchedulerConfig\.policy is deprecated: it is "
                    r"SchedulerConfig\.decision"):
    assert new.policy == "split"
  assert [f.name for f in config_lib.dataclasses.fields(new)][0] == "decision"
  with pytest.raises(InputError, match="give decision only"):
    config_lib.SchedulerConfig(policy="fetch", decision="recompute")
  with pytest.raises(InputError, match=r"SchedulerConfig\.decision='lru' must be one of"):
    config_lib.SchedulerConfig(decision="lru")
  assert config_lib.SCHEDULER_POLICIES == config_lib.SCHEDULER_DECISIONS


def test_router_config_policy_is_routing():
  new = no_warning(router.RouterConfig, routing="round_robin")
  assert no_warning(lambda: new.routing) == "round_robin"
  with pytest.warns(DeprecationWarning, match=r"RouterConfig\(policy=\) is deprecated: it is "
                    r"RouterConfig\(routing=\)"):
    old = router.RouterConfig(policy="round_robin")
  assert old == new
  with pytest.warns(DeprecationWarning, match=r"RouterConfig\.policy is deprecated"):
    assert new.policy == "round_robin"
  with pytest.raises(InputError, match="--routing=round_robin"):
    no_warning(router.RouterConfig)  # prefix routing without an indexer
  assert router.POLICIES == router.ROUTINGS == ("prefix", "round_robin")


def default_config(*overrides):
  """configs/default.py as ``launch/serve.py --config.X=Y ...`` parses it (its own flag
  values, not the process's; config_flags reads ``sys.argv`` where it defines the flag)."""
  argv = ["serve.py", *overrides]
  values, saved = flags.FlagValues(), sys.argv
  sys.argv = argv
  try:
    config_flags.DEFINE_config_file("config", os.path.join(ROOT, "configs/default.py"),
                                    flag_values=values)
  finally:
    sys.argv = saved
  values(argv)
  return values.config


def test_config_scheduler_policy_key_and_override_set_decision():
  assert no_warning(builder.scheduler_config, default_config()).decision == "cost"
  assert no_warning(builder.scheduler_config,
                    default_config("--config.scheduler.decision=fetch")).decision == "fetch"
  # an old command line's override still parses (the key is kept, unset) and sets decision
  old_line = default_config("--config.scheduler.policy=recompute")
  with pytest.warns(DeprecationWarning, match=r"config\.scheduler\.policy is deprecated: it "
                    r"is config\.scheduler\.decision \(--config\.scheduler\.decision=recompute"):
    assert builder.scheduler_config(old_line).decision == "recompute"
  # a user's own config file with the old key alone
  with pytest.warns(DeprecationWarning, match=r"config\.scheduler\.policy is deprecated"):
    assert builder.scheduler_config({"scheduler": {"policy": "fetch"}}).decision == "fetch"
  both = default_config("--config.scheduler.decision=fetch",
                        "--config.scheduler.policy=recompute")
  with pytest.raises(InputError, match="disagree; set decision only"):
    builder.scheduler_config(both)


def test_build_engine_policy_is_cache():
  # The keyword is read before the config: an empty config shows where it went, no engine
  # is built (the engines themselves are built with cache= throughout the tests).
  with pytest.raises(InputError, match="config has no 'model' section"):
    no_warning(builder.build_engine, {}, cache="nocache")
  with pytest.warns(DeprecationWarning, match=r"build_engine\(policy=\) is deprecated: it is "
                    r"build_engine\(cache=\)"):
    with pytest.raises(InputError, match="config has no 'model' section"):
      builder.build_engine({}, policy="nocache")
  with pytest.warns(DeprecationWarning), pytest.raises(InputError,
                                                       match=r"build_engine\(cache='lru'\)"):
    builder.build_engine({}, policy="lru")
  with pytest.warns(DeprecationWarning), pytest.raises(InputError, match="give cache only"):
    builder.build_engine({}, cache="nocache", policy="jaxkv")
  assert builder.POLICIES == builder.CACHES == ("jaxkv", "nocache")


def test_serve_json_cache_key_and_its_former_key():
  summary = {"jaxkv": {"ttft_p50_s": 1.0}, "nocache": {"ttft_p50_s": 2.0}}
  for result in ({"cache": "nocache", "policy": "nocache", "summary": summary},
                 {"policy": "nocache", "summary": summary}):  # a file written before "cache"
    assert device_check.engine_summary(result)["ttft_p50_s"] == 2.0
  assert metrics.ENGINE_LABEL == "policy"  # the label's name stays: dashboards select on it


# Runs a launch script's flag reading alone: its flags parsed, the deprecated flag's value
# read the way main reads it.
FLAG_DRIVER = r"""
import sys
sys.path.insert(0, "launch")
from absl import app, flags
script, read, *argv = sys.argv[1:]
module = __import__(script)
flags.FLAGS([f"{script}.py", *argv])
try:
  print("value", getattr(module, read)())
except app.UsageError as e:
  print("refused", e)
"""


@pytest.mark.parametrize("script,read,new", [("serve", "_main_cache", "cache"),
                                             ("router", "_routing", "routing")])
def test_launch_policy_flag_still_works_and_warns(script, read, new):
  value = "nocache" if script == "serve" else "round_robin"
  other = "jaxkv" if script == "serve" else "prefix"
  required = [] if script == "serve" else ["--replicas=http://127.0.0.1:1"]

  def run(*argv):
    proc = subprocess.run([sys.executable, "-c", FLAG_DRIVER, script, read, *required, *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1], proc.stderr

  out, err = run(f"--{new}={value}")
  assert out == f"value {value}" and "deprecated" not in err
  out, err = run(f"--policy={value}")
  assert out == f"value {value}"
  assert f"--policy is deprecated: it is --{new} (--{new}={value})" in err, err
  out, _ = run(f"--policy={value}", f"--{new}={value}")
  assert out == f"value {value}"
  out, _ = run(f"--policy={value}", f"--{new}={other}")
  assert out.startswith("refused") and "disagree" in out, out


def test_jaxkv_code_using_an_old_spelling_is_an_error_under_the_tests():
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    filters = tomllib.load(f)["tool"]["pytest"]["ini_options"]["filterwarnings"]
  deprecated = [f for f in filters if "is deprecated" in f]
  assert len(deprecated) == 1
  action, message, category, module = deprecated[0].split(":")
  assert (action, category, module) == ("error", "DeprecationWarning", "jaxkv[.]")
  for said in ("SchedulerConfig(policy=) is deprecated: it is SchedulerConfig(decision=).",
               "SchedulerConfig.policy is deprecated: it is SchedulerConfig.decision.",
               "RouterConfig(policy=) is deprecated: it is RouterConfig(routing=).",
               "RouterConfig.policy is deprecated: it is RouterConfig.routing.",
               "build_engine(policy=) is deprecated: it is build_engine(cache=).",
               "Scheduler(policy=) is deprecated: it is Scheduler(batching=) "):
    assert re.match(message, said), said
  # a user's config key is data, not jaxkv's code: it only warns
  assert not re.match(message, "config.scheduler.policy is deprecated: it is ...")
