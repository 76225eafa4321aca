"""REMOTE tier: blocks held by another job, asked for and carried over TCP in ZeroMQ's framing.

Two parts, in two processes: ``BlockServer`` (``server``) runs in the job that holds the
blocks and answers between its steps, within its ``BlockServerLimits``; ``RemoteClient``
(``client``) runs in the job that wants them, and ``RemoteTier`` (``tier``) puts that
job's peers behind the tier protocol. Both sides speak the messages and frames of
``wire`` and authenticate with ``auth``. The modules import one way: ``wire`` <- ``auth``
<- ``server``, ``client`` <- ``tier``; none imports this package's names from here.

The names below are re-exported from those modules. A constant is read in the module that
uses it: patch it there (``wire.CHUNK_BYTES``), not here.
"""

from jaxkv.worker.tiers.remote.wire import (CHUNK_BYTES, MAX_HEADER_BYTES,
                                            MAX_REQUEST_BYTES, ANSWERS, PROTOCOL, REQUESTS,
                                            FetchBlocks, Have, Hello, Lookup, Offer, Refusal,
                                            RemoteError, Welcome, WireError, stack_digest,
                                            head_aad, new_nonce, decode)
from jaxkv.worker.tiers.remote.auth import HANDSHAKE_USER, handshake_token
from jaxkv.worker.tiers.remote.server import BlockServer, BlockServerLimits
from jaxkv.worker.tiers.remote.client import MAX_TRANSFER_CONNECTIONS, RemoteClient
from jaxkv.worker.tiers.remote.tier import RemoteTier

__all__ = ["ANSWERS", "PROTOCOL", "REQUESTS", "BlockServer", "BlockServerLimits",
           "FetchBlocks", "Have", "Hello", "Lookup", "Offer", "Refusal", "RemoteClient",
           "RemoteError", "RemoteTier", "Welcome", "WireError", "decode",
           # the wire's limits and helpers, for the tests and tools that build frames
           "CHUNK_BYTES", "HANDSHAKE_USER", "MAX_HEADER_BYTES", "MAX_REQUEST_BYTES",
           "MAX_TRANSFER_CONNECTIONS", "handshake_token", "head_aad", "new_nonce",
           "stack_digest"]
