"""Everything jaxkv does across the processes of one ``jax.distributed`` job.

- ``initialize``: joins the job from explicit arguments or the ``JAXKV_COORDINATOR``,
  ``JAXKV_NUM_PROCESSES``, ``JAXKV_PROCESS_ID`` environment (what ``launch/multihost.py``
  sets), selecting gloo CPU collectives so a job runs on one machine's loopback. On a
  cluster whose launcher already provides these (TPU pods, SLURM), pass nothing.
- ``agree_digest``: every process contributes the digest of a piece of replicated state
  (the PrefixIndex, a plan); it raises if any process differs. The index is built by the
  same deterministic operations everywhere (hashlib, ordered dicts), so it should never
  differ; this is how a job proves it.
- ``plan_digest``: a SHA-256 over a plan's arrays, for ``agree_digest``.
- ``agree_reads`` / ``agree_writes``: the outcome of every disk read and write of the
  store a job shares, the same on every process (each process reads the records its own
  devices need, and writes its turn of the blocks; ``jaxkv.worker.transfers``, ``jaxkv.worker.journal``).
- ``allgather_codes`` / ``broadcast_bytes``: the small collectives that keep per-process
  outcomes (a disk write committed, a record verified) the same decision everywhere, and
  give every process process 0's costs (``jaxkv.planning.costs.agree_costs``).

Failure domain: in one ``jax.distributed`` job, a process that dies makes the others fail
their next collective and, after the coordinator's heartbeat timeout, abort (FACTS: a few
seconds). jaxkv cannot keep such a job alive; what it does is keep other *jobs* alive: a
cache shared across jobs goes through the REMOTE tier (``jaxkv.worker.tiers.remote``), where a
dead peer is a miss, a recompute and an open circuit breaker — never a hang or a crash.
"""

from __future__ import annotations

import hashlib
import json
import os

import jax
import numpy as np

from jaxkv.errors import InputError, InvariantError


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, cpu_collectives: str = "gloo") -> bool:
  """Joins a multi-process job. Returns False (and does nothing) for a single process."""
  coordinator = coordinator or os.environ.get("JAXKV_COORDINATOR")
  if num_processes is None and "JAXKV_NUM_PROCESSES" in os.environ:
    num_processes = int(os.environ["JAXKV_NUM_PROCESSES"])
  if process_id is None and "JAXKV_PROCESS_ID" in os.environ:
    process_id = int(os.environ["JAXKV_PROCESS_ID"])
  if not coordinator or not num_processes or num_processes <= 1:
    return False
  if process_id is None or not 0 <= process_id < num_processes:
    raise InputError(f"process_id={process_id} must be in [0, {num_processes}) for a job of "
                     f"{num_processes} processes.")
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator, num_processes, process_id)
  return True


def _allgather_bytes(payload: bytes, size: int) -> list[bytes]:
  from jax.experimental import multihost_utils
  buf = np.zeros((size,), np.uint8)
  data = np.frombuffer(payload, np.uint8)
  if data.size > size:
    raise InvariantError(f"payload of {data.size} bytes exceeds {size}.")
  buf[:data.size] = data
  rows = np.asarray(multihost_utils.process_allgather(buf))
  return [bytes(r) for r in rows.reshape(jax.process_count(), size)]


def agree_digest(digest: str, what: str) -> None:
  """Raises ``InputError`` naming the processes whose ``digest`` of ``what`` differs. Every
  process builds the same state by the same deterministic steps from the same inputs, so
  the usual cause is processes started with different flags, configs or files (or, for
  plans, costs each measured for itself: ``costs.agree_costs`` first)."""
  if jax.process_count() == 1:
    return
  got = [b.rstrip(b"\x00").decode() for b in _allgather_bytes(digest.encode(), 128)]
  if len(set(got)) != 1:
    raise InputError(f"{what} differs between processes: "
                     + ", ".join(f"process {i}: {d[:12]}" for i, d in enumerate(got))
                     + "; start every process with the same flags, config and files.")


def plan_digest(plan) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(plan):
    arr = np.asarray(jax.device_get(leaf))
    h.update(json.dumps([list(arr.shape), arr.dtype.name]).encode())
    h.update(np.ascontiguousarray(arr).tobytes())
  return h.hexdigest()


def allgather_codes(codes: np.ndarray) -> np.ndarray:
  """Every process's ``codes`` (ints, the same length everywhere) as ``[processes, n]``; a
  collective: every process calls it at the same point."""
  codes = np.asarray(codes, np.int32).reshape(-1)
  if jax.process_count() == 1:
    return codes[None]
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(codes)).reshape(jax.process_count(), -1)


def agree_reads(codes: np.ndarray, *, unread: int) -> np.ndarray:
  """One outcome per read, the same on every process of a job (a collective: every
  process calls it at the same point, with one code per read, in the same order).

  ``codes[i]`` is this process's outcome of read ``i``: 0 when another process read it,
  1 when it verified here, a failure code ``>= 2`` when it failed here. The job's outcome
  is 1 when every process that read it verified it; else the failure code of the first
  process (by process index) that failed it; ``unread`` when no process read it.
  """
  rows = allgather_codes(codes)  # [processes, reads]
  out = np.full(rows.shape[1], unread, np.int32)
  for i, column in enumerate(rows.T):
    failed = column[column >= 2]
    if failed.size:
      out[i] = failed[0]
    elif (column == 1).any():
      out[i] = 1
  return out


def agree_writes(codes: np.ndarray) -> np.ndarray:
  """Each write's outcome as its writer reports it, on every process of a job (a
  collective when there are several processes). ``codes[i]``: this process's code for
  write ``i``, nonzero only for a finished write of its own; one process writes each
  block, so the job's code is the sum over processes."""
  codes = np.asarray(codes, np.int32).reshape(-1)
  if jax.process_count() == 1:
    return codes
  return allgather_codes(codes).sum(axis=0).astype(np.int32)


def broadcast_bytes(payload: bytes) -> bytes:
  """Process 0's ``payload`` on every process (others pass anything); a collective."""
  if jax.process_count() == 1:
    return payload
  from jax.experimental import multihost_utils
  data = payload if jax.process_index() == 0 else b""
  size = int(multihost_utils.broadcast_one_to_all(np.int32(len(data))))
  if size == 0:
    return b""
  buf = np.zeros((size,), np.uint8)
  if jax.process_index() == 0:
    buf[:] = np.frombuffer(data, np.uint8)
  return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf)))


def local_data_shards(mesh, data_axis: str) -> set[int]:
  """The data shards of ``mesh`` that have a device in this process."""
  axis = mesh.axis_names.index(data_axis)
  rows = np.moveaxis(mesh.devices, axis, 0).reshape(mesh.devices.shape[axis], -1)
  me = jax.process_index()
  return {i for i, row in enumerate(rows) if any(d.process_index == me for d in row)}


def put_global(x: np.ndarray, sharding) -> jax.Array:
  """A host array onto ``sharding``; in a job only this process's parts of ``x`` are read
  (others' may hold anything)."""
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x) -> np.ndarray:
  """A jax.Array's whole value on this host, also when it spans other processes' devices
  (then every process must call this at the same point: it is a collective)."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
