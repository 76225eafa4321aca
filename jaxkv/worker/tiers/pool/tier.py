"""POOL tier: blocks in a Mooncake Store pool, the memory every node of a deployment lends.

Each process mounts a segment of its own host memory in the pool (``TierConfig.pool_segment_mb``)
and puts the blocks it demotes there; the pool's master places every value on some
segment (``pool_replicas`` copies), evicts by lease and soft pin, and any process of any
job that knows the master reads it back. A block another process put is a hit here: the
pool is shared like a store, not owned like the host tier, so its blocks are not in the
prefix index. Admission asks the pool (one ``batch_is_exist`` per request, on the lookup
thread) how many blocks after those cached locally it holds, and the plan prices them over
the ``pool_to_host`` link, calibrated at start and learned from every fetch.

The pool is untrusted storage (it has no authentication; anyone who reaches the master can
read, overwrite or delete any value):

- With a deployment key, a value's name is a keyed hash of its block key (``name``), so the
  pool learns no block key, and its value is the block's record (``blocks``, CRC-32C) sealed
  with AES-256-GCM (``security.Seal``, purpose ``pool-value``) with the block key and the
  model fingerprint as associated data. A value moved under another name, written without
  the key, or changed does not open (``Failure.MAC``, counted); its chain is recomputed.
- Without a key, the name is the block key in hex and the value the plain record: its CRC
  catches accidents only, and the pool holds the prompt's KV in the clear. One ``INSECURE:``
  line says so.

Every read has a deadline: gets run on a few threads (the client releases the GIL; a get
whose segment's owner stopped answering returns only after the client's own 30 s), and
``finish_fetch`` takes what arrived by ``t_end``; the rest is ``Failure.DEADLINE``. A value
gone (evicted, or on a segment whose process died) is ``Failure.GONE``; an error of the
client (the master down) is ``Failure.IO``. After three failed calls in a row the pool is
skipped for a cool-down (``Breaker``): lookups answer nothing and puts are dropped, counted,
until a call succeeds again (the client reconnects to a restarted master by itself).
Gets have a breaker of their own (``get_breaker``: their bytes come from the lenders, and a
lender can be gone while the master, still listing its values, answers every lookup):
three gets in a row whose every value failed to transfer open it, and so does one get not
answered by the read deadline (a stopped lender, a link that went down: each later request
would wait the deadline too). While it is open, or while every get thread is still inside
the client with a get given up on, lookups answer nothing: requests recompute, no wait.

Puts are written behind, on one thread, from a bounded queue (``pool_queue_mb``; the
tier's ``PutQueue``, ``jaxkv.worker.tiers.pool.puts``): a put the queue has no room for is
dropped and counted, never waited for. Blocks already in the pool are not put again (one
``batch_is_exist`` per batch). A put the pool refuses (full: every value's lease is live)
is counted. Blocks reused at least once when they are put
are soft-pinned for ``pool_pin_s`` (eviction takes unpinned values first; the pin ends with
its time-to-live).

A participant can cost misses, never waits. Any node that mounts a segment (no key needed:
the master has no authentication) may be chosen to hold a value, and one that keeps its
registration but stops serving transfers holds a put inside the client for the client's
own 30 s. So every client call of a put runs on one of ``PUT_THREADS`` threads and is
waited for ``put_deadline_s`` at most (``PUT_DEADLINE_S``, no longer than a read's): a put
not done by then is given up (``pool_put_timeouts``) and counts toward the breaker like a
failed read; the call is left to finish in the client (the value it sends is referenced by
the call; ``close`` leaves the client open while calls are inside it). With every put
thread still inside the client the next put fails at once, so a stopped lender trips the
breaker within two deadlines and later puts are dropped, counted, at once (``calls``).

Each key this process queued has an outcome (queued, placed or missed, the last
``RECENT_KEYS`` kept): a prefill's hand-off (``placed_run``) waits only for the outcomes of
its own blocks, up to its own deadline, instead of for the whole queue, and asks the master
about the keys it put none of on a thread of its own, never on the lookup thread that every
tenant's admission shares.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import hmac
import queue
import socket
import threading
import time
from urllib.parse import urlparse

import numpy as np
from absl import logging

from jaxkv import security
from jaxkv.errors import InputError
from jaxkv.manager.index import Tier
from jaxkv.stats import Stats
from jaxkv.worker.tiers import blocks
from jaxkv.worker.tiers.base import Breaker, Failure, Fetch, FetchOutcome
from jaxkv.worker.tiers.pool import native
from jaxkv.worker.tiers.pool.calls import Asker, Calls
from jaxkv.worker.tiers.pool.puts import PutQueue

GET_THREADS = 4
NOT_FOUND, BUFFER_TOO_SMALL = -704, -600  # Mooncake's error codes for a get into a buffer
RECENT_KEYS = 1 << 16  # keys queued lately that are not queued again
LOOKUP_DEADLINE_S = 0.5  # a lookup answers nothing after this (normally ~0.3 ms on loopback)
PUT_DEADLINE_S = 5.0  # a put's client call given up after this (the client's own is 30 s)
PUT_THREADS = 2  # put calls that may still be inside the client before puts fail at once


def split_address(address: str, flag: str = "--pool") -> tuple[str, int]:
  """``host:port`` as ``(host, port)`` (InputError naming ``flag`` otherwise)."""
  host, _, port = str(address).rpartition(":")
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise InputError(f"{flag}={address!r} is not HOST:PORT (the Mooncake master's RPC "
                     "address, e.g. 10.0.0.5:50051).")
  return host.strip("[]"), int(port)


def metadata_url(master: str, metadata: str | None) -> str:
  """The HTTP metadata server's URL: ``metadata``, else the master's host on port 8080
  (``mooncake_master --enable_http_metadata_server``'s default port)."""
  if metadata:
    u = urlparse(metadata)
    if u.scheme not in ("http", "https") or not u.hostname or not u.port:
      raise InputError(f"--pool_metadata={metadata!r} is not an http://HOST:PORT/metadata URL "
                       "(the master's HTTP metadata server).")
    return metadata
  return f"http://{split_address(master)[0]}:8080/metadata"


def local_address(master: str) -> str:
  """The address of this host that the master (and so the other nodes) reach it at."""
  host, port = split_address(master)
  with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                     socket.SOCK_DGRAM) as s:
    try:
      s.connect((host, port))  # a UDP connect sends nothing: it picks the route
      return s.getsockname()[0]
    except OSError:
      return "127.0.0.1"


def check_reachable(master: str, metadata: str | None, timeout_s: float = 3.0) -> None:
  """Raises InputError naming the flag and the fix when the master's RPC port or its
  metadata server does not answer (before anything slow starts)."""
  host, port = split_address(master)
  url = urlparse(metadata_url(master, metadata))  # a malformed URL is refused before any wait
  try:
    with socket.create_connection((host, port), timeout=timeout_s):
      pass
  except OSError as e:
    raise InputError(f"--pool={master}: no Mooncake master answers there ({e.strerror or e}); "
                     "start mooncake_master (--rpc_port) or fix the address.") from None
  try:
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s):
      pass
  except OSError as e:
    raise InputError(f"--pool_metadata={metadata_url(master, metadata)}: the master's HTTP "
                     f"metadata server does not answer ({e.strerror or e}); start the master "
                     "with --enable_http_metadata_server=true --http_metadata_server_port=P, "
                     "or give its URL.") from None


def _receive_buffers(client, nbytes: int) -> queue.Queue:
  """One registered receive buffer per get thread: values land there without a copy by
  the client, and are copied out once."""
  slabs = queue.Queue()
  for _ in range(GET_THREADS):
    buf = np.empty(nbytes, np.uint8)
    if client.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
      raise InputError(f"registering a {nbytes >> 20} MiB receive buffer with the pool client "
                       "failed; lower --config.tiers.pool_buffer_mb.")
    slabs.put(buf)
  return slabs


class PoolTier:
  """A Mooncake Store pool as a tier: lookups, fetches (``FetchSource``) and puts."""

  tier = Tier.POOL

  def __init__(self, tiers, *, payload_shape: tuple, dtype, fingerprint: bytes,
               key: bytes | None, stats: Stats | None = None):
    self.tiers = tiers
    self.payload_shape, self.dtype = tuple(payload_shape), dtype
    self.fingerprint, self.key = fingerprint, key
    self.stats = stats if stats is not None else Stats()
    self._seal = security.Seal(key, "pool-value") if key is not None else None
    self.record_bytes = blocks.record_bytes(self.payload_shape, dtype)
    self.value_bytes = self.record_bytes + (security.Seal.OVERHEAD if key is not None else 0)
    self.master = tiers.pool_master
    self.metadata = metadata_url(tiers.pool_master, tiers.pool_metadata)
    self.breaker = Breaker(trip_after=3, cool_down_s=5.0)  # the master's (and puts')
    # Gets transfer from the lenders' segments, not from the master: a lender that is gone
    # while the master still lists its values fails every get while every lookup answers.
    # Its own breaker, which the lookups' answers do not reset.
    self.get_breaker = Breaker(trip_after=3, cool_down_s=5.0)
    self.client = None
    self._store = None
    self._gets = None
    self._calls = Calls()
    self._inside_gets: list = []  # gets submitted that may still be inside the client
    self._inside_lock = threading.Lock()  # (the runner's and the lookup thread's)
    self.put_deadline_s = min(PUT_DEADLINE_S, tiers.read_deadline_s)
    self._puts = PutQueue(tiers, breaker=self.breaker, stats=self.stats,
                          recent_keys=RECENT_KEYS)
    self.pin_all = False  # a prefill node's: every block it puts is soft-pinned
    self._spaced, self._prefix = None, ""  # the fingerprint the names' prefix is of
    if key is None:
      security.warn_insecure(
          f"the pool tier at {self.master} holds blocks in the clear under their block keys, "
          "and anyone who reaches the master can read, replace or delete them",
          "set a deployment key (JAXKV_DEPLOYMENT_KEY or --deployment_key_file) to name them "
          "by keyed hashes and seal them")

  # ---- opening and closing -----------------------------------------------------------------
  def open(self) -> "PoolTier":
    """Connects to the master and mounts this process's segment (raises InputError with the
    flag and the fix when that fails)."""
    store = native.load_store()
    self._store = store
    client = store.MooncakeDistributedStore()
    t = self.tiers
    rc = client.setup(local_address(self.master), self.metadata, t.pool_segment_mb << 20,
                      t.pool_buffer_mb << 20, t.pool_protocol, t.pool_rdma_devices,
                      self.master)
    if rc != 0:
      raise InputError(f"--pool={self.master}: mounting a {t.pool_segment_mb} MiB segment "
                       f"failed (Mooncake setup returned {rc}); check that the master runs "
                       f"there, that --pool_metadata={self.metadata} is its metadata server, "
                       "and that --pool_segment_mb fits in free memory.")
    self.client = client
    self._gets = concurrent.futures.ThreadPoolExecutor(GET_THREADS,
                                                       thread_name_prefix="jaxkv-pool-get")
    self._lookups, self._checks = (Asker(what, self._calls, self.breaker, self.stats)
                                   for what in ("pool_lookup", "pool_hand_off_check"))
    self._slabs = _receive_buffers(
        client, max(self.value_bytes, (t.pool_buffer_mb << 20) // GET_THREADS))
    # Values are named and sealed on the put thread (this tier's names and seal).
    self._puts.start(client, store, self._calls, threads=PUT_THREADS,
                     deadline_s=self.put_deadline_s, name=self.name, value=self.value)
    logging.info("pool tier: master %s, %d MiB lent, %d replica(s), values of %d bytes%s",
                 self.master, t.pool_segment_mb, t.pool_replicas, self.value_bytes,
                 ", sealed" if self._seal else "")
    return self

  def close(self, timeout_s: float = 10.0) -> None:
    """Finishes the queued puts (up to ``timeout_s``), unmounts the segment, disconnects."""
    if self.client is None or self._puts.closed:
      return
    self.settle(timeout_s)
    t_end = time.monotonic() + timeout_s
    writer_ended = self._puts.stop(timeout_s)
    self._gets.shutdown(wait=False, cancel_futures=True)
    for calls in (self._lookups, self._checks):
      calls.shutdown()
    running = self._calls.running_after(max(0.0, t_end - time.monotonic()))
    if running or not writer_ended:  # closing it under them frees what they use
      self.stats.add("pool_close_left_open")
      logging.warning("the pool client is left open: %d call(s) still inside it after %.0f s",
                      running + (not writer_ended), timeout_s)
      return
    try:
      self.client.close()
    except Exception:  # pylint: disable=broad-except  (closing a client whose master is gone)
      logging.exception("closing the pool client failed")

  def scratch(self, fingerprint: bytes) -> "PoolTier":
    """A tier over the same connection whose values live under another fingerprint
    (calibration's: nobody else reads them)."""
    other = PoolTier.__new__(PoolTier)
    other.__dict__.update(self.__dict__)
    other.fingerprint = fingerprint
    return other

  def reshaped(self, payload_shape: tuple) -> "PoolTier":
    """A tier over the same connection (its put queue, get threads and breakers) whose
    values hold payloads of ``payload_shape``: a window group's blocks, which go under
    names of their own (``jaxkv.manager.windows.window_key`` of the block key)."""
    other = PoolTier.__new__(PoolTier)
    other.__dict__.update(self.__dict__)
    other.payload_shape = tuple(payload_shape)
    other.record_bytes = blocks.record_bytes(other.payload_shape, self.dtype)
    other.value_bytes = other.record_bytes + (security.Seal.OVERHEAD if self.key else 0)
    slab = max(self.value_bytes, (self.tiers.pool_buffer_mb << 20) // GET_THREADS)
    if other.value_bytes > slab:
      raise InputError(f"a pool value of {other.value_bytes} bytes does not fit a receive "
                       f"buffer of {slab} bytes: raise --config.tiers.pool_buffer_mb to at "
                       f"least {-(-other.value_bytes * GET_THREADS // (1 << 20))}.")
    return other

  # ---- names and values ----------------------------------------------------------------------
  def _space(self) -> str:
    """The names' prefix: this model's fingerprint (keyed under a key), computed once."""
    if self._spaced != self.fingerprint:
      self._spaced, self._prefix = self.fingerprint, (
          self.fingerprint[:16].hex() if self.key is None else
          hmac.new(self.key, b"jaxkv-pool-space\x00" + self.fingerprint,
                   hashlib.sha256).hexdigest()[:32])
    return self._prefix

  def name(self, key: bytes) -> str:
    """The pool's name for a block: keyed (the pool learns no block key) under a key."""
    if self.key is None:
      return f"jaxkv/{self._space()}/{key.hex()}"
    return f"jaxkv/{self._space()}/" + hmac.new(self.key, b"jaxkv-pool-name\x00" + key,
                                                hashlib.sha256).hexdigest()

  def value(self, key: bytes, payload: np.ndarray, parent: bytes | None) -> bytes:
    record = blocks.encode(payload, key, self.fingerprint, parent).tobytes()
    if self._seal is None:
      return record
    return self._seal.seal(key + self.fingerprint, record)

  def decode(self, key: bytes, value) -> np.ndarray:
    """The verified payload of a value read under ``key``'s name (raises BlockError)."""
    if self._seal is not None:
      try:
        value = self._seal.open(key + self.fingerprint, value)
      except security.SealError as e:
        raise blocks.BlockError("mac", str(e)) from None
    return blocks.decode(np.frombuffer(value, np.uint8), key=key, fingerprint=self.fingerprint,
                         dtype=self.dtype, shape=self.payload_shape)

  # ---- lookups ---------------------------------------------------------------------------------
  def present(self, keys: list[bytes]) -> list[bool]:
    """Which blocks the pool holds now; none when it is cooling down, fails, or does not
    answer within ``LOOKUP_DEADLINE_S`` (a client call blocks ~4 s while the master is
    down: the call is left to finish on its thread, and the next lookup does not queue
    behind it)."""
    return self._ask(self._lookups, keys, min(LOOKUP_DEADLINE_S, self.tiers.read_deadline_s))

  def _ask(self, asker: Asker, keys: list[bytes], timeout_s: float) -> list[bool]:
    if (not keys or self.client is None or not self.breaker.available
        or not self.get_breaker.available or self.gets_stuck()):
      return [False] * len(keys)
    return asker.ask(self.client.batch_is_exist, [self.name(k) for k in keys], timeout_s)

  def gets_stuck(self) -> bool:
    """Whether every get thread is still inside the client with an earlier get (given up
    on at its deadline: a lender that stopped serving, a link that went down). A get
    submitted now would queue behind them: the pool is then asked nothing and read
    nothing, as if its breaker were open, until one returns."""
    with self._inside_lock:
      self._inside_gets = [f for f in self._inside_gets if not f.done()]
      if len(self._inside_gets) < GET_THREADS:
        return False
    self.stats.add("pool_gets_stuck")
    return True

  def _submit_get(self, keys: list[bytes], fn=None) -> concurrent.futures.Future:
    future = self._calls.submit(self._gets, fn or self._get, keys)
    with self._inside_lock:
      self._inside_gets.append(future)
    return future

  def placed_run(self, keys: list[bytes], timeout_s: float) -> int:
    """How many of ``keys``, from the front, are in the pool as far as this process knows,
    waiting (up to ``timeout_s``) only for its own puts of them still queued or running.
    A key it placed (or found there when it put it) counts; one whose put failed ends the
    run; keys it holds no outcome for (put by another process of a job, or long ago) are
    asked about on the hand-off's own thread (``Outcomes.placed_run``)."""
    return self._puts.outcomes.placed_run(
        keys, time.monotonic() + timeout_s,
        lambda rest, left: self._ask(self._checks, rest, min(LOOKUP_DEADLINE_S, left)))

  def lookup(self, keys: list[bytes], local: int = 0) -> int:
    """Blocks of ``keys`` cached in the pool or locally, from the front: ``local`` plus the
    leading run of ``keys[local:]`` the pool holds."""
    self.stats.add("pool_lookups")
    there = self.present(list(keys[local:]))
    run = next((i for i, p in enumerate(there) if not p), len(there))
    return local + run

  # ---- FetchSource -----------------------------------------------------------------------------
  def _timed_get(self, keys: list[bytes]) -> tuple[list, float]:
    """``_get``, and ``time.perf_counter()`` when its bytes were in: a fetch's link is timed
    to then (``FetchOutcome.arrived``), not to when the step came to wait for it (a split's
    recompute ran meanwhile: timed to the wait, the link looked as slow as that compute,
    and the plan split again)."""
    return self._get(keys), time.perf_counter()

  def _get(self, keys: list[bytes]) -> list[tuple[int, memoryview | None]]:
    """``(code, value)`` per key: ``code`` the bytes read or Mooncake's error code."""
    slab = self._slabs.get(timeout=60)
    try:
      per = len(slab) // self.value_bytes
      out = []
      for lo in range(0, len(keys), per):
        part = keys[lo:lo + per]
        base = slab.ctypes.data
        codes = self.client.batch_get_into(
            [self.name(k) for k in part], [base + i * self.value_bytes for i in range(len(part))],
            [self.value_bytes] * len(part))
        got = memoryview(slab[:len(part) * self.value_bytes].copy())
        out += [(c, got[i * self.value_bytes:(i + 1) * self.value_bytes] if c > 0 else None)
                for i, c in enumerate(codes)]
      return out
    finally:
      self._slabs.put(slab)

  def _judge(self, key: bytes, code: int, value) -> tuple[np.ndarray | None, Failure | None]:
    """A got value's payload, or why it is not used (a wrong-sized one is removed)."""
    if code == NOT_FOUND:
      return None, Failure.GONE
    if code < 0 and code != BUFFER_TOO_SMALL:
      return None, Failure.IO
    try:
      if code != self.value_bytes:
        raise blocks.BlockError("size", f"the pool's value has {code if code >= 0 else 'more'} "
                                f"bytes, not {self.value_bytes}")
      return self.decode(key, value), None
    except blocks.BlockError as e:
      logging.warning("pool value for block %s rejected and removed: %s", key[:8].hex(), e)
      self._remove(key)
      return None, e.reason

  def start_fetch(self, fetches: list[Fetch]) -> tuple[None, list]:
    """Issues one batched get per request (on the get threads) without waiting."""
    groups: dict = collections.defaultdict(list)
    for i, f in enumerate(fetches):
      groups[f.request].append(i)
    pending = []
    for positions in groups.values():
      keys = [fetches[i].key for i in positions]
      future = (self._submit_get(keys, self._timed_get) if self.breaker.available
                and self.get_breaker.available and not self.gets_stuck() else None)
      pending.append((positions, future))
    return None, (tuple(fetches), pending)

  def finish_fetch(self, handle, t_end: float, stage) -> FetchOutcome:
    fetches, pending = handle
    failures: list = [None] * len(fetches)
    staged = []
    arrived = None  # when the last answered get had its bytes
    for positions, future in pending:
      if future is None:
        for i in positions:
          failures[i] = Failure.BREAKER
        continue
      try:
        values, t_in = future.result(timeout=max(0.0, t_end - time.monotonic()))
        arrived = t_in if arrived is None else max(arrived, t_in)
      except concurrent.futures.TimeoutError:
        # Not answered by the read deadline: believed at once (the next requests would
        # each wait the deadline too), the pool left alone for the cool-down.
        future.cancel()
        self.get_breaker.trip()
        for i in positions:
          failures[i] = Failure.DEADLINE
        continue
      except Exception as e:  # pylint: disable=broad-except  (a failed get is a miss)
        logging.warning("pool get failed: %s", e)
        self.get_breaker.record(False)
        for i in positions:
          failures[i] = Failure.IO
        continue
      # Answered; but a get whose every value failed to transfer (a lender killed while
      # the master still lists its values) is a failure toward the breaker.
      self.get_breaker.record(any(code in (NOT_FOUND, BUFFER_TOO_SMALL) or code >= 0
                                  for code, _ in values))
      for i, (code, value) in zip(positions, values):
        f = fetches[i]
        payload, failures[i] = self._judge(f.key, code, value)
        if payload is not None:
          staged.append((f.shard, f.page, payload))
    return FetchOutcome(stage(staged) if staged else None, tuple(failures), arrived=arrived)

  def _remove(self, key: bytes) -> None:
    try:
      self.stats.add("pool_removed", self.client.remove(self.name(key), True) == 0)
    except Exception:  # pylint: disable=broad-except  (best effort: the next reader rejects it too)
      logging.exception("removing a rejected pool value failed")

  def read_verified(self, keys: list[bytes], t_end: float) -> list[np.ndarray]:
    """Reads and verifies blocks (all in one get) within the deadline; raises on a miss."""
    future = self._submit_get(list(keys))
    out = []
    for k, (code, value) in zip(keys, future.result(timeout=max(0.0, t_end - time.monotonic()))):
      payload, failure = self._judge(k, code, value)
      if failure is not None:
        raise blocks.BlockError(failure.value, f"block {k[:8].hex()} read from the pool")
      out.append(payload)
    return out

  # ---- puts (written behind: ``PutQueue``) ---------------------------------------------------
  @property
  def in_job(self) -> bool:
    """Whether this tier serves one process of a multi-process job (set by the mover): a
    put that missed is then not offered again."""
    return self._puts.in_job

  @in_job.setter
  def in_job(self, value: bool) -> None:
    self._puts.in_job = bool(value)

  def recently_put(self, key: bytes) -> bool:
    """Whether this process queued ``key`` for the pool lately (not put again)."""
    return self._puts.recently_put(key)

  def note(self, keys) -> None:
    """Marks ``keys`` as sent to the pool (by this process or, in a job, another): not
    offered again while they are recent. Every process of a job notes the same keys at the
    same point, so what the next copy down gathers is the same everywhere."""
    self._puts.note(keys)

  def put(self, items: list[tuple[bytes, bytes | None, np.ndarray, bool]]) -> None:
    """Queues ``(key, parent, payload, pin)`` puts (every one pinned on a prefill node:
    ``pin_all``); those the queue has no room for are dropped and counted (never waited
    for)."""
    self._puts.put([(key, parent, payload, pin or self.pin_all)
                    for key, parent, payload, pin in items])

  @property
  def queued(self) -> int:
    """Puts queued and not yet tried."""
    return self._puts.queued

  def settle(self, timeout_s: float = 30.0) -> bool:
    """Waits (up to ``timeout_s``) until every queued put was tried; True when none is left."""
    return self._puts.settle(timeout_s)
