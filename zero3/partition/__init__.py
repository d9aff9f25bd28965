"""Partitioned parameters: shard geometry, gather units, Init, GatheredParameters."""
