"""The deployment key, and everything jaxkv proves or hides with it.

What the key does (threat model: BUILD.md, "Threat model"):
- **Names.** A block key is a SHA-256 chain over a prompt's tokens from a per-tenant root
  (``jaxkv.manager.index``); with a key the tenant's salt is ``HMAC-SHA256(key, tenant)``, so
  record names and ``lookup``s mean nothing to whoever lacks it.
- **Integrity.** What crosses a process boundary — a disk or object-store record, a remote
  answer and its blocks, a checkpoint's metadata and rows — carries a keyed tag over its
  bytes and its identity (block key, fingerprint, format), under a *purpose* label
  (``Seal``): a tag made for one purpose or direction never verifies for another.
- **Confidentiality.** With ``TierConfig.encryption`` on (the default when a key is set)
  the blocks themselves are sealed with AES-256-GCM (an AEAD: the same tag proves them), so
  the store's files and the remote wire hold no plaintext KV. KV *is* the prompt: layer-0
  values are a function of the token id, so with public weights a table over the
  vocabulary reads plaintext KV back into the prompt.
- **Peers.** The block server answers only requests MACed with the key over its challenge.

Without a key none of this holds: records and answers carry a CRC-32C (damage, not
forgery), and jaxkv says so once at start-up (``warn_insecure``).

The key is at least 32 random bytes. In code it is given as ``bytes`` (raw) or ``str``
(hex or base64 text); from a file (``--deployment_key_file`` / ``JAXKV_DEPLOYMENT_KEY_FILE``,
readable by its owner only) or the environment (``JAXKV_DEPLOYMENT_KEY``) it is hex or
base64 text, e.g. ``head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE``. It is never
logged or written out (only ``key_id``, a short one-way digest). Every process that shares
a store or talks to a peer uses the same key; different keys share nothing.

AES-GCM takes a random 96-bit nonce per seal; keys are derived per purpose, so the usual
bound (2**32 seals per key) applies to each purpose separately: rotate the deployment key
well before that many blocks were written under it.
"""

from __future__ import annotations

import base64
import binascii
import errno
import hashlib
import hmac
import ipaddress
import os
import re
import stat

from absl import logging
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from jaxkv.errors import InputError

ENV_KEY = "JAXKV_DEPLOYMENT_KEY"
ENV_FILE = "JAXKV_DEPLOYMENT_KEY_FILE"
MIN_BYTES = 32
_MIN_DISTINCT = 12  # 32 random bytes have ~30 distinct values; "aaaa..." has 1
_HOW = "e.g. `head -c 32 /dev/urandom | base64 > FILE; chmod 600 FILE`"
_HEX = re.compile(r"(?:[0-9a-fA-F]{2})+")


def _checked(key: bytes, where: str) -> bytes:
  if len(key) < MIN_BYTES:
    raise InputError(f"the deployment key from {where} has {len(key)} bytes; it needs at least "
                     f"{MIN_BYTES} random bytes ({_HOW}).")
  if len(set(key)) < _MIN_DISTINCT:
    raise InputError(f"the deployment key from {where} has only {len(set(key))} distinct byte "
                     f"values: it is not random; make one with {_HOW}.")
  return key


def parse_key_text(text: str, where: str) -> bytes:
  """The key bytes a hex or base64 text stands for (surrounding whitespace ignored)."""
  text = text.strip()
  if _HEX.fullmatch(text):
    return _checked(bytes.fromhex(text), where)
  try:
    key = base64.b64decode(text.replace("-", "+").replace("_", "/"), validate=True)
  except (binascii.Error, ValueError):
    raise InputError(f"the deployment key from {where} is neither hex nor base64 text; give "
                     f"{MIN_BYTES}+ random bytes encoded as either ({_HOW}).") from None
  return _checked(key, where)


def load_deployment_key(path: str | None = None, environ=None) -> bytes | None:
  """The deployment key from ``path``, else ``$JAXKV_DEPLOYMENT_KEY_FILE``, else
  ``$JAXKV_DEPLOYMENT_KEY``; None when none is given. A key file readable or writable by
  group or others is refused (``chmod 600``)."""
  environ = os.environ if environ is None else environ
  path = path or environ.get(ENV_FILE)
  if path:
    try:
      with open(path, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        data = f.read()
    except OSError as e:
      raise InputError(f"deployment key file {path!r} cannot be read ({e.strerror}); give a "
                       "readable file holding the key.") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
      raise InputError(f"deployment key file {path!r} has mode {stat.S_IMODE(mode):04o}: group "
                       f"or others can reach it; run `chmod 600 {path}`.")
    try:
      text = data.decode("ascii")
    except UnicodeDecodeError:
      raise InputError(f"deployment key file {path!r} is not text; store the key as hex or "
                       f"base64 ({_HOW}).") from None
    return parse_key_text(text, f"file {path!r}")
  value = environ.get(ENV_KEY)
  if value:
    return parse_key_text(value, f"${ENV_KEY}")
  return None


def check_key(key) -> bytes | None:
  """``key`` as bytes, validated: ``bytes`` are the raw key, ``str`` is hex or base64
  text; None stays None."""
  if key is None:
    return None
  if isinstance(key, str):
    return parse_key_text(key, "the caller")
  if not isinstance(key, bytes):
    raise InputError(f"deployment_key must be bytes or str, got {type(key).__name__}.")
  return _checked(key, "the caller")


def key_id(key: bytes | None) -> str:
  """A short public name of a key (to tell in logs which key a process has)."""
  if key is None:
    return "none"
  return hashlib.sha256(b"jaxkv-key-id\x00" + key).hexdigest()[:12]


def tenant_salt(tenant: str, key: bytes | None) -> bytes:
  """The salt a tenant's key chains start from: keyed when a deployment key is given."""
  data = b"jaxkv-tenant\x00" + tenant.encode("utf-8")
  if key is None:
    return hashlib.sha256(data).digest()
  return hmac.new(key, data, hashlib.sha256).digest()


def routing_tokens(salt: bytes, tokens) -> list[int]:
  """A tenant's token ids as its KV events tell them and its router asks for them: each id,
  with its position in the sequence, mapped through AES-256 (one block per token: a keyed
  permutation of (id, position)) under a key derived from the tenant's salt
  (``tenant_salt``), to a 32-bit id. ``tokens`` start at position 0 (a prompt's first token),
  as both the events and the router map them.

  Why: a KV indexer matches requests to replicas by token ids, and knows no tenants. With
  raw ids one tenant's request would be scored against every tenant's blocks, and the
  router's choice would tell it which prompts another tenant sent. Mapped ids of two
  tenants (or two ``cache_salt``s) share nothing, so a tenant's query can only ever match its
  own blocks; the same prefix maps to the same ids, so the indexer's block-wise matching
  works unchanged, and since the position is mapped too, a reader of the events does not see
  which tokens repeat (no substitution table to solve). With a deployment key the salt is secret and no one without the
  key can compute another tenant's ids; without one, salts follow from tenant names
  (BUILD.md, "Threat model")."""
  import numpy as np
  from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
  ids = np.asarray(tokens, dtype=np.int64)
  if ids.size and (ids.min() < 0 or ids.max() >= 1 << 32):
    raise InputError("routing_tokens: token ids must be in [0, 2**32).")
  key = hashlib.sha256(b"jaxkv-routing-tokens\x00" + salt).digest()
  blocks = np.zeros((ids.size, 4), np.uint32)
  blocks[:, 0] = ids.astype(np.uint32)
  blocks[:, 1] = np.arange(ids.size, dtype=np.uint32)
  enc = Cipher(algorithms.AES(key), modes.ECB()).encryptor()
  out = np.frombuffer(enc.update(blocks.tobytes()) + enc.finalize(), np.uint32)
  return out.reshape(-1, 4)[:, 0].tolist()


def challenge_mac(key: bytes, challenge: str, payload: bytes) -> str:
  """The MAC a peer sends with a request: over the server's per-connection challenge and
  the request's bytes, so it proves the key and cannot be replayed on another connection."""
  return hmac.new(key, challenge.encode("ascii") + b"\x00" + payload, hashlib.sha256).hexdigest()


def mac_ok(key: bytes, challenge: str, payload: bytes, mac) -> bool:
  return isinstance(mac, str) and hmac.compare_digest(challenge_mac(key, challenge, payload), mac)


# ---- sealing: keyed tags and AEAD over bytes, one derived key per purpose ---------------------
class SealError(ValueError):
  """Bytes whose tag does not verify under this key and purpose (forged, damaged, another
  key's, or sealed for another purpose)."""


PURPOSES = ("disk-record", "remote-answer", "checkpoint-meta", "checkpoint-row", "pool-value")


class Seal:
  """Tags and seals bytes for one ``purpose`` under a deployment key (AES-256-GCM with a
  key derived for that purpose; the purpose is also in every tag's associated data).

  ``tag(aad, data)`` -> ``TAG_BYTES`` bytes that prove ``aad || data`` (integrity only;
  ``data`` stays readable); ``seal(aad, data)`` -> ``data`` encrypted, ``OVERHEAD`` bytes
  longer, proving ``aad`` too. ``check``/``open`` raise ``SealError`` on any mismatch.
  ``aad`` is what the bytes claim to be (block key, fingerprint, format, header)."""

  NONCE_BYTES = 12
  TAG_BYTES = 12 + 16  # nonce, GCM tag
  OVERHEAD = 12 + 16

  def __init__(self, key: bytes, purpose: str):
    if purpose not in PURPOSES:
      raise ValueError(f"purpose {purpose!r} is not one of {PURPOSES}")
    derived = hmac.new(key, b"jaxkv-seal\x00" + purpose.encode(), hashlib.sha256).digest()
    self.purpose = purpose
    self._label = b"jaxkv/" + purpose.encode() + b"\x00"
    self._aead = AESGCM(derived)

  def tag(self, aad: bytes, data=b"") -> bytes:
    nonce = os.urandom(self.NONCE_BYTES)
    return nonce + self._aead.encrypt(nonce, b"", b"".join((self._label, aad, data)))

  def check(self, aad: bytes, data, tag: bytes) -> None:
    tag = bytes(tag)
    if len(tag) != self.TAG_BYTES:
      raise SealError(f"a {self.purpose} tag has {self.TAG_BYTES} bytes, not {len(tag)}")
    try:
      self._aead.decrypt(tag[:self.NONCE_BYTES], tag[self.NONCE_BYTES:],
                         b"".join((self._label, aad, data)))
    except InvalidTag:
      raise SealError(f"the {self.purpose} tag does not verify: forged, damaged, or made "
                      "with another deployment key") from None

  def seal(self, aad: bytes, data) -> bytes:
    nonce = os.urandom(self.NONCE_BYTES)
    return nonce + self._aead.encrypt(nonce, data, self._label + aad)

  def open(self, aad: bytes, sealed) -> bytes:
    sealed = memoryview(sealed).cast("B")
    if len(sealed) < self.OVERHEAD:
      raise SealError(f"sealed {self.purpose} bytes are shorter than their nonce and tag")
    try:
      return self._aead.decrypt(bytes(sealed[:self.NONCE_BYTES]), sealed[self.NONCE_BYTES:],
                                self._label + aad)
    except InvalidTag:
      raise SealError(f"the sealed {self.purpose} bytes do not verify: forged, damaged, or "
                      "sealed with another deployment key") from None


PRIVATE_DIR_MODE = 0o700
# Opens a directory, never through a symbolic link at the name itself (ELOOP instead).
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_private_dir(name: str, *, dir_fd: int | None = None, where: str | None = None,
                     fix: str = "", create: bool = True) -> int:
  """Opens directory ``name`` (relative to ``dir_fd`` if given) and returns its descriptor,
  making it first (mode 0700 whatever the umask) if it is missing and ``create`` is set
  (else a missing one raises ``FileNotFoundError``). A symbolic link at
  ``name`` is never followed: it is refused (``InputError`` naming ``where``, the path for
  messages, and ``fix``), and so is anything else that is not a directory. Links in the
  components above ``name`` are followed (they are the operator's). An existing directory
  keeps the mode its owner gave it.

  Race-free: the check is the open itself (``O_NOFOLLOW``), so a name swapped for a link
  after any earlier look cannot be followed; a descriptor opened from descriptors this way
  names the directory that was checked, whatever is renamed later."""
  name = name.rstrip("/") or "/"  # a trailing slash would make the kernel follow a link
  where = (where or name).rstrip("/") or "/"
  made = False
  if create:
    try:
      os.mkdir(name, PRIVATE_DIR_MODE, dir_fd=dir_fd)
      made = True
    except FileExistsError:
      pass  # there already (or made meanwhile by another process): checked by the open
  try:
    fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
  except OSError as e:
    if e.errno not in (errno.ELOOP, errno.ENOTDIR):
      raise
    try:
      mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
      target = os.readlink(name, dir_fd=dir_fd) if stat.S_ISLNK(mode) else None
    except OSError:
      raise e from None  # a loop in the components above, or swapped again meanwhile
    if target is not None:
      raise InputError(
          f"{where!r} is a symbolic link (to {target!r}): jaxkv follows no link where it keeps "
          f"KV (a link would send its reads and deletes elsewhere); {fix or 'remove the link'}."
      ) from None
    raise InputError(f"{where!r} is not a directory; {fix or 'remove it'}.") from None
  if made:
    os.fchmod(fd, PRIVATE_DIR_MODE)  # the umask may have taken bits (and fchmod follows nothing)
  return fd


def make_private_dir(path: str, *, fix: str | None = None) -> None:
  """Creates directory ``path`` (and missing parents) unless it exists. The directory made
  is 0700 whatever the umask (what it will hold is KV, and KV is the prompt); an existing
  one keeps the mode its owner gave it. A symbolic link at ``path`` itself is refused
  (``InputError``), never followed: give the directory it points to (``fix`` says so,
  else the message suggests the link's real path); so is a file."""
  path = path.rstrip("/") or "/"
  parent = os.path.dirname(path)
  if parent:
    os.makedirs(parent, exist_ok=True)
  if fix is None:
    fix = f"give the directory itself ({os.path.realpath(path)!r})"
  os.close(open_private_dir(path, fix=fix))


def is_loopback(host: str) -> bool:
  """Whether ``host`` (an address or "localhost") reaches this machine only."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False  # a name or a wildcard such as "*": other machines may reach it


_warned: set = set()


def warn_insecure(what: str, fix: str) -> None:
  """One warning line, once per process, for an insecure setup: what, and the fix."""
  line = f"INSECURE: {what}; {fix}"
  if line not in _warned:
    _warned.add(line)
    logging.warning("%s", line)
