"""The ways the engine loop (`core/llm_engine.py`) runs a scheduled batch, one module each.

- `plain.py`, `PlainSteps.run`: a batch runs and the host waits for its tokens before the next
  batch is scheduled.
- `windows.py`, `DecodeWindows.size`: decode windows, several decode steps of a decode-only batch
  per CPU round trip; it also launches a batch as one step or as a window for the other ways.
- `ahead.py`, `AheadSteps.may_go_ahead` / `launch` / `finish`: running ahead of the GPU (async
  scheduling), a batch enqueued behind the work in flight before the host has seen its tokens.
- `jump_forward.py`, `JumpForward.after`: structured outputs, the tokens a grammar forces appended
  at once and computed by the next step as one chunk.
- `ledger.py`, `StepLedger`: what each of them records (tokens computed, step time, requests
  finished).

Tokens sampled on the device before the host saw them are counted on each request by
`core/in_flight_tokens.py`'s `InFlightTokens`, the one writer of those counts.
"""
