"""The REMOTE tier's authentication: the connection handshake's token, requests' challenges.

Authentication (``jaxkv.security``), when the serving cache has a deployment key:
- **Connections.** The server takes a connection only after a ZMTP PLAIN handshake whose
  password is a token derived from the key (``handshake_token``), compared in constant
  time; until it passes, it reads nothing of the connection but the handshake (a greeting
  of 64 bytes, commands of ``MAX_COMMAND_BYTES`` at most; one not done in
  ``handshake_timeout_s`` is closed). What it stops: a client off the path without the key
  can no longer open a connection whose requests are read (a wrong token is refused in the
  handshake and counted, ``BlockServer.handshakes_refused``; the client sees the refusal
  at once: a counted "refused" miss, not a wait for its deadline). What it does not: PLAIN
  is not encrypted, so whoever reads the traffic learns the token and can connect and send
  requests: an attacker on the path, who can cut the traffic anyway. Against them the
  checks below and the bounds of ``server`` stay the second line. (CURVE would hide the
  token, but encrypts every byte of the data path too.) A keyless server has no handshake
  but ZMTP's NULL: anyone who reaches it connects; it is loopback-only unless
  ``allow_insecure``.
- **Requests.** A client asks once per connection for a challenge (``Hello``: the only
  request answered without the key) and sends ``HMAC(key, challenge, number, request)``
  with each request, numbered by a counter that only grows; the server answers only those.
  Others get an "unauthenticated" refusal (counted in ``BlockServer.refused``) and no
  answer to what they asked: not which blocks the server holds, nor anything of them.
  (They do learn that it holds a key: the handshake asks for a token, a ``Welcome``
  carries a tag, and the refusal says why.) The challenge is *stateless* (``Challenges``):
  ``<epoch>-<salt>-HMAC(server secret, connection id, epoch, salt)``, a server-local random
  secret and a random salt per hello, so the server keeps nothing per connection before a
  request is authenticated and no flood of hellos can push a peer's challenge out. A
  challenge holds for the epoch it was made in and the next (``challenge_epoch_s``, 60 s:
  one more hello round trip per connection a minute). Replays: for each challenge the
  server remembers the highest number it answered and refuses a request numbered at or
  below it ("replay", counted), so a request recorded on the path is answered once, never
  again, however many requests came after it (on another connection, or once its
  challenge expired, it is unauthenticated). Each hello's challenge is its own (the salt),
  so clients sharing a connection (through a proxy) number their requests apart. That is
  one number per challenge in use, at most ``max_replay_windows`` of them (a challenge
  expires with its two epochs); beyond, a request under a new challenge is refused
  ("busy", counted) rather than an old challenge's number forgotten.
- **Answers.** Every answer carries a ``Seal("remote-answer")`` tag over its header *and*
  its data frame, bound to the request's nonce (the purpose names the direction: requests
  are HMACs under the raw key, answers GCM tags under a key derived for answers, so
  neither verifies as the other). A client that asked for sealed blocks
  (``FetchBlocks.sealed``, ``TierConfig.encryption``) gets them encrypted (AES-256-GCM,
  its associated data the header) and refuses plaintext ones. A client with the key
  checks the tag *before* it parses a byte, so a forger on the path, or a peer without
  the key, costs a counted miss (``Failure.MAC``/``MODE``), never a parse.
Without a key the server answers anyone (it refuses to start on a non-loopback address
unless told ``allow_insecure``, and says so once either way), and answers carry a CRC-32C of
the blocks: it catches damage, not forgery (CRC-32C is linear: whoever can change the
bytes can fix it up).

(``handshake_timeout_s``, ``challenge_epoch_s``, ``max_replay_windows``: the server's
``BlockServerLimits``.)
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import re
import secrets
import time

from jaxkv import security
from jaxkv.worker.tiers.remote.wire import RemoteError

KEYLESS_FIX = ("set a deployment key on every job (--deployment_key_file or "
                "$JAXKV_DEPLOYMENT_KEY_FILE)")
HANDSHAKE_USER = b"jaxkv"  # the PLAIN user name of a keyed connection; the token is its password
HANDSHAKE_FIX = ("the two jobs do not hold the same deployment key, or only one of them "
                  "has one")
UNAUTHENTICATED = "unauthenticated"  # how such a refusal starts: the client says hello again


class Unauthenticated(RemoteError):
  """The peer did not accept this connection's challenge (expired, or the connection was
  re-made under another routing id): a fresh hello may fix it."""


def handshake_token(key: bytes) -> bytes:
  """The PLAIN password of a keyed connection. It crosses the network in clear, so it is a
  derivation of the key made for this use alone: knowing it proves nothing else."""
  return hmac.new(key, b"jaxkv-zmq-handshake", hashlib.sha256).hexdigest().encode()


def plain_credentials(body: bytes) -> tuple[bytes, bytes] | None:
  """``(user, password)`` of a PLAIN HELLO's body; None when it is not one."""
  if not body or len(body) < 1 + body[0] + 1:
    return None
  user, rest = body[1:1 + body[0]], body[1 + body[0]:]
  if len(rest) != 1 + rest[0]:
    return None
  return user, rest[1:]


class Challenges:
  """A ``BlockServer``'s challenges, recomputed from a secret of this process (no state per
  connection), and the highest request number answered under each challenge in use (what
  refuses replays). Its settings are ``server.limits``' (``challenge_epoch_s``,
  ``max_replay_windows``: ``server`` is the ``BlockServer``), read when used."""

  def __init__(self, server, key: bytes):
    self.server, self._key = server, key
    self._secret = secrets.token_bytes(32)
    # challenge -> the highest request number answered under it, oldest challenge first.
    self._answered: collections.OrderedDict = collections.OrderedDict()

  def epoch(self) -> int:
    return int(time.monotonic() // self.server.limits.challenge_epoch_s)

  def make(self, peer: bytes, epoch: int, salt: str) -> str:
    """The challenge of ``peer`` for ``epoch`` and ``salt``: recomputed, never stored."""
    mac = hmac.new(self._secret, b"%d\x00%s\x00" % (epoch, salt.encode()) + peer,
                   hashlib.sha256)
    return f"{epoch}-{salt}-{mac.hexdigest()[:32]}"

  def authentic(self, peer: bytes, body, auth) -> tuple[str, int] | None:
    """``(challenge, number)`` of ``auth`` (``"<challenge> <number> <MAC>"``) when it holds a
    challenge this server made for ``peer`` (this epoch or the last) and the key's MAC over
    it, the number and ``body``; else None."""
    parts = bytes(auth).decode("ascii", "replace").split(" ")
    if len(parts) != 3:
      return None
    challenge, number, mac = parts
    epoch, _, rest = challenge.partition("-")
    salt = rest.partition("-")[0]
    if not (epoch.isdigit() and len(epoch) <= 15 and re.fullmatch(r"[0-9a-f]{8}", salt)
            and number.isdigit() and len(number) <= 18 and str(int(number)) == number):
      return None
    now = self.epoch()
    if (int(epoch) in (now, now - 1)
        and hmac.compare_digest(self.make(peer, int(epoch), salt), challenge)
        and security.mac_ok(self._key, f"{challenge} {number}", body, mac)):
      return challenge, int(number)
    return None

  def first_time(self, challenge: str, number: int) -> bool | None:
    """Whether an authenticated request numbered ``number`` under ``challenge`` is new:
    numbered above every one answered under it (a client's numbers only grow, and one
    connection's requests arrive in order); from now on it is the highest. Remembers a
    number per challenge until the challenge expires (a request under an expired one is
    unauthenticated), ``max_replay_windows`` of them at most: None (refuse, "busy") for a
    new challenge beyond that, rather than forget one still in use."""
    last = self._answered.get(challenge)
    if last is not None:
      if number <= last:
        return False
      self._answered[challenge] = number
      return True
    oldest = self.epoch() - 1
    epoch_of = lambda c: int(c.partition("-")[0])
    while self._answered and epoch_of(next(iter(self._answered))) < oldest:
      self._answered.popitem(last=False)
    if len(self._answered) >= self.server.limits.max_replay_windows:
      for c in [c for c in self._answered if epoch_of(c) < oldest]:
        del self._answered[c]
      if len(self._answered) >= self.server.limits.max_replay_windows:
        return None
    self._answered[challenge] = number
    return True

