"""Tensor parallelism: one process per device, rank 0 schedules and samples, every rank runs each step
on its shard of the model (docs/architecture.md, "Tensor parallelism")."""
