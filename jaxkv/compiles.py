"""Counting XLA compiles: the proof that nothing compiles after warm-up.

Trace counts see only the functions that count themselves; a recompile keyed by a new
sharding, a plan bucket nobody warmed or an eager op traced once more is invisible to
them. XLA itself is not: JAX reports every backend compile (a persistent-cache load
included) as the ``/jax/core/compile/backend_compile_duration`` event, named by the
function. ``COMPILES`` listens to that event for the whole process:

    from jaxkv.compiles import COMPILES
    mark = COMPILES.mark()
    ...                                   # serve
    COMPILES.since(mark)                  # compiles since the mark (0 after warm-up)
    COMPILES.names_since(mark)            # which functions compiled

Engines mark the end of their warm-up (``Engine.compiles_after_warmup``); the number is
in ``stats()``, the Prometheus family ``jaxkv_compiles_after_warmup`` and
``launch/serve.py --json_out``'s ``compiles_after_warmup``. To learn *why* an executable
missed the cache, set ``jax.config.update("jax_explain_cache_misses", True)``.
"""

from __future__ import annotations

import threading

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileLog:
  """Every backend compile of this process since the log was installed, in order."""

  def __init__(self):
    self._lock = threading.Lock()
    self._names: list[str] = []
    self._installed = False

  def install(self) -> "CompileLog":
    """Starts listening (once per process; later calls do nothing)."""
    with self._lock:
      if not self._installed:
        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self._installed = True
    return self

  def _on_event(self, event: str, duration: float, **kwargs) -> None:
    del duration
    if event == BACKEND_COMPILE_EVENT:
      with self._lock:
        self._names.append(str(kwargs.get("fun_name", "?")))

  @property
  def total(self) -> int:
    with self._lock:
      return len(self._names)

  def mark(self) -> int:
    """A position in the log to count from (installs the listener if needed)."""
    self.install()
    return self.total

  def since(self, mark: int) -> int:
    """Compiles after ``mark``."""
    return max(0, self.total - mark)

  def names_since(self, mark: int) -> list[str]:
    """The functions compiled after ``mark``, in order (a name repeats per compile)."""
    with self._lock:
      return list(self._names[mark:])


COMPILES = CompileLog()
