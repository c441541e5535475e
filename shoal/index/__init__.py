"""Turning a data source's log into versioned index shards: definitions, sharding, index segments,
materialize and merge, generations (reindex) and time travel."""
