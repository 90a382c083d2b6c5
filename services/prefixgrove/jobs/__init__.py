"""The shared job model: what a batch job is and where it lives, used by the planner, the worker and
the local run alike. Request records and their validation, ingest and tokenization, the prefix index,
the Redis schema and store, the group queue, and the output lines. Imports no engine.
"""
