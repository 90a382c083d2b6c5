"""Triton kernels with their launchers and torch references: paged and cascade attention, the split
reduce, and the fused elementwise kernels. Imports nothing of the rest of prefixgrove."""
