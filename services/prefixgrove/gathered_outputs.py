"""One answer that runs as several engine requests: a prompt's n samples (the engine's own
ParallelSamples) and a completions line of several prompts (the services' PartsEngine). Each part
runs under an id of its own; the parts' outputs are held here until all of them finished, then
merged into the one output the caller asked for. Generic over the output type: the job model
that uses it imports no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Generic, Protocol, TypeVar


class _Answer(Protocol):
    request_id: str


Out = TypeVar("Out", bound=_Answer)


class GatheredOutputs(Generic[Out]):
    def __init__(self, merge: Callable[[str, list[Out]], Out]) -> None:
        self._merge = merge  # (request id, its parts' outputs in order) -> the request's output
        self._parts: dict[str, list[str]] = {}  # request id -> its parts' ids
        self._outputs: dict[str, list[Out | None]] = {}  # request id -> its parts' outputs so far
        self._owner: dict[str, tuple[str, int]] = {}  # part id -> (request id, part index)

    def open(self, request_id: str, part_ids: list[str]) -> None:
        """Called once every part of the request was accepted by the engine."""
        self._parts[request_id] = part_ids
        self._outputs[request_id] = [None] * len(part_ids)
        self._owner.update((pid, (request_id, k)) for k, pid in enumerate(part_ids))

    def part_ids(self, request_id: str) -> list[str] | None:
        """The engine ids of an open request's parts; None for a request that is not one."""
        return self._parts.get(request_id)

    def forget(self, request_id: str) -> list[str] | None:
        """Stops waiting for the request (aborted); returns its parts' ids, None if not open."""
        part_ids = self._parts.pop(request_id, None)
        self._outputs.pop(request_id, None)
        for pid in part_ids or ():
            self._owner.pop(pid, None)
        return part_ids

    def collect(self, outputs: Iterable[Out]) -> list[Out]:
        """Finished engine requests -> finished requests: a part waits for its request's others,
        every other output passes through."""
        done: list[Out] = []
        for out in outputs:
            owner = self._owner.pop(out.request_id, None)
            if owner is None:
                done.append(out)
                continue
            request_id, k = owner
            parts = self._outputs[request_id]
            parts[k] = out
            if all(p is not None for p in parts):
                del self._outputs[request_id], self._parts[request_id]
                done.append(self._merge(request_id, [p for p in parts if p is not None]))
        return done
