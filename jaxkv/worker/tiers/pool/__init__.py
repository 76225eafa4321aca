"""The POOL tier: a Mooncake Store pool that every node lends memory to (``tier``), the
client's native parts (``native``) and a master started on loopback (``master``)."""

from jaxkv.worker.tiers.pool.tier import PoolTier, check_reachable, metadata_url, split_address

__all__ = ["PoolTier", "check_reachable", "metadata_url", "split_address"]
