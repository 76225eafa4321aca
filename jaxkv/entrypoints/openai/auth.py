"""API keys: who a request is, checked the same way at every front door.

A deployment's keys file (``--api_keys_file``, read by ``launch/_common.load_api_keys``:
JAX-free, before a launcher starts JAX) is a JSON object ``{"<api key>": "<tenant>"}``,
readable by its owner only, each key 16 characters or more. The API server and the router
read the same file: a request's tenant is decided by the first process it
reaches, before that process does anything on the request's behalf (the router asks its
indexer nothing, chooses no replica, for a caller without a key).

Keys are kept by SHA-256 digest: a lookup takes no time that depends on how much of a guessed
key matches a real one, and the keys themselves are not kept in memory.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from jaxkv.entrypoints.openai.protocol import TENANT_SEPARATOR, ApiError
from jaxkv.errors import InputError

def key_digest(key: str) -> bytes:
  return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
  """``{key: tenant}`` kept by digest; ``tenant(authorization)`` names a request's tenant.
  ``None`` keys (no keys file): every request is tenant ``"default"``."""

  def __init__(self, api_keys: Mapping[str, str] | None):
    self.digests = {key_digest(k): t for k, t in api_keys.items()} if api_keys else None
    for tenant in (self.digests or {}).values():
      if not isinstance(tenant, str) or not tenant or TENANT_SEPARATOR in tenant:
        raise InputError(f"tenant {tenant!r} in the API keys must be a non-empty string "
                         "without control characters.")

  @property
  def on(self) -> bool:
    return self.digests is not None

  @property
  def tenants(self) -> frozenset[str]:
    return frozenset((self.digests or {}).values())

  def tenant(self, authorization: str | None) -> str:
    """The tenant of ``Authorization: Bearer <key>``; ``ApiError`` 401 without a valid key."""
    if self.digests is None:
      return "default"
    auth = authorization or ""
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    tenant = self.digests.get(key_digest(key)) if key else None
    if tenant is None:
      raise ApiError(401, "a valid API key is required: send 'Authorization: Bearer <key>'.",
                     "authentication_error", code="invalid_api_key")
    return tenant

  def check_metrics_tenants(self, tenants) -> frozenset[str]:
    """``tenants`` (who may read a front's counters) as a set, refused when one has no key."""
    tenants = frozenset(tenants)
    unknown = tenants - self.tenants
    if unknown:
      raise InputError(f"metrics tenants {sorted(unknown)} have no API key; name tenants of "
                       "the API keys file.")
    return tenants

  def metrics_reader(self, authorization: str | None, tenants: frozenset[str],
                     what: str) -> None:
    """Refuses (401/403) a caller who may not read ``what`` (a whole front's counters, every
    tenant's among them); with no keys anyone may (the front then warns off loopback)."""
    if self.digests is None:
      return
    tenant = self.tenant(authorization)
    if tenant not in tenants:
      raise ApiError(403, f"tenant {tenant!r} may not read {what} (it counts every tenant's "
                     "requests); use a key of a metrics tenant (--metrics_tenants).",
                     "permission_error")

