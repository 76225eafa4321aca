"""The environment of a JAX process the harness starts (a server, a job's process, a writer).

A child never inherits its parent's virtual CPU device count (its config, or the launcher,
sets its own), but every other ``XLA_FLAGS`` flag is passed on: a dump directory, an
optimization level or a debugging flag set for a run reaches every process of it.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def without_device_count(xla_flags: str) -> str:
  """``xla_flags`` less its virtual device count (``--flag=N`` or ``--flag N``)."""
  words, out = xla_flags.split(), []
  skip = False
  for w in words:
    if skip:
      skip = False
    elif w == DEVICE_COUNT_FLAG:
      skip = True  # its value is the next word
    elif not w.startswith(DEVICE_COUNT_FLAG + "="):
      out.append(w)
  return " ".join(out)


def child_env(base: Mapping[str, str] | None = None, *, device_count: int | None = None,
              drop: Iterable[str] = (), **extra: str) -> dict[str, str]:
  """A copy of ``base`` (default ``os.environ``) for a child JAX process: ``XLA_FLAGS`` keeps
  every flag but the device count, which is ``device_count`` where given (else the child's
  own); the variables named in ``drop`` are left out and ``extra`` is set."""
  env = dict(os.environ if base is None else base)
  for name in drop:
    env.pop(name, None)
  flags = without_device_count(env.pop("XLA_FLAGS", ""))
  if device_count is not None:
    flags = f"{flags} {DEVICE_COUNT_FLAG}={int(device_count)}".strip()
  if flags:
    env["XLA_FLAGS"] = flags
  env.update(extra)
  return env
