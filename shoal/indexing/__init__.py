"""Turning a data source's log into versioned index shards: definitions, sharding, materialize, merge."""
