"""The metrics endpoints of the planner and the worker listen where `--host` says, loopback unless
told otherwise: never on every address because prometheus_client's default is."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from services_testbed import RedisServer, free_port, planner_in_process

from prefixgrove.settings import PlannerSettings, WorkerSettings
from prefixgrove.worker.metrics import WorkerMetrics


def listening_on(port: int) -> set[str]:
    """The addresses this process's network sees listening on TCP `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            address, _, port_hex = local.rpartition(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                found.add(_address(address))
    return found


def _address(little_endian_hex: str) -> str:
    """An address as /proc/net/tcp* writes it: 32-bit words, each little-endian."""
    raw = bytes.fromhex(little_endian_hex)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def test_the_services_bind_loopback_unless_told_otherwise() -> None:
    assert PlannerSettings().host == WorkerSettings().host == "127.0.0.1"


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_the_planners_metrics_listen_on_its_host(redis_server: RedisServer, host: str) -> None:
    port = free_port()
    with planner_in_process(redis_server.url, host=host, metrics_port=port):
        assert listening_on(port) == {host}


def test_a_workers_metrics_listen_on_loopback_by_default() -> None:
    port = free_port()
    WorkerMetrics().serve(port)
    assert listening_on(port) == {"127.0.0.1"}


def test_a_workers_metrics_listen_on_the_host_it_is_given() -> None:
    port = free_port()
    WorkerMetrics().serve(port, "0.0.0.0")
    assert listening_on(port) == {"0.0.0.0"}
