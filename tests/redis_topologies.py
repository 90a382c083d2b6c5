"""Redis topologies of our own for the store's tests: a Redis Cluster of three masters and a
master with a replica watched by three Sentinels, each server on a free loopback port with its own
folder and log (redis-server and redis-cli must be installed: CI fails without them)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest
from ports import free_port
from services_testbed import need_redis, wait_until


def need_redis_cli() -> str:
    """redis-cli joins the cluster nodes; it comes with redis-server (Debian's redis-tools)."""
    need_redis()
    path = shutil.which("redis-cli")
    if path is None:
        pytest.fail("redis-cli is not installed (scripts/ci/install-redis.sh installs it)")
    return path


class RedisProcess:
    """A redis-server (a cluster node, a master, a replica or a Sentinel) of our own on a free
    loopback port, started with `args` and its own folder and log."""

    def __init__(self, workdir: Path, args: list[str], config: str = "") -> None:
        self.workdir = workdir
        self.port = free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        # A config file first, when given: Sentinel insists on one it can rewrite.
        head = []
        if config:
            (workdir / "redis.conf").write_text(config)
            head = [str(workdir / "redis.conf")]
        self.args = [need_redis(), *head, "--port", str(self.port), "--bind", "127.0.0.1",
                     "--dir", str(workdir), "--save", "", "--appendonly", "no",
                     "--daemonize", "no", "--loglevel", "notice", *args]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        with (self.workdir / "redis.log").open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._listening, 10, f"redis-server on {self.port} to listen")

    def _listening(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {self.log()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def log(self) -> str:
        return (self.workdir / "redis.log").read_text(errors="replace")

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


class RedisClusterProcesses:
    """`size` redis-server processes in cluster mode joined into one cluster of primaries (no
    replicas) by `redis-cli --cluster create`; started() waits for cluster_state:ok everywhere."""

    def __init__(self, workdir: Path, size: int = 3) -> None:
        self.nodes = [_cluster_node(workdir / f"node{i}") for i in range(size)]

    @property
    def url(self) -> str:
        """A cluster URL naming two of the nodes: any one is enough to find the rest."""
        return "redis+cluster://" + ",".join(node.address for node in self.nodes[:2])

    def start(self) -> None:
        for node in self.nodes:
            node.start()
        create = [need_redis_cli(), "--cluster", "create", *(n.address for n in self.nodes),
                  "--cluster-replicas", "0", "--cluster-yes"]  # fmt: skip
        joined = subprocess.run(create, capture_output=True, text=True, timeout=60)
        if joined.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {joined.stdout}{joined.stderr}")
        wait_until(self.healthy, 30, "every cluster node to report cluster_state:ok")

    def healthy(self) -> bool:
        """Every node answers, knows every other and serves every slot."""
        for node in self.nodes:
            info = node.client().execute_command("CLUSTER INFO")  # parsed into a dict
            if info["cluster_state"] != "ok" or int(info["cluster_known_nodes"]) != len(self.nodes):
                return False
        return True

    def kill(self) -> None:
        for node in self.nodes:
            node.kill()


def _cluster_node(folder: Path) -> RedisProcess:
    # The bus port is named: by default it is the port + 10000, which a free port may not allow.
    config = str(folder / "nodes.conf")
    return RedisProcess(folder, ["--cluster-enabled", "yes", "--cluster-config-file", config,
                                 "--cluster-port", str(free_port()),
                                 "--cluster-node-timeout", "2000"])  # fmt: skip


SENTINEL_MASTER = "m"


class RedisSentinelProcesses:
    """A master, one replica of it and three Sentinels watching it (quorum 2), with timeouts short
    enough that a master killed is replaced within seconds."""

    def __init__(self, workdir: Path, down_after_ms: int = 1000) -> None:
        self.master = RedisProcess(workdir / "master", [])
        self.replica = RedisProcess(
            workdir / "replica", ["--replicaof", "127.0.0.1", str(self.master.port)]
        )
        self.sentinels = [
            RedisProcess(workdir / f"sentinel{i}", ["--sentinel"], self._config(down_after_ms))
            for i in range(3)
        ]

    def _config(self, down_after_ms: int) -> str:
        m = SENTINEL_MASTER
        return (
            f"sentinel monitor {m} 127.0.0.1 {self.master.port} 2\n"
            f"sentinel down-after-milliseconds {m} {down_after_ms}\n"
            f"sentinel failover-timeout {m} 10000\n"
            f"sentinel parallel-syncs {m} 1\n"
        )

    @property
    def url(self) -> str:
        hosts = ",".join(s.address for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SENTINEL_MASTER}/0"

    def start(self) -> None:
        for proc in [self.master, self.replica, *self.sentinels]:
            proc.start()
        wait_until(self._watched, 60, "the replica to sync and every Sentinel to see the others")

    def _watched(self) -> bool:
        replication = self.replica.client().info("replication")
        if replication.get("master_link_status") != "up":
            return False
        for sentinel in self.sentinels:
            state = sentinel.client().sentinel_master(SENTINEL_MASTER)
            if int(state["num-other-sentinels"]) != 2 or int(state["num-slaves"]) != 1:
                return False
        return True

    def master_port(self) -> int:
        """The port of the master the Sentinels name now."""
        _, port = self.sentinels[0].client().sentinel_get_master_addr_by_name(SENTINEL_MASTER)
        return int(port)

    def kill(self) -> None:
        for proc in [*self.sentinels, self.replica, self.master]:
            proc.kill()
