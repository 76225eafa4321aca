"""Warm restart: an Orbax checkpoint of the cache that restores onto any mesh.

What is saved (one Orbax ``CheckpointManager`` step, written asynchronously and
finalised atomically):
- ``device``: every published device block, gathered into one raw-bits stack
  ``[2 * layers, kv_heads, rows, page_size, head_dim]`` (``rows = shards * n``, padded);
- ``host``: the host pool's slots in the device stack's layout (``HostTier.stacked``: its
  scratch rows left out), when there is a host tier;
- ``window``: for a model with a window group (hybrid attention), every kept block's window
  K/V (``jaxkv.manager.windows``), least recently used first, in the same raw-bits layout
  with the window group's layers. A global block restored without the window before a cut
  is no hit at that cut, so without these a restarted hybrid model would recompute;
- ``window_host``: the windows kept in host memory
  (``TierConfig.host_window_pages_per_shard``), least recently used first, likewise;
- ``meta`` (JSON): format version, the model/layout fingerprint and the config fields
  behind it, and for every saved row (``device_rows``, ``host_rows``, ``window_rows``,
  ``window_host_rows``) its
  block key, parent key, old shard and a checksum of its bits. Disk-tier blocks are referenced, not copied: the disk store is
  persistent by itself and re-verifies and adopts its records when it is opened.

Restoring reads the metadata first and refuses a checkpoint whose fingerprint differs,
naming the fields that differ, or whose metadata lacks a field or holds one of the wrong
kind (``_check_meta``: one line naming the field, never a ``KeyError``). Arrays come
back through host memory (``pinned_host``, replicated over the data axis, kv heads split
over the model axis), so a checkpoint restores onto another mesh shape or device count:
a block saved by old shard ``s`` goes to new shard ``s % new_shards`` (a chain stays on
one shard, so it still matches), into device pages or straight into the host tier
(``into="host"``). Every row is checked against its saved checksum before it is
published; rows that do not fit in the new budget or fail the check are left out and
counted. Stale temporary checkpoint folders of interrupted saves are removed.

With a deployment key (``jaxkv.security``) the checksums are not what proves the bytes
(anyone who can write the checkpoint can fix a checksum up): the metadata carries a keyed
tag over itself (purpose ``checkpoint-meta``) and every saved row one over its bits and
its identity (block key, parent, shard, fingerprint; purpose ``checkpoint-row``) — or,
with ``TierConfig.encryption`` on (the default with a key), every row is saved sealed
(AES-GCM: the files hold no plaintext KV, and no checksum of plain bits either, which
would let a guessed prompt be tested offline) and opened on restore. Restore
refuses metadata that does not verify, or a checkpoint written under another key or none
(its blocks' keys would differ anyway), and leaves out, counted (``failed_mac``), every
row whose tag does not verify. Without a key the checksums catch damage, not forgery.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxkv import buckets
from jaxkv.worker import pages as pages_lib
from jaxkv.worker.tiers.host import on_host
from jaxkv import security
from jaxkv.config import LAYOUT_VERSION
from jaxkv.distributed import to_host
from jaxkv.manager.index import Tier
from jaxkv.worker.tiers.base import Landing
from jaxkv.errors import InputError

FORMAT = 1
# The saved arrays and their rows' metadata, in the order a restore reads them: windows
# saved from host memory before those saved from the device (older: see _keep_windows).
_ARRAYS = (("device", "device_rows"), ("host", "host_rows"),
           ("window_host", "window_host_rows"), ("window", "window_rows"))
_FINGERPRINT_FIELDS = ("model_name", "dtype", "page_size", "num_layers", "num_kv_heads",
                       "head_dim", "weights_digest")


def _manager(directory: str) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(
      os.path.abspath(directory),
      options=ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True,
                                           cleanup_tmp_directories=True))


def latest_step(directory: str) -> int | None:
  """The newest finished checkpoint's step in ``directory``, or None (creates nothing)."""
  if not os.path.isdir(directory):
    return None
  manager = _manager(directory)
  try:
    return manager.latest_step()
  finally:
    manager.close()


def remove_stale_temporaries(directory: str) -> int:
  """Deletes folders an interrupted save left (``*.orbax-checkpoint-tmp*``)."""
  if not os.path.isdir(directory):
    return 0
  n = 0
  for name in os.listdir(directory):
    if ".orbax-checkpoint-tmp" in name:
      shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
      n += 1
  return n


def _config_fields(config) -> dict:
  return {**{f: getattr(config, f) for f in _FINGERPRINT_FIELDS}, "layout": LAYOUT_VERSION}


def _meta_bytes(meta: dict) -> bytes:
  """The metadata as its tag covers it: canonical JSON without the tag itself."""
  return json.dumps({k: v for k, v in meta.items() if k != "mac"}, sort_keys=True,
                    separators=(",", ":")).encode()


def _row_aad(row: list, fingerprint: str) -> bytes:
  """What a saved row claims to be: its shard, block key, parent and the fingerprint."""
  shard, key, parent = row[:3]
  return f"{shard}|{key}|{parent or ''}|{fingerprint}".encode()


def _row_bits(full: np.ndarray, i: int) -> np.ndarray:
  """Row ``i``'s bits (``[arrays, kv_heads, page_size, head_dim]``) of a whole stack."""
  return np.ascontiguousarray(full[:, :, i]).reshape(-1).view(np.uint8)


class Checkpointer:
  """Saves and restores one ``KVCache``; keeps the async save in flight."""

  def __init__(self, cache, directory: str):
    self.cache = cache
    key = cache.deployment_key
    self._meta_seal = security.Seal(key, "checkpoint-meta") if key else None
    self._row_seal = security.Seal(key, "checkpoint-row") if key else None
    self._encrypt = cache.encrypt  # rows sealed (AES-GCM), not only tagged
    self.directory = os.path.abspath(directory)
    self.removed_temporaries = remove_stale_temporaries(self.directory)
    self._manager = None

  # ---- save --------------------------------------------------------------------------------
  def save(self, step: int | None = None, *, wait: bool = True) -> int:
    """Saves the cache as ``step`` (default: one after the latest). With ``wait=False``
    the files are written in the background; call ``wait`` before relying on them."""
    e = self.cache
    e.flush()
    index, c = e.index, e.config
    shards = e.num_shards
    blocks = [(s, p, index.key_of(s, p)) for s in range(shards)
              for p in range(c.pages_per_shard) if index.key_of(s, p) is not None]
    ids, per = buckets.shard_ids(blocks, shards, 0, lambda b: b[1])
    n = ids.shape[1]
    rows = []
    for items in per:
      rows += [(s, key) for s, _, key in items] + [None] * (n - len(items))
    stack = pages_lib.gather_stacked(e.worker.pools, e.put_rows(ids), mesh=e.mesh, config=c)
    sums = pages_lib.checksum_total(pages_lib.page_checksums(stack, mesh=e.mesh, config=c))
    state = {"device": stack}
    meta = {
        "format": FORMAT, "fingerprint": c.fingerprint().hex(), "config": _config_fields(c),
        "device_rows": [self._row(r, sums[i], index) for i, r in enumerate(rows)],
        "disk": e.worker.disk.kvstore if e.worker.disk is not None else None,
    }
    if e.worker.host is not None:
      host = e.worker.host
      # The checksums recorded when each slot was stored (the host pool lives in host
      # memory, where device computations cannot read it); restore checks the saved bytes
      # against them, so a slot corrupted in host memory since is caught there.
      slots = np.tile(np.arange(host.pages_per_shard), (shards, 1))
      host_sums = _stored_sums(host, slots)
      host_rows = []
      for s in range(shards):
        for p in range(host.pages_per_shard):
          key = index.key_of(s, p, Tier.HOST)
          row = s * host.pages_per_shard + p
          host_rows.append(self._row((s, key) if key else None, host_sums[row], index))
      state["host"] = host.stacked()  # the saved layout: [2L, H, rows, S, D]
      meta["host_rows"] = host_rows
    if e.manager.windows is not None:
      state["window"], meta["window_rows"] = self._windows(index)
    if e.worker.window_host is not None:
      state["window_host"], meta["window_host_rows"] = self._host_windows(index)
    meta["arrays"] = {k: {"shape": list(v.shape), "dtype": jnp.dtype(v.dtype).name}
                      for k, v in state.items()}
    if self._meta_seal is not None:
      state = self._protect(meta, state)
    if self._manager is None:
      security.make_private_dir(self.directory)  # rows are KV, and KV is the prompt
      self._manager = _manager(self.directory)
    if step is None:
      latest = self._manager.latest_step()
      step = 0 if latest is None else latest + 1
    self._manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                     meta=ocp.args.JsonSave(meta)))
    if wait:
      self.wait()
    return step

  def _windows(self, index) -> tuple:
    """The kept windows' stack (``[2 * window layers, kv_heads, rows, page_size,
    head_dim]``) and rows, each shard's least recently used first."""
    e = self.cache
    windows, shards = e.manager.windows, e.num_shards
    kept = [(s, page, key) for s in range(shards) for key, page in windows.kept_items(s)]
    ids, per = buckets.shard_ids(kept, shards, 0, lambda b: b[1])
    n = ids.shape[1]
    rows = []
    for items in per:
      rows += [(s, key) for s, _, key in items] + [None] * (n - len(items))
    stack = pages_lib.gather_stacked(e.worker.window_pools, e.put_rows(ids), mesh=e.mesh,
                                     config=e.config)
    sums = pages_lib.checksum_total(pages_lib.page_checksums(stack, mesh=e.mesh,
                                                             config=e.config))
    return stack, [self._row(r, sums[i], index) for i, r in enumerate(rows)]

  def _host_windows(self, index) -> tuple:
    """The windows kept in host memory, as ``_windows``: least recently used first, each
    row with the checksum its bytes had when stored there (a copy altered in host memory
    since is caught at restore, as the host tier's slots are)."""
    e = self.cache
    windows, host, shards = e.manager.windows, e.worker.window_host, e.num_shards
    kept = [(s, slot, key) for s in range(shards) for key, slot in windows.host_items(s)]
    ids, per = buckets.shard_ids(kept, shards, host.pages_per_shard, lambda b: b[1])
    n = ids.shape[1]
    rows = []
    for items in per:
      rows += [(s, key) for s, _, key in items] + [None] * (n - len(items))
    stack, _ = host.load(ids)
    sums = _stored_sums(host, ids)
    return stack, [self._row(r, sums[i], index) for i, r in enumerate(rows)]

  def _protect(self, meta: dict, state: dict) -> dict:
    """The state to save under the deployment key: each saved row sealed (encrypted, one
    ``uint8`` row of ``row bytes + OVERHEAD`` each) or, without encryption, its keyed tag
    (hex) appended to its row; then the metadata tagged."""
    fingerprint = meta["fingerprint"]
    out = dict(state)
    for name, rows_key in _ARRAYS:
      if name not in state:
        continue
      full = to_host(state[name])
      if self._encrypt:
        row_bytes = _row_bits(full, 0).size
        out[name] = sealed = np.zeros((full.shape[2], row_bytes + security.Seal.OVERHEAD),
                                      np.uint8)
      for i, row in enumerate(meta[rows_key]):
        if row is None:
          continue
        aad = _row_aad(row, fingerprint)
        if self._encrypt:
          sealed[i] = np.frombuffer(self._row_seal.seal(aad, _row_bits(full, i)), np.uint8)
          row[3] = None  # a checksum of plain bits would let guesses be tested offline
        else:
          row.append(self._row_seal.tag(aad, _row_bits(full, i)).hex())
    meta["sealed"] = self._encrypt
    meta["key_id"] = self.cache.key_id
    meta["mac"] = self._meta_seal.tag(_meta_bytes(meta)).hex()
    return out

  @staticmethod
  def _row(row, checksum, index):
    if row is None:
      return None
    shard, key = row
    parent = index.parent_of(key)
    return [shard, key.hex(), parent.hex() if parent else None, int(checksum)]

  def wait(self) -> None:
    if self._manager is not None:
      self._manager.wait_until_finished()

  def close(self) -> None:
    if self._manager is not None:
      self._manager.wait_until_finished()
      self._manager.close()
      self._manager = None

  # ---- restore -----------------------------------------------------------------------------
  def restore(self, step: int | None = None, *, into: str = "device") -> dict:
    """Loads a checkpoint into the (empty or not) cache. Returns counts of what came back."""
    if into not in ("device", "host"):
      raise InputError(f"into={into!r} must be 'device' or 'host'.")
    if into == "host" and self.cache.worker.host is None:
      raise InputError("restore(into='host') needs a host tier (TierConfig.host_pages_per_shard"
                       " > 0).")
    if not os.path.isdir(self.directory):
      raise FileNotFoundError(f"no finished checkpoint in {self.directory!r}.")
    manager = _manager(self.directory)
    try:
      step = manager.latest_step() if step is None else step
      if step is None:
        raise FileNotFoundError(f"no finished checkpoint in {self.directory!r}.")
      try:
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
      except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise InputError(f"the metadata of checkpoint {self.directory!r} step {step} is not "
                         f"readable JSON ({type(e).__name__}: {str(e)[:200]}); restore another "
                         "step or start cold.") from None
      _check_meta(meta, f"checkpoint {self.directory!r} step {step}")
      self._check_compatible(meta)
      target = self._restore_target(meta)
      state = manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))["state"]
    finally:
      manager.close()
    window_host = self.cache.worker.window_host
    counts = {"step": step, "placed": 0, "skipped_no_room": 0, "failed_checksum": 0,
              "failed_mac": 0, "windows_kept": 0, "windows_kept_host": 0}
    for name, rows_key in _ARRAYS:
      if name in state:
        saved, rows = state[name], meta[rows_key]
        if self._row_seal is not None:
          saved, rows = self._verified(saved, rows, meta, name, counts)
        if name == "window_host" and window_host is not None:
          self._keep_windows(saved, rows, counts, host=True)
        elif name in ("window", "window_host"):
          self._keep_windows(saved, rows, counts)
        else:
          self._place(saved, rows, into, counts)
    return counts

  def _verified(self, saved, rows: list, meta: dict, name: str, counts: dict):
    """Under a deployment key: the saved array in plain (sealed rows opened into the host
    memory ``_restore_target`` names) and its rows, every row whose tag does not verify
    left out (``None``) and counted as ``failed_mac``."""
    fingerprint = meta["fingerprint"]
    plain = meta["arrays"][name]
    full = (np.zeros(plain["shape"], jnp.dtype(plain["dtype"])) if meta.get("sealed")
            else to_host(saved))
    kept = []
    for i, row in enumerate(rows):
      try:
        if row is None:
          pass
        elif meta.get("sealed"):
          bits = self._row_seal.open(_row_aad(row, fingerprint), np.asarray(saved[i]))
          full[:, :, i] = np.frombuffer(bits, full.dtype).reshape(full[:, :, i].shape)
        else:
          self._row_seal.check(_row_aad(row, fingerprint), _row_bits(full, i),
                               bytes.fromhex(str(row[4])))
      except (security.SealError, ValueError, IndexError):
        counts["failed_mac"] += 1
        row = None
      kept.append(row)
    if meta.get("sealed"):
      sharding = self._host_sharding()
      saved = jax.make_array_from_callback(full.shape, sharding, lambda index: full[index])
    return saved, kept

  def _check_compatible(self, meta: dict) -> None:
    c = self.cache.config
    if meta["fingerprint"] != c.fingerprint().hex():
      mine = _config_fields(c)
      diff = {k: (meta["config"].get(k), mine[k]) for k in mine if meta["config"].get(k) != mine[k]}
      what = ", ".join(f"{k}: checkpoint {a!r} vs this cache {b!r}" for k, (a, b) in diff.items())
      raise InputError(f"checkpoint in {self.directory!r} was written for another model or "
                       f"layout ({what or 'fingerprint differs'}); restore it into a matching "
                       "cache or start cold.")
    self._check_signed(meta)

  def _check_signed(self, meta: dict) -> None:
    """With a deployment key: the metadata's tag verifies under it (else refused)."""
    mine, theirs = self.cache.key_id, meta.get("key_id", "none")
    if self._meta_seal is None:
      if "mac" in meta:
        raise InputError(f"checkpoint in {self.directory!r} was written with deployment key "
                         f"{theirs} and this cache has none; give the same key (its blocks' "
                         "keys depend on it) or start cold.")
      return
    if "mac" not in meta:
      raise InputError(f"checkpoint in {self.directory!r} was written without a deployment "
                       f"key; this cache has key {mine}, so none of its blocks would match: "
                       "start cold, or restore it into a cache without a key.")
    try:
      self._meta_seal.check(_meta_bytes(meta), b"", bytes.fromhex(str(meta["mac"])))
    except (security.SealError, ValueError):
      raise InputError(f"the metadata of checkpoint {self.directory!r} does not verify under "
                       f"deployment key {mine} (written with key {theirs!r}, or altered since "
                       "it was written); restore with the key it was written with, or start "
                       "cold.") from None

  def _host_sharding(self) -> NamedSharding:
    """Saved stacks come back in host memory, rows on every data shard."""
    spec = P(None, self.cache.config.model_axis, None, None, None)
    return NamedSharding(self.cache.mesh, spec).with_memory_kind("pinned_host")

  def _restore_target(self, meta: dict) -> dict:
    if meta.get("sealed"):  # one sealed row of bits per saved row, read whole on every host
      return {k: np.empty((v["shape"][2], int(np.prod(v["shape"])) // v["shape"][2]
                           * jnp.dtype(v["dtype"]).itemsize + security.Seal.OVERHEAD), np.uint8)
              for k, v in meta["arrays"].items()}
    sharding = self._host_sharding()
    return {k: jax.ShapeDtypeStruct(tuple(v["shape"]), jnp.dtype(v["dtype"]), sharding=sharding)
            for k, v in meta["arrays"].items()}

  def _place(self, saved, rows, into: str, counts: dict) -> None:
    e = self.cache
    index, c = e.index, e.config
    shards = e.num_shards
    tier = Tier.DEVICE if into == "device" else Tier.HOST
    wanted = []  # (new shard, saved row, key, parent, checksum)
    for i, row in enumerate(rows):
      if row is None:
        continue
      old_shard, key, parent, checksum = row[:4]
      key = bytes.fromhex(key)
      s = old_shard % shards
      if index.slot_of(s, key, tier) is None:
        wanted.append((s, i, key, bytes.fromhex(parent) if parent else None, checksum))
    if not wanted:
      return
    chosen, n, stack, got = self._rows_on_device(saved, wanted)
    limit = c.pages_per_shard if tier == Tier.DEVICE else e.worker.host.pages_per_shard
    dest = np.full((shards, n), limit, np.int32)  # padding: dropped by the scatter
    publish = []
    for s, items in enumerate(chosen):
      good = []  # (row in the shard's part of the stack, key, parent) of rows that check
      for j, (_, _, key, parent, checksum) in enumerate(items):
        if checksum is not None and int(got[s * n + j]) != checksum:
          counts["failed_checksum"] += 1
        else:
          good.append((j, key, parent))
      for (j, key, parent), slot in zip(good, self._take(s, len(good), tier)):
        if slot is None:
          counts["skipped_no_room"] += 1
          continue
        dest[s, j] = slot
        publish.append((s, slot, key, parent))
    if tier == Tier.DEVICE:
      e.worker.land(Landing(dest, stack))
    else:
      e.worker.host.store(stack, dest)
    for s, slot, key, parent in publish:
      e.manager.copied(s, slot, key, tier, parent=parent)
    counts["placed"] += len(publish)

  def _keep_windows(self, saved, rows, counts: dict, host: bool = False) -> None:
    """Keeps the saved window rows again (a row of old shard ``s`` on ``s % shards``), each
    shard's most recently used ones first to get a page (as many as its window pool can
    give), in their saved order; a row whose bits fail the checksum is left out, counted
    (``failed_checksum``). A window restored without its global block is harmless: a hit
    needs both. ``host``: into the window group's host pool (``windows_kept_host``); a
    cache without one keeps the rows saved from host memory on the device, older than
    those saved from the device (restored first, so those take their pages when short)."""
    e = self.cache
    windows, shards, c = e.manager.windows, e.num_shards, e.config
    per = [[] for _ in range(shards)]  # (saved row, key, checksum), oldest first
    for i, row in enumerate(rows):
      if row is not None:
        per[row[0] % shards].append((i, bytes.fromhex(row[1]), row[3]))
    room = (lambda s: windows.host_slots) if host else windows.available
    per = [items[len(items) - min(len(items), room(s)):] for s, items in enumerate(per)]
    wanted = [(s, *item) for s, items in enumerate(per) for item in items]
    if not wanted:
      return
    chosen, n, stack, got = self._rows_on_device(saved, wanted)
    limit = e.worker.window_host.pages_per_shard if host else c.window_pages_per_shard
    dest = np.full((shards, n), limit, np.int32)  # padding: dropped
    for s, items in enumerate(chosen):
      for j, (_, _, key, checksum) in enumerate(items):
        if checksum is not None and int(got[s * n + j]) != checksum:
          counts["failed_checksum"] += 1
          continue
        # (written at once, below)
        page = windows.keep_host(s, key) if host else windows.keep(s, key, demote=False)
        if page is not None:
          dest[s, j] = page
          counts["windows_kept_host" if host else "windows_kept"] += 1
    if host:
      e.worker.window_host.store(stack, dest)
    else:
      e.worker.land_windows(Landing(dest, stack))

  def _rows_on_device(self, saved, wanted: list) -> tuple:
    """The saved rows ``wanted`` (``(new shard, saved row, ...)`` each) gathered per shard
    onto the device: ``(per-shard items, rows per shard, stack, their checksums)``."""
    e = self.cache
    c = e.config
    src, chosen = buckets.shard_ids(wanted, e.num_shards, 0, lambda w: w[1])
    stack = _host_take(e.mesh, c)(saved, jax.device_put(
        src, NamedSharding(e.mesh, P(c.data_axis, None)).with_memory_kind("pinned_host")))
    got = pages_lib.checksum_total(pages_lib.page_checksums(stack, mesh=e.mesh, config=c))
    return chosen, src.shape[1], stack, got

  def _take(self, shard: int, n: int, tier: Tier) -> list[int | None]:
    """``n`` slots of ``tier`` on ``shard`` for restored rows (None for a row without
    room), what they held carried out first (its bytes go down before the slots are
    written). One ``place`` and one ``carry_out`` for all of them when the shard can give
    them all now; else one row at a time, as many as it can."""
    e = self.cache
    if not n:
      return []
    slots, evicted = e.manager.place(shard, n, tier)
    if slots is not None:
      e.worker.carry_out(evicted)
      return slots
    out = []
    for _ in range(n):
      slot, evicted = e.manager.place(shard, 1, tier)
      if slot is not None:
        e.worker.carry_out(evicted)
      out.append(None if slot is None else slot[0])
    return out


def _check_meta(meta, where: str) -> None:
  """Refuses metadata (as ``save`` writes it) with a field missing or of the wrong kind,
  naming the field: it is read from files anyone with write access to the directory may
  have edited, so nothing past this point meets a missing key or a mistyped value."""
  def refuse(field, value, rule):
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    raise InputError(f"the metadata of {where} has {field}={shown}, which must be {rule}; "
                     "it was not written by jaxkv as it is: restore another step or start "
                     "cold.")

  def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0

  def is_hex(v):
    return isinstance(v, str) and len(v) % 2 == 0 and all(c in "0123456789abcdef" for c in v)

  if not isinstance(meta, dict):
    raise InputError(f"the metadata of {where} is a JSON {type(meta).__name__}, not an object; "
                     "it was not written by jaxkv as it is: restore another step or start cold.")
  if meta.get("format") != FORMAT:  # another version's fields are not these
    raise InputError(f"the metadata of {where} has format {meta.get('format')!r}, not {FORMAT}: "
                     "it was written by another jaxkv version: restore another step or start "
                     "cold.")
  missing = object()
  for field, ok, rule in (
      ("fingerprint", is_hex, "a hex string"),
      ("config", lambda v: isinstance(v, dict), "an object of config fields"),
      ("arrays", lambda v: isinstance(v, dict) and "device" in v
       and set(v) <= {name for name, _ in _ARRAYS},
       "an object naming the device (and host, window, window_host) arrays"),
      ("device_rows", lambda v: isinstance(v, list), "a list of rows")):
    value = meta.get(field, missing)
    if value is missing:
      raise InputError(f"the metadata of {where} has no {field!r}; it was not written by jaxkv "
                       "as it is: restore another step or start cold.")
    if not ok(value):
      refuse(field, value, rule)
  for field, ok, rule in (("sealed", lambda v: isinstance(v, bool), "true or false"),
                          ("key_id", lambda v: isinstance(v, str), "a string"),
                          ("mac", is_hex, "a hex string")):
    if field in meta and not ok(meta[field]):
      refuse(field, meta[field], rule)
  for name, array in meta["arrays"].items():
    shape, dtype = (array.get("shape"), array.get("dtype")) if isinstance(array, dict) else (
        None, None)
    if not (isinstance(shape, list) and len(shape) == 5 and all(is_int(d) for d in shape)):
      refuse(f"arrays.{name}.shape", shape, "5 non-negative integers "
             "[2 x layers, kv heads, rows, page size, head dim]")
    try:
      known = isinstance(dtype, str) and np.dtype(dtype) is not None
    except TypeError:
      known = False
    if not known:
      refuse(f"arrays.{name}.dtype", dtype, "a numpy dtype name")
    rows_key = f"{name}_rows"
    rows = meta.get(rows_key)
    if not isinstance(rows, list) or len(rows) != shape[2]:
      refuse(rows_key, rows, f"a list of the {shape[2]} rows arrays.{name} holds")
    for i, row in enumerate(rows):
      if row is None:
        continue
      if not (isinstance(row, list) and len(row) in (4, 5) and is_int(row[0]) and is_hex(row[1])
              and (row[2] is None or is_hex(row[2])) and (row[3] is None or is_int(row[3]))
              and (len(row) == 4 or is_hex(row[4]))):
        refuse(f"{rows_key}[{i}]", row, "null or [shard, block key (hex), parent key (hex or "
               "null), checksum (or null)] and, under a deployment key, a tag (hex)")


def _stored_sums(host, ids: np.ndarray) -> np.ndarray:
  """The checksum each of a host pool's slots ``ids`` (``[shards, n]``) had when stored, one
  per saved row (summed over the model axis, as ``pages.checksum_total`` sums a stack's)."""
  return host.expected_checksums(ids).astype(np.uint64).sum(axis=-1).astype(
      np.uint32).reshape(-1)


@functools.lru_cache(maxsize=None)
def _host_take(mesh, config):
  """Rows of a host-resident, data-replicated stack, per data shard, onto device."""
  full = P(None, config.model_axis, None, None, None)
  ids = P(config.data_axis, None)
  stacked = pages_lib.stacked_spec(config)

  def local(saved, rows):
    return saved[:, :, rows[0]]

  take = jax.shard_map(local, mesh=mesh, in_specs=(full, ids), out_specs=stacked)

  def run(saved, rows):
    part = on_host(take)(saved, rows)
    return jax.device_put(part, NamedSharding(mesh, stacked))

  return jax.jit(run)
