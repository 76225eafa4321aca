"""The deployment key: what makes block keys and the remote tier reveal nothing to outsiders.

A block key is a SHA-256 chain over a prompt's tokens from a per-tenant root
(``jaxkv.index``). Without a secret in that root, anyone who knows a tenant's name and can
guess a prompt computes its keys, and then a record's name in a shared store, or a
``lookup`` answered by a block server, tells them whether that prompt was served (and a
pull gives them its KV). With a deployment key the tenant's salt is
``HMAC-SHA256(key, tenant)``: keys, record names and lookups are meaningless to whoever
lacks it. The same key authenticates the remote tier's peers (``challenge_mac``).

The key comes from, in order: the value passed in code, a file
(``--deployment_key_file`` / ``JAXKV_DEPLOYMENT_KEY_FILE``), the environment
(``JAXKV_DEPLOYMENT_KEY``). It is at least 16 bytes; it is never logged or written into a
config, a checkpoint or a JSON output (only ``key_id``, a short one-way digest, is).
Every process that shares a store or talks to a peer must use the same key; different
keys simply share nothing. Threat model: BUILD.md, "Sharing a store".
"""

from __future__ import annotations

import hashlib
import hmac
import os

from jaxkv.errors import InputError

ENV_KEY = "JAXKV_DEPLOYMENT_KEY"
ENV_FILE = "JAXKV_DEPLOYMENT_KEY_FILE"
MIN_BYTES = 16


def _checked(key: bytes, where: str) -> bytes:
  if len(key) < MIN_BYTES:
    raise InputError(f"the deployment key from {where} has {len(key)} bytes; it needs at least "
                     f"{MIN_BYTES} (e.g. `head -c 32 /dev/urandom | base64 > FILE`).")
  return key


def load_deployment_key(path: str | None = None, environ=None) -> bytes | None:
  """The deployment key from ``path``, else ``$JAXKV_DEPLOYMENT_KEY_FILE``, else
  ``$JAXKV_DEPLOYMENT_KEY``; None when none is given. A file's trailing newline is
  not part of the key."""
  environ = os.environ if environ is None else environ
  path = path or environ.get(ENV_FILE)
  if path:
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError as e:
      raise InputError(f"deployment key file {path!r} cannot be read ({e.strerror}); give a "
                       "readable file holding the key.") from None
    return _checked(data.rstrip(b"\r\n"), f"file {path!r}")
  value = environ.get(ENV_KEY)
  if value:
    return _checked(value.encode("utf-8"), f"${ENV_KEY}")
  return None


def check_key(key) -> bytes | None:
  """``key`` as bytes (str is taken as UTF-8), validated; None stays None."""
  if key is None:
    return None
  if isinstance(key, str):
    key = key.encode("utf-8")
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


def challenge_mac(key: bytes, challenge: str, payload: bytes) -> str:
  """The MAC a peer sends with a request: over the server's per-connection challenge and
  the request's bytes, so it proves the key and cannot be replayed on another connection."""
  return hmac.new(key, challenge.encode("ascii") + b"\x00" + payload, hashlib.sha256).hexdigest()


def mac_ok(key: bytes, challenge: str, payload: bytes, mac) -> bool:
  return isinstance(mac, str) and hmac.compare_digest(challenge_mac(key, challenge, payload), mac)
