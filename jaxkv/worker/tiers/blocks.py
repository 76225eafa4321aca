"""The self-describing record a block is stored as outside device memory.

A record is ``header || payload``. The payload is the block's K and V for every layer,
``[2 * num_layers, kv_heads, page_size, head_dim]`` in the cache dtype, little-endian
(layer-major, K then V), or those bytes encrypted. The fixed-size header (192 bytes) says
what the payload is and proves it:

  magic "JAXKVBK1" | format version u32 | dtype code u32 | shape 4 x u32 | payload bytes u64
  | block key (32) | parent key (32, zeros for a first block) | model/layout fingerprint (32)
  | protection u32 | proof (28) | zero pad

The block key (a SHA-256 chain, ``jaxkv.manager.index``) names what the block *is*; the proof
says the bytes are the ones written. ``protection`` says which proof a record carries, one
of three, all records of one layout the same size:

- ``CRC`` (no deployment key): the CRC-32C of the payload (u32, then zeros). It catches
  accidents (flipped bits, torn or swapped records), not forgery: the CRC is linear and
  unkeyed, so whoever can write the store can write a valid record with any bytes.
- ``MAC`` (a key, ``TierConfig.encryption="off"``): an AES-GCM tag (``security.Seal``,
  purpose "disk-record": a 12-byte nonce, then the 16-byte tag) over the whole header (the
  proof field zeroed: block key, parent, fingerprint, format, dtype, shape, protection) and
  the payload. Only a holder of the key can make one; the payload stays readable.
- ``AEAD`` (a key, encryption on): the payload is AES-256-GCM ciphertext with the header as
  associated data (the proof holds the nonce and tag), so the store's files hold no
  plaintext KV. KV *is* the prompt: layer-0 values are a function of the token id.

A reader with a key accepts ``MAC`` and ``AEAD`` records (both prove the key; the writer's
encryption setting is its own) and refuses ``CRC`` ones; a reader without a key accepts
``CRC`` only. A record of the other kind is refused (``Failure.MODE``), never misread.

Checked on every read, the proof must cost little next to the read itself: CRC-32C runs at
~8-20 GB/s here, AES-GCM's tag at ~7-15 GB/s and its decryption at ~8 GB/s on records of
256 KiB-4 MiB (``google_crc32c``, ``cryptography`` with AES-NI; the development machine).

``decode`` checks every field against what the reader expects, so a flipped bit, a
truncated or missing record, two records swapped, a record of another tenant or model put
in place, or (with a key) a forged one is rejected (``BlockError`` names the reason) and
never used.
"""

from __future__ import annotations

import enum
import struct

import google_crc32c

import jax.numpy as jnp
import numpy as np

from jaxkv.config import SUPPORTED_DTYPES
from jaxkv.errors import InputError, InvariantError
from jaxkv.security import Seal, SealError
from jaxkv.worker.tiers.base import Failure

MAGIC = b"JAXKVBK1"
FORMAT_VERSION = 3  # 3: protection field, keyed tags (2: CRC-32C only; 1: SHA-256)
HEADER_BYTES = 192
# magic, version, dtype, shape, payload bytes, key, parent, fingerprint, protection, proof
_FIXED = struct.Struct("<8sII4IQ32s32s32sI28s")  # 8+4+4+16+8+96+4+28 = 168 bytes
_PROOF_AT = _FIXED.size - 28
PEEK_BYTES = 12  # magic and version: enough to tell a record's format (``peek_version``)
NO_PARENT = b"\x00" * 32
_NONCE = Seal.NONCE_BYTES
assert Seal.TAG_BYTES == 28 and Seal.OVERHEAD == 28, "the proof field holds a nonce and tag"


class Protection(enum.IntEnum):
  """What proves a record's bytes (the header's ``protection`` field)."""

  CRC = 0  # CRC-32C of the payload: accidents only
  MAC = 1  # keyed AES-GCM tag over header and payload
  AEAD = 2  # payload encrypted, header as associated data


class BlockError(ValueError):
  """A stored block failed verification; ``reason`` says how (a ``base.Failure``)."""

  def __init__(self, reason: str, detail: str):
    super().__init__(f"{reason}: {detail}")
    self.reason = Failure(reason)


def _dtype_code(dtype) -> int:
  name = jnp.dtype(dtype).name
  if name not in SUPPORTED_DTYPES:
    raise InputError(f"dtype {name} is not one of {SUPPORTED_DTYPES}.")
  return SUPPORTED_DTYPES.index(name)


def _crc(data) -> bytes:
  """The proof of a ``CRC`` record: CRC-32C of ``data`` (little-endian u32), zero padded."""
  return google_crc32c.value(data).to_bytes(4, "little") + bytes(24)


def record_bytes(payload_shape, dtype) -> int:
  return HEADER_BYTES + int(np.prod(payload_shape)) * jnp.dtype(dtype).itemsize


def peek_version(head) -> int | None:
  """The format version the first ``PEEK_BYTES`` of a record claim; None when they are not
  a jaxkv record's (to tell a record of another format from junk without reading it)."""
  head = bytes(head[:PEEK_BYTES])
  if len(head) < PEEK_BYTES or head[:8] != MAGIC:
    return None
  return int.from_bytes(head[8:12], "little")


def _header(version, code, shape, nbytes, key, parent, fingerprint, protection,
            proof=bytes(28)) -> bytes:
  """The header's bytes (``HEADER_BYTES``); with a zero proof, what a keyed proof covers."""
  return _FIXED.pack(MAGIC, version, code, *shape, nbytes, key, parent, fingerprint,
                     protection, proof).ljust(HEADER_BYTES, b"\x00")


def encode(payload: np.ndarray, key: bytes, fingerprint: bytes, parent: bytes | None = None,
           *, seal: Seal | None = None, encrypt: bool = False) -> np.ndarray:
  """Returns the record (uint8) for one block's payload: ``CRC`` without ``seal``, else
  ``MAC``, or ``AEAD`` with ``encrypt``."""
  data = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
  if payload.dtype.byteorder == ">":
    raise InvariantError("payload must be little-endian (jaxkv builds it so).")
  if encrypt and seal is None:
    raise InvariantError("an encrypted record needs a seal (a deployment key).")
  protection = (Protection.CRC if seal is None
                else Protection.AEAD if encrypt else Protection.MAC)
  fields = (FORMAT_VERSION, _dtype_code(payload.dtype), payload.shape, data.size, key,
            parent or NO_PARENT, fingerprint, protection)
  out = np.empty(HEADER_BYTES + data.size, np.uint8)
  if protection == Protection.CRC:
    header = _header(*fields, proof=_crc(data))
    out[HEADER_BYTES:] = data
  elif protection == Protection.MAC:
    header = _header(*fields, proof=seal.tag(_header(*fields), data))
    out[HEADER_BYTES:] = data
  else:
    sealed = np.frombuffer(seal.seal(_header(*fields), data), np.uint8)  # nonce|cipher|tag
    header = _header(*fields, proof=sealed[:_NONCE].tobytes() + sealed[-16:].tobytes())
    out[HEADER_BYTES:] = sealed[_NONCE:-16]
  out[:HEADER_BYTES] = np.frombuffer(header, np.uint8)
  return out


def decode(record: np.ndarray, *, key: bytes | None, fingerprint: bytes, dtype, shape,
           seal: Seal | None = None) -> np.ndarray:
  """Verifies a record and returns its payload as ``dtype[shape]`` (raises BlockError).

  ``key=None`` accepts any key (a scan that learns keys from headers); use
  ``header_keys`` to read them. ``seal`` is the reader's key (None: keyless): it decides
  which protections are accepted (module docstring).
  """
  record = np.asarray(record)
  expect_bytes = record_bytes(shape, dtype)
  if record.dtype != np.uint8 or record.size != expect_bytes:
    raise BlockError("size", f"record has {record.size} bytes, expected {expect_bytes}")
  magic, version, code, s0, s1, s2, s3, nbytes, k, _, fp, protection, proof = _FIXED.unpack(
      record[:_FIXED.size].tobytes())
  if magic != MAGIC:
    raise BlockError("magic", "not a jaxkv block (missing, truncated or foreign)")
  if version != FORMAT_VERSION:
    raise BlockError("version", f"format {version}, this reader knows {FORMAT_VERSION}")
  if fp != fingerprint:
    raise BlockError("fingerprint", "written by another model, dtype or page layout")
  if key is not None and k != key:
    raise BlockError("key", "holds another block (swapped, stale or another tenant's)")
  if code != _dtype_code(dtype) or (s0, s1, s2, s3) != tuple(shape):
    raise BlockError("shape", f"holds {SUPPORTED_DTYPES[code] if code < 3 else code}"
                     f"{[s0, s1, s2, s3]}, expected {jnp.dtype(dtype).name}{list(shape)}")
  data = record[HEADER_BYTES:]
  if nbytes != data.size:
    raise BlockError("checksum", f"header says {nbytes} payload bytes, record has {data.size}")
  if seal is None:
    if protection != Protection.CRC:
      raise BlockError("mode", "the record is tagged with a deployment key and this reader "
                       "has none (give it the key its writers have)")
    if _crc(data) != proof:
      raise BlockError("checksum", "payload bytes do not match their CRC-32C")
    return data.view(jnp.dtype(dtype)).reshape(shape)
  if protection not in (Protection.MAC, Protection.AEAD):
    kind = Protection(protection).name if protection in iter(Protection) else protection
    raise BlockError("mode", f"the record's protection is {kind}, not a keyed tag: anyone can "
                     "write that, so a reader with a deployment key refuses it")
  header = record[:HEADER_BYTES].tobytes()
  aad = header[:_PROOF_AT] + bytes(28) + header[_PROOF_AT + 28:]  # what the proof covers
  try:
    if protection == Protection.MAC:
      seal.check(aad, data, proof)
      return data.view(jnp.dtype(dtype)).reshape(shape)
    plain = seal.open(aad, b"".join((proof[:_NONCE], data, proof[_NONCE:])))
  except SealError as e:
    raise BlockError("mac", str(e)) from None
  return np.frombuffer(plain, jnp.dtype(dtype)).reshape(shape)


def header_keys(record: np.ndarray) -> tuple[bytes, bytes | None]:
  """``(key, parent)`` from a record's header (unverified: call ``decode`` too)."""
  fields = _FIXED.unpack(np.asarray(record)[:_FIXED.size].tobytes())
  key, parent = fields[8], fields[9]
  return key, (None if parent == NO_PARENT else parent)
