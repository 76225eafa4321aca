"""Whether a process runs, by its pid: how leftovers named after the process that made them
(an engine core's socket directory, a fabric's network namespaces) are told from a live
one's. Pids are this PID namespace's."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
  """False only when no process ``pid`` runs: another user's process, or a number too large
  to be a pid, count as running (what is named after them is left alone)."""
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (PermissionError, OverflowError):  # another user's process; no pid at all
    return True
  return True
