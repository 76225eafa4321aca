"""Errors by kind (jaxkv.errors): bad input is an InputError and a launcher's one-line exit
2; broken bookkeeping is an InvariantError, a bug that keeps its traceback and exits 1."""

import hashlib
import os
import subprocess
import sys
import textwrap

import pytest

from jaxkv.errors import InputError, InvariantError
from jaxkv.tools.env import child_env
from jaxkv.manager.index import PrefixIndex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_an_invariant_error_is_no_kind_of_bad_input():
  # Not a ValueError: no `except ValueError` meant for bad input (a trace line, a network
  # answer) can swallow it or report it as the user's fault.
  assert issubclass(InvariantError, AssertionError)
  assert not issubclass(InvariantError, ValueError)
  assert issubclass(InputError, ValueError)


def test_a_double_release_is_an_invariant_error_not_input():
  index = PrefixIndex(num_shards=1, pages_per_shard=2, page_size=4,
                      fingerprint=hashlib.sha256(b"fp").digest())
  page, = index.allocate(0, 1)
  index.release(0, [page])
  with pytest.raises(InvariantError, match=f"release of device slot {page}") as e:
    try:
      index.release(0, [page])
    except ValueError:
      pytest.fail("an invariant error was caught as bad input")
  assert not isinstance(e.value, InputError)
  assert not index.held_slots(0)  # the failed release changed nothing


MAIN = """
import hashlib, sys
sys.path.insert(0, "launch")
import _common
import jaxkv
def main(argv):
  index = jaxkv.PrefixIndex(num_shards=1, pages_per_shard=2, page_size=4,
                            fingerprint=hashlib.sha256(b"fp").digest())
  {body}
_common.run(main)
"""


def launch(body: str) -> subprocess.CompletedProcess:
  env = child_env(drop=("JAX_PLATFORMS",))
  env["JAX_PLATFORMS"] = "cpu"
  code = textwrap.dedent(MAIN).replace("{body}", body)
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)


def test_a_launcher_refuses_bad_input_in_one_line_with_exit_2():
  proc = launch('index.block_keys([1, 2, 3, 4], "")')  # an empty tenant
  lines = [l for l in proc.stderr.splitlines() if l.strip()]
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert "Traceback" not in proc.stderr and len(lines) == 1, proc.stderr[-3000:]
  assert lines[0].startswith("error: tenant='' must be a non-empty string")


def test_a_launcher_reports_an_invariant_error_as_a_bug_with_exit_1():
  proc = launch("index.release(0, index.allocate(0, 1) * 2)")  # one reference, two releases
  assert proc.returncode == 1, proc.stderr[-3000:]
  assert "Traceback" in proc.stderr, proc.stderr[-3000:]
  assert "jaxkv.errors.InvariantError: release of device slot" in proc.stderr
  assert "error: release" not in proc.stderr  # not reported as bad input
