"""The engine's core: the loop that takes requests and groups in and answers them, the scheduler,
the paged KV blocks with the prefix cache, and the request records they share."""
