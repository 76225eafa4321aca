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
- ``warm_collectives`` / ``warm_gathers``: compile, during an engine's warm-up, every
  program the collectives and ``to_host`` will run, so that nothing compiles after it.

Fixed shapes: JAX compiles a collective once per payload shape, so every payload here
travels as bytes in pieces of a few bucket sizes (``COLLECTIVE_BUCKETS``: 256 bytes to
128 KiB, by eights; a longer payload goes in several 128 KiB pieces). A job therefore
compiles eight collective programs (a gather and a broadcast per size), all in
``warm_collectives``, however its payloads vary: a disk read's agreement, a step's
commands and a digest share them. ``to_host`` gathers a sharded array whole; its program
is keyed by the array's shape and sharding, which come from the transfer and step
buckets, so each warm-up gathers one array of each (``warm_gathers``).

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

# Every payload a collective carries is padded to one of these sizes (bytes): a few
# programs to compile for any payload. A payload longer than the last goes in pieces.
COLLECTIVE_BUCKETS = (256, 2048, 16384, 131072)
_HEADER_BYTES = 8  # broadcast_bytes's first piece starts with the payload's length
_warmed = False  # warm_collectives ran in this process


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


def _bucket(n: int) -> int:
  """The collective bucket for a piece of ``n`` bytes (``n`` at most the largest)."""
  return next(b for b in COLLECTIVE_BUCKETS if b >= n)


def _pieces(size: int, first: int = 0) -> list[tuple[int, int]]:
  """``(offset, length)`` of the pieces that carry bytes ``[first, size)``."""
  top = COLLECTIVE_BUCKETS[-1]
  return [(o, min(top, size - o)) for o in range(first, size, top)]


def _allgather_bytes(payload: bytes, size: int) -> list[bytes]:
  """Every process's ``payload`` (at most ``size`` bytes, ``size`` the same everywhere),
  each padded with zeros to ``size``; a collective, in bucket-sized pieces."""
  from jax.experimental import multihost_utils
  data = np.zeros((size,), np.uint8)
  got = np.frombuffer(payload, np.uint8)
  if got.size > size:
    raise InvariantError(f"a payload of {got.size} bytes exceeds the gather's {size=}.")
  data[:got.size] = got
  rows = np.zeros((jax.process_count(), size), np.uint8)
  for offset, n in _pieces(size):
    buf = np.zeros((_bucket(n),), np.uint8)
    buf[:n] = data[offset:offset + n]
    gathered = np.asarray(multihost_utils.process_allgather(buf))
    rows[:, offset:offset + n] = gathered.reshape(jax.process_count(), -1)[:, :n]
  return [r.tobytes() for r in rows]


def _broadcast_piece(buf: np.ndarray) -> np.ndarray:
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.broadcast_one_to_all(buf))


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
  rows = _allgather_bytes(codes.astype("<i4").tobytes(), 4 * codes.size)
  return np.stack([np.frombuffer(r, "<i4") for r in rows]).astype(np.int32)


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
  """Process 0's ``payload`` on every process (others pass anything); a collective. The
  first piece carries the length and the first bytes: a short payload is one collective."""
  if jax.process_count() == 1:
    return payload
  data = np.frombuffer(payload if jax.process_index() == 0 else b"", np.uint8)
  first = np.zeros((COLLECTIVE_BUCKETS[0],), np.uint8)
  first[:_HEADER_BYTES] = np.frombuffer(data.size.to_bytes(_HEADER_BYTES, "little"), np.uint8)
  room = first.size - _HEADER_BYTES
  first[_HEADER_BYTES:_HEADER_BYTES + min(room, data.size)] = data[:room]
  first = _broadcast_piece(first)
  size = int.from_bytes(first[:_HEADER_BYTES].tobytes(), "little")
  out = [first[_HEADER_BYTES:_HEADER_BYTES + min(room, size)].tobytes()]
  for offset, n in _pieces(size, room):
    buf = np.zeros((_bucket(n),), np.uint8)
    if data.size:  # process 0
      buf[:n] = data[offset:offset + n]
    out.append(_broadcast_piece(buf)[:n].tobytes())
  return b"".join(out)


def broadcaster():
  """``broadcast_bytes`` in a multi-process job (what a part that must agree with the job
  takes), None in a process of its own."""
  return broadcast_bytes if jax.process_count() > 1 else None


def warm_collectives() -> None:
  """Compiles the collectives of ``agree_*``, ``allgather_codes`` and ``broadcast_bytes``
  for every bucket (once per process; a collective in a job, nothing in one process)."""
  global _warmed
  if jax.process_count() == 1 or _warmed:
    return
  for size in COLLECTIVE_BUCKETS:
    _allgather_bytes(b"", size)
    _broadcast_piece(np.zeros((size,), np.uint8))
  _warmed = True


def warm_gathers(*arrays) -> None:
  """Compiles ``to_host``'s gather of arrays shaped and sharded like ``arrays`` (a
  collective for those that span other processes; nothing for those held whole here)."""
  for x in arrays:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      to_host(x)


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
