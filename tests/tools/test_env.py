"""The environment of the processes the harness starts: every XLA flag but the device count."""

import os
import subprocess
import sys

from jaxkv.tools.env import child_env, without_device_count


def test_the_device_count_goes_in_either_spelling_and_nothing_else_does():
  assert without_device_count("--xla_force_host_platform_device_count=8") == ""
  assert without_device_count("--a=1 --xla_force_host_platform_device_count 4 --b") == "--a=1 --b"
  assert without_device_count(" --xla_dump_to=/d  --xla_force_host_platform_device_count=2 "
                              "--xla_backend_optimization_level=0") == (
      "--xla_dump_to=/d --xla_backend_optimization_level=0")
  # A flag that only begins like it is another flag.
  assert without_device_count("--xla_force_host_platform_device_count_x=1") == (
      "--xla_force_host_platform_device_count_x=1")


def test_child_env_sets_drops_and_keeps():
  base = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --xla_dump_to=/d",
          "JAX_PLATFORMS": "cpu", "HOME": "/h"}
  assert child_env(base) == {"XLA_FLAGS": "--xla_dump_to=/d", "JAX_PLATFORMS": "cpu", "HOME": "/h"}
  got = child_env(base, device_count=3, drop=("JAX_PLATFORMS",), JAXKV_PROCESS_ID="1")
  assert got == {"XLA_FLAGS": "--xla_dump_to=/d --xla_force_host_platform_device_count=3",
                 "HOME": "/h", "JAXKV_PROCESS_ID": "1"}
  alone = child_env({"XLA_FLAGS": "--xla_force_host_platform_device_count=8"})
  assert "XLA_FLAGS" not in alone  # nothing left to pass on
  assert base["XLA_FLAGS"].startswith("--xla_force")  # the parent's copy is untouched


def test_a_child_has_its_own_device_count_and_the_parents_other_flags():
  code = "import os, jax; print(jax.device_count(), os.environ['XLA_FLAGS'])"
  out = subprocess.run([sys.executable, "-c", code], env=child_env(device_count=3,
                                                                    JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120, check=True).stdout.split()
  assert out[0] == "3"
  parent = os.environ["XLA_FLAGS"].split()  # conftest: the tests' flags and 8 devices
  assert "--xla_force_host_platform_device_count=8" in parent
  assert [f for f in parent if "device_count" not in f] == [f for f in out[1:]
                                                             if "device_count" not in f]
