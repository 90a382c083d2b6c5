"""Ports for the servers the tests start (redis-server, planners, workers, the API server).

A port is picked free, closed, then handed to the server that binds it: between the two another
process can take it. Under two pytest workers (scripts/test.sh) the kernel's pick for one could be
the port the other picked and has not bound yet, so each worker draws from its own range, below the
kernel's ephemeral ports (32768 and up by default, where the kernel's own picks and outgoing
connections come from), counting up from a random start so that one worker never hands out a port
twice in a row of picks.
"""

from __future__ import annotations

import itertools
import os
import random
import socket

_FIRST, _END = 15000, 32000  # below the ephemeral range


def _worker_range() -> range:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker[2:]) if worker.startswith("gw") else 0
    span = (_END - _FIRST) // max(count, 1)
    return range(_FIRST + index * span, _FIRST + (index + 1) * span)


_PORTS = _worker_range()
_NEXT = itertools.count(random.randrange(len(_PORTS)))


def free_port() -> int:
    """A port of this worker's range that nothing listens on now."""
    for _ in range(len(_PORTS)):
        port = _PORTS[next(_NEXT) % len(_PORTS)]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (a server an earlier test left, or another program)
            return port
    raise RuntimeError(f"no free port in {_PORTS}")
