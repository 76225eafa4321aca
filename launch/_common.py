"""Helpers shared by the launch scripts: start JAX the way a config asks, report figures.

Kept out of the library on purpose: this is the only place that touches the process
environment, and it must run before JAX is imported.
"""

import hashlib
import json
import os
import sys


def start_jax(cfg) -> None:
  """Sets the platform and the virtual CPU device count, then imports JAX. Library INFO
  logs (Orbax, XLA backends) are silenced unless --verbosity asks for them."""
  from absl import flags, logging
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  if "jax" in sys.modules:
    return
  platform = cfg.get("platform", None)
  if platform:
    os.environ.setdefault("JAX_PLATFORMS", platform)
  count = cfg.get("host_device_count", None)
  flags = os.environ.get("XLA_FLAGS", "")
  if count and "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  import jax  # noqa: F401  (imported here, after the environment is set)


def token_digest(token_lists) -> str:
  """SHA-256 over token ids in order: equal digests mean equal outputs."""
  h = hashlib.sha256()
  for tokens in token_lists:
    h.update(len(tokens).to_bytes(4, "little"))
    for t in tokens:
      h.update(int(t).to_bytes(4, "little", signed=True))
  return h.hexdigest()


def machine_info() -> dict:
  import jax
  import jaxkv
  return {"devices": [str(d) for d in jax.devices()], "backend": jax.default_backend(),
          "cpu_cores": os.cpu_count(), "jax": jax.__version__, "jaxkv": jaxkv.__version__}


def write_json(path: str, obj: dict) -> None:
  if not path:
    return
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  with open(path, "w") as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write("\n")


def run(main) -> None:
  """``app.run(main)``, where bad input (a config that does not load, a value that does not
  validate, a path that cannot be used) ends in one line on stderr and exit status 2,
  not a traceback. Anything else is a bug and keeps its traceback."""
  from absl import app

  def guarded(argv):
    try:
      return main(argv)
    except (ValueError, OSError) as e:
      first = " ".join(str(e).split())  # one line, whatever the message's layout
      print(f"error: {first}", file=sys.stderr)
      sys.exit(2)

  app.run(guarded)
