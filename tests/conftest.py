"""Test settings: 8 virtual CPU devices and strict dtype promotion, set before JAX starts."""

import atexit
import os
import shutil
import tempfile

# One persistent compilation cache for the session and the subprocesses it starts (serve,
# generate, bench, multi-process jobs compile the same steps over and over): a fresh
# directory per session, removed at exit. It changes no result, only compile time.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _JIT_CACHE = tempfile.mkdtemp(prefix="jaxkv-test-jit-")
  atexit.register(shutil.rmtree, _JIT_CACHE, ignore_errors=True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _JIT_CACHE
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_collection_modifyitems(config, items):
  del config
  if len(jax.devices()) < 8:
    skip = pytest.mark.skip(reason="needs 8 devices (XLA_FLAGS was set too late)")
    for item in items:
      if "mesh" in item.fixturenames:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def mesh():
  import jaxkv
  return jaxkv.make_mesh(data=4, model=2)


@pytest.fixture(scope="module")
def s3():
  """An S3-compatible server on loopback (moto), for a module's stores."""
  from jaxkv.bench.s3server import LocalS3
  with LocalS3() as server:
    yield server


@pytest.fixture(scope="module")
def fresh(mesh):
  """An engine that recomputes every prompt: what cached answers must equal."""
  import helpers
  return helpers.make_engine(mesh, prefix_reuse=False)


@pytest.fixture(autouse=True)
def _insecure_warnings_afresh():
  """Each test sees the INSECURE warnings its own setups print (they print once per
  process, and the suite is one process)."""
  from jaxkv import security
  security._warned.clear()  # pylint: disable=protected-access
