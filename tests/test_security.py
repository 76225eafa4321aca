"""The deployment key's form and where it comes from, the seals made with it, and the
warnings an insecure setup prints."""

import base64
import logging
import os

import pytest

import jaxkv
from jaxkv import security

import helpers

KEY = os.urandom(32)


def test_a_key_is_32_random_bytes_as_hex_or_base64_from_an_owner_only_file(tmp_path):
  path = tmp_path / "key"
  for text in (KEY.hex(), base64.b64encode(KEY).decode(), base64.urlsafe_b64encode(KEY).decode()):
    path.write_text(text + "\n")
    path.chmod(0o600)
    assert security.load_deployment_key(str(path), environ={}) == KEY
    assert security.load_deployment_key(None, environ={"JAXKV_DEPLOYMENT_KEY_FILE": str(path)}) == KEY
    assert security.load_deployment_key(None, environ={"JAXKV_DEPLOYMENT_KEY": text}) == KEY
  assert security.load_deployment_key(None, environ={}) is None
  path.chmod(0o640)
  with pytest.raises(ValueError, match=f"mode 0640.*chmod 600 {path}"):
    security.load_deployment_key(str(path), environ={})
  bad = [("short", "neither hex nor base64"),
         (base64.b64encode(KEY[:16]).decode(), "has 16 bytes; it needs at least 32"),
         ("61" * 40, "only 1 distinct byte values: it is not random"),
         ("a deployment key written as a sentence!", "neither hex nor base64")]
  for text, message in bad:
    with pytest.raises(ValueError, match=message):
      security.load_deployment_key(None, environ={"JAXKV_DEPLOYMENT_KEY": text})
  with pytest.raises(ValueError, match="cannot be read"):
    security.load_deployment_key(str(tmp_path / "missing"), environ={})
  assert security.check_key(KEY) == KEY and security.check_key(KEY.hex()) == KEY
  with pytest.raises(ValueError, match="at least 32"):
    security.check_key(KEY[:31])
  assert security.key_id(KEY) != security.key_id(KEY[::-1]) and KEY.hex() not in security.key_id(KEY)


def test_a_seal_proves_bytes_for_one_purpose_and_key_only():
  disk = security.Seal(KEY, "disk-record")
  data = os.urandom(4096)
  tag = disk.tag(b"block", data)
  disk.check(b"block", data, tag)
  changed = bytearray(data)
  changed[100] ^= 1
  for aad, payload, seal in ((b"block", bytes(changed), disk), (b"other", data, disk),
                             (b"block", data, security.Seal(KEY, "remote-answer")),
                             (b"block", data, security.Seal(KEY[::-1], "disk-record"))):
    with pytest.raises(security.SealError):
      seal.check(aad, payload, tag)
  sealed = disk.seal(b"block", data)
  assert len(sealed) == len(data) + disk.OVERHEAD and data[:64] not in sealed
  assert disk.open(b"block", sealed) == data
  with pytest.raises(security.SealError):
    disk.open(b"other", sealed)
  assert disk.seal(b"block", data) != sealed  # a fresh nonce each time


def test_loopback_addresses():
  assert all(map(security.is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
  assert not any(map(security.is_loopback, ["0.0.0.0", "10.0.0.1", "::", "*", "example.com"]))


def test_encryption_off_with_a_store_warns_once_and_on_without_a_key_is_refused(
    mesh, tmp_path, caplog):
  tiers = jaxkv.TierConfig(disk_kvstore=str(tmp_path / "d"), disk_pages=8, encryption="off")
  with caplog.at_level(logging.WARNING):
    e = helpers.make_engine(mesh, tiers=tiers, deployment_key=KEY)
    helpers.make_engine(mesh, tiers=tiers, deployment_key=KEY)
  lines = [r.getMessage() for r in caplog.records if "encryption='off'" in r.getMessage()]
  assert len(lines) == 1 and "INSECURE" in lines[0] and "encryption='auto'" in lines[0]
  assert not e.cache.encrypt
  assert helpers.make_engine(mesh, tiers=jaxkv.TierConfig(
      disk_kvstore=str(tmp_path / "e"), disk_pages=8), deployment_key=KEY).cache.encrypt
  with pytest.raises(ValueError, match="encryption='on' needs a deployment key"):
    helpers.make_engine(mesh, tiers=jaxkv.TierConfig(encryption="on"))
  with pytest.raises(ValueError, match="encryption='maybe' must be one of"):
    jaxkv.TierConfig(encryption="maybe")
