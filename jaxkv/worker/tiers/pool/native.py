"""The Mooncake Store client's native parts: the Python module, its shared libraries and
the master binary the ``mooncake-transfer-engine`` wheels ship.

The wheel's extension links ``libibverbs.so.1`` and ``libnuma.so.1`` even for TCP, and
neither is part of the wheel. A machine with Debian's ``libibverbs1`` and ``libnuma1``
installed has them; one without (a fresh CI machine, a container without root) can have
them fetched into a private directory (``fetch_libs``: ``apt-get download`` and
``dpkg-deb -x``, no root needed; as root on a machine whose package lists are empty,
``apt-get update`` first), from which ``load_store`` preloads them
(``RTLD_GLOBAL``, in dependency order) before importing the client, and ``master_env``
points the master binary at them (``LD_LIBRARY_PATH``). ``python -m
jaxkv.worker.tiers.pool.native`` fetches them. The directory is
``$JAXKV_NATIVE_LIBS``, else ``~/.cache/jaxkv/native``.
"""

from __future__ import annotations

import ctypes
import fcntl
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

from jaxkv.errors import InputError

# Debian package -> the libraries of it the client needs, in load order (dependencies first).
PACKAGES = {
    "libnuma1": ("libnuma.so.1",),
    "libnl-3-200": ("libnl-3.so.200",),
    "libnl-route-3-200": ("libnl-route-3.so.200",),
    "libibverbs1": ("libibverbs.so.1",),
}
FIX = ("install the pool extra (pip install 'jaxkv[pool]') and the two Debian libraries it "
       "needs (apt-get install -y libibverbs1 libnuma1), or fetch them without root: "
       "python -m jaxkv.worker.tiers.pool.native")


def lib_dir() -> str:
  return os.environ.get("JAXKV_NATIVE_LIBS") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxkv", "native")


def _loadable(name: str) -> bool:
  try:
    ctypes.CDLL(name)
    return True
  except OSError:
    return False


def _missing_packages() -> list[str]:
  here = lib_dir()
  return [pkg for pkg, libs in PACKAGES.items()
          if not all(_loadable(lib) or os.path.exists(os.path.join(here, lib)) for lib in libs)]


def fetch_libs(timeout_s: float = 300.0) -> list[str]:
  """Fetches the Debian packages whose libraries neither the system nor ``lib_dir()`` has,
  and unpacks their libraries into ``lib_dir()`` (one process at a time: a lock file; each
  library lands whole, by rename). Returns the packages fetched."""
  if not _missing_packages():
    return []
  os.makedirs(lib_dir(), exist_ok=True)
  with open(os.path.join(lib_dir(), ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return _fetch(timeout_s)


def _fetch(timeout_s: float) -> list[str]:
  missing = _missing_packages()  # another process may have fetched them meanwhile
  if not missing:
    return []
  for tool in ("apt-get", "dpkg-deb"):
    if shutil.which(tool) is None:
      raise InputError(f"the pool tier needs {missing} and this machine has no {tool} to "
                       f"fetch them: {FIX}.")
  os.makedirs(lib_dir(), exist_ok=True)
  with tempfile.TemporaryDirectory() as tmp:
    got = subprocess.run(["apt-get", "download", *missing], cwd=tmp, capture_output=True,
                         text=True, timeout=timeout_s, check=False)
    if got.returncode != 0 and os.geteuid() == 0:  # a machine whose package lists are empty
      subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=timeout_s,
                     check=False)
      got = subprocess.run(["apt-get", "download", *missing], cwd=tmp, capture_output=True,
                           text=True, timeout=timeout_s, check=False)
    debs = glob.glob(os.path.join(tmp, "*.deb"))
    if got.returncode != 0 or len(debs) < len(missing):
      raise InputError(f"apt-get download {' '.join(missing)} failed ({got.stderr.strip()[-300:]}): "
                       f"{FIX}.")
    root = os.path.join(tmp, "root")
    for deb in debs:
      subprocess.run(["dpkg-deb", "-x", deb, root], check=True, timeout=timeout_s)
    for pkg in missing:
      for lib in PACKAGES[pkg]:
        found = glob.glob(os.path.join(root, "**", lib), recursive=True)
        if not found:
          raise InputError(f"the package {pkg} has no {lib}: {FIX}.")
        part = os.path.join(lib_dir(), f".{lib}.part")
        shutil.copy2(os.path.realpath(found[0]), part)
        os.replace(part, os.path.join(lib_dir(), lib))
  return missing


def _preload() -> None:
  here = lib_dir()
  for libs in PACKAGES.values():
    for lib in libs:
      path = os.path.join(here, lib)
      if not _loadable(lib) and os.path.exists(path):
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


def load_store():
  """The ``mooncake.store`` module, its libraries preloaded (raises InputError with the fix
  when the wheel or a library is missing)."""
  if importlib.util.find_spec("mooncake") is None:
    raise InputError(f"the pool tier needs Mooncake Store's client, which is not installed: {FIX}.")
  _preload()
  os.environ.setdefault("GLOG_minloglevel", "2")  # the client logs every miss at ERROR
  try:
    from mooncake import store  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise InputError(f"Mooncake Store's client does not load ({e}): {FIX}.") from None
  return store


def master_binary() -> str:
  """The ``mooncake_master`` the installed wheel ships."""
  spec = importlib.util.find_spec("mooncake")
  if spec is None or not spec.submodule_search_locations:
    raise InputError(f"no Mooncake wheel is installed: {FIX}.")
  path = os.path.join(list(spec.submodule_search_locations)[0], "mooncake_master")
  if not os.access(path, os.X_OK):
    raise InputError(f"the Mooncake wheel has no runnable mooncake_master at {path}: {FIX}.")
  return path


def master_env(environ=None) -> dict:
  """An environment in which the master binary finds the fetched libraries."""
  env = dict(os.environ if environ is None else environ)
  env["LD_LIBRARY_PATH"] = os.pathsep.join(
      p for p in (lib_dir(), env.get("LD_LIBRARY_PATH", "")) if p)
  return env


if __name__ == "__main__":
  fetched = fetch_libs()
  print(f"fetched {fetched} into {lib_dir()}" if fetched else
        f"nothing to fetch: the libraries are on the system or in {lib_dir()}")
  load_store()
  print("mooncake.store loads", file=sys.stderr)
