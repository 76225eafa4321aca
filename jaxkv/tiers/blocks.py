"""The self-describing record a block is stored as outside device memory.

A record is ``header || payload``. The payload is the block's K and V for every layer,
``[2 * num_layers, kv_heads, page_size, head_dim]`` in the cache dtype, little-endian
(layer-major, K then V). The fixed-size header says what the payload is and proves it:

  magic "JAXKVBK1" | format version u32 | dtype code u32 | shape 4 x u32 | payload bytes u64
  | block key (32) | parent key (32, zeros for a first block) | model/layout fingerprint (32)
  | CRC-32C of the payload (u32, then 28 zero bytes) | zero pad

The block key (a SHA-256 chain, ``jaxkv.index``) names what the block *is*; the CRC-32C
proves the bytes arrived as written (accidental damage: flipped bits, torn or swapped
records). It is checked on every read, so it must cost little next to the read itself:
CRC-32C runs at ~7.5 GB/s here against ~0.8 GB/s for SHA-256 (``google_crc32c``, measured on
the development machine). Integrity against a party who can write the store is not this
header's job: such a party can write a valid record with any bytes (see BUILD.md, threat model).

``decode`` checks every field against what the reader expects, so a flipped bit, a
truncated or missing record, two records swapped, or a record of another tenant or model
put in place is rejected (``BlockError`` names the reason) and never used.
"""

from __future__ import annotations

import struct

import google_crc32c

import jax.numpy as jnp
import numpy as np

from jaxkv.config import SUPPORTED_DTYPES
from jaxkv.tiers.base import Failure
from jaxkv.errors import InputError, InvariantError

MAGIC = b"JAXKVBK1"
FORMAT_VERSION = 2  # 2: CRC-32C of the payload (1: SHA-256)
HEADER_BYTES = 192
_FIXED = struct.Struct("<8sII4IQ32s32s32s32s")  # 8+4+4+16+8+128 = 168 bytes
NO_PARENT = b"\x00" * 32


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


def _crc(data: np.ndarray) -> bytes:
  """The 32-byte checksum field: CRC-32C of ``data`` (little-endian u32), zero padded."""
  return google_crc32c.value(data).to_bytes(4, "little") + bytes(28)


def record_bytes(payload_shape, dtype) -> int:
  return HEADER_BYTES + int(np.prod(payload_shape)) * jnp.dtype(dtype).itemsize


def encode(payload: np.ndarray, key: bytes, fingerprint: bytes,
           parent: bytes | None = None) -> np.ndarray:
  """Returns the record (uint8) for one block's payload."""
  data = np.ascontiguousarray(payload).view(np.uint8).reshape(-1)
  if payload.dtype.byteorder == ">":
    raise InvariantError("payload must be little-endian (jaxkv builds it so).")
  header = _FIXED.pack(MAGIC, FORMAT_VERSION, _dtype_code(payload.dtype), *payload.shape,
                       data.size, key, parent or NO_PARENT, fingerprint, _crc(data))
  out = np.zeros(HEADER_BYTES + data.size, np.uint8)
  out[:len(header)] = np.frombuffer(header, np.uint8)
  out[HEADER_BYTES:] = data
  return out


def decode(record: np.ndarray, *, key: bytes | None, fingerprint: bytes, dtype, shape
           ) -> np.ndarray:
  """Verifies a record and returns its payload as ``dtype[shape]`` (raises BlockError).

  ``key=None`` accepts any key (a scan that learns keys from headers); use
  ``header_keys`` to read them.
  """
  record = np.asarray(record)
  expect_bytes = record_bytes(shape, dtype)
  if record.dtype != np.uint8 or record.size != expect_bytes:
    raise BlockError("size", f"record has {record.size} bytes, expected {expect_bytes}")
  magic, version, code, s0, s1, s2, s3, nbytes, k, _, fp, digest = _FIXED.unpack(
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
  if nbytes != data.size or _crc(data) != digest:
    raise BlockError("checksum", "payload bytes do not match their CRC-32C")
  return data.view(jnp.dtype(dtype)).reshape(shape)


def header_keys(record: np.ndarray) -> tuple[bytes, bytes | None]:
  """``(key, parent)`` from a record's header (unverified: call ``decode`` too)."""
  fields = _FIXED.unpack(np.asarray(record)[:_FIXED.size].tobytes())
  key, parent = fields[8], fields[9]
  return key, (None if parent == NO_PARENT else parent)
