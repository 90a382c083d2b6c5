"""The job model kept in Redis: the key layout and its records, the connection (single node,
Cluster, Sentinel), the job store, the group queue and the streamed uploads. Only the planner and
the worker reach it; the local run and the engine never do."""
