"""The data-source log: record format, validation, segment files, the commit that makes a batch durable,
group commit, reading and folding, retention and compaction."""
