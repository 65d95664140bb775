"""Reading a ``ShardStream``'s shards: the rarer read settings (:mod:`~datapipe.read.options`), the shard
list with its sample counts (:mod:`~datapipe.read.shards`), the segment reader that turns a worker's plan
into samples (:mod:`~datapipe.read.segments`), the counts of everything read or lost
(:mod:`~datapipe.read.ledger`), a local file's values read ahead in threads (:mod:`~datapipe.read.spans`) and the
uninitialised `bytes` they are read into (:mod:`~datapipe.read.rawbytes`)."""
