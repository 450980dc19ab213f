"""The trainer every model family shares: config, the Task contract, engine, loop, statistics,
checkpoints and their on-disk format, metrics, preemption."""
