"""Redis clients of the planner and the workers: one Redis, a Sentinel-watched one or a Redis
Cluster, each named by one URL; commands retry while Redis restarts or fails over.

URL forms (passwords, TLS and `?option=value` as redis-py reads them in a plain URL):
  redis://[[user]:password@]host:port[/db]          one Redis; rediss:// for TLS
  unix://[[user]:password@]/path/to/socket[?db=N]   one Redis on a Unix socket
  redis+cluster://[[user]:password@]host:port[,host:port...]
                                                    a Redis Cluster, found from any node listed;
                                                    rediss+cluster:// for TLS
  redis+sentinel://[[user]:password@]host:port[,host:port...]/master-name[/db]
                                                    the master the Sentinels listed name;
                                                    rediss+sentinel:// for TLS to both; the
                                                    password is the master's, a Sentinel's own
                                                    goes in ?sentinel_username=&sentinel_password=
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit

import redis
from redis.backoff import AbstractBackoff, ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode
from redis.connection import parse_url
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError
from redis.retry import Retry
from redis.sentinel import Sentinel

# What JobStore, GroupQueue and the worker are handed; both answer the commands they use.
Redis: TypeAlias = redis.Redis | redis.RedisCluster

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}
_SCHEMES = "redis://, rediss://, unix://, redis+cluster://, rediss+cluster://, redis+sentinel://, rediss+sentinel://"
_RETRY_ON = [redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError]
_CLUSTER_RETRY_ON = (*_RETRY_ON, socket.timeout, ClusterDownError, SlotNotCoveredError)


class _StoppableBackoff(AbstractBackoff):
    """Backoff that ends the retries at once when `give_up` is set (a process shutting down)."""

    def __init__(self, inner: AbstractBackoff, give_up: threading.Event) -> None:
        self.inner = inner
        self.give_up = give_up

    def reset(self) -> None:
        self.inner.reset()

    def compute(self, failures: int) -> float:
        # Waits here rather than in Retry's sleep, so that give_up cuts the wait short.
        if self.give_up.wait(self.inner.compute(failures)):
            raise redis.ConnectionError("stopped waiting for Redis: shutting down")
        return 0.0

    def __deepcopy__(self, memo: dict[int, Any]) -> _StoppableBackoff:
        return self  # redis-py copies its Retry per connection; the event must stay shared


class _PatientCluster(redis.RedisCluster):
    """A RedisCluster whose commands wait out a node restarting or failing over. RedisCluster's
    own retries come one after another without a pause (they are for a moved slot), so each
    command also goes through `patience`, the backoff a single-node client has."""

    def __init__(self, patience: Retry, **kwargs: Any) -> None:
        self.patience = patience  # before RedisCluster's own setup, which runs commands
        super().__init__(**kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return self.patience.call_with_retry(
            lambda: redis.RedisCluster.execute_command(self, *args, **kwargs), lambda _: None
        )


@dataclass(frozen=True)
class _Nodes:
    """A URL that lists several nodes, split into the nodes and a plain URL redis-py reads the
    rest from (scheme, user, password, path, query) with the first node as its host."""

    nodes: list[tuple[str, int]]
    path: str
    plain: str


def connect(
    url: str,
    *,
    retries: int = 30,
    give_up: threading.Event | None = None,
    socket_timeout: float | None = None,
) -> Redis:
    """A client that rides out a restarting Redis: each command retries with backoff (~1 min),
    unless `give_up` is set, which ends the retrying of every command. `retries=0` and a
    `socket_timeout` make a probe that answers at once."""
    backoff: AbstractBackoff = ExponentialBackoff(cap=2.0, base=0.05)
    if give_up is not None:
        backoff = _StoppableBackoff(backoff, give_up)
    retry = Retry(backoff, retries)
    timeouts = {"socket_connect_timeout": socket_timeout or 5, "socket_timeout": socket_timeout}
    scheme = urlsplit(url).scheme
    if scheme in _CLUSTER_SCHEMES:
        return _cluster(_split(url, _CLUSTER_SCHEMES[scheme], 6379), backoff, retries, timeouts)
    if scheme in _SENTINEL_SCHEMES:
        return _sentinel(_split(url, _SENTINEL_SCHEMES[scheme], 26379), retry, timeouts)
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"Redis URL scheme {scheme!r} is not supported: expected one of {_SCHEMES}"
        )
    return redis.Redis.from_url(
        url, retry=retry, retry_on_error=_RETRY_ON, health_check_interval=10, **timeouts
    )


def _cluster(
    url: _Nodes, backoff: AbstractBackoff, retries: int, timeouts: dict[str, Any]
) -> redis.RedisCluster:
    if url.path.strip("/") not in ("", "0"):
        raise ValueError(
            f"Redis Cluster URL path {url.path!r} is invalid: a cluster has database 0 only "
            "(leave the path out)"
        )
    retry = Retry(backoff, retries, _CLUSTER_RETRY_ON)
    # RedisCluster reads the cluster's layout as it is built, and fails when no node answers:
    # a cluster that is restarting is waited for here as well.
    unreachable = Retry(backoff, retries, (RedisClusterException, *_CLUSTER_RETRY_ON))
    return unreachable.call_with_retry(
        lambda: _PatientCluster(
            retry,
            url=url.plain,
            startup_nodes=[ClusterNode(host, port) for host, port in url.nodes[1:]],
            retry=Retry(NoBackoff(), 3),
            **timeouts,
        ),
        lambda _: None,
    )


def _sentinel(url: _Nodes, retry: Retry, timeouts: dict[str, Any]) -> redis.Redis:
    master, _, db = url.path.strip("/").partition("/")
    if not master or not (db == "" or db.isdigit()):
        raise ValueError(
            f"Redis Sentinel URL path {url.path!r} is invalid: expected /<master-name>[/<db>]"
        )
    options = parse_url(url.plain)
    for key in ("host", "port", "db"):
        options.pop(key, None)
    ssl = options.pop("connection_class", None) is not None  # only rediss:// sets one here
    on_sentinels: dict[str, Any] = {"ssl": ssl, **timeouts}
    for key in ("username", "password"):
        if f"sentinel_{key}" in options:
            on_sentinels[key] = options.pop(f"sentinel_{key}")
    sentinels = Sentinel(url.nodes, sentinel_kwargs=on_sentinels)
    return sentinels.master_for(
        master, db=int(db or 0), ssl=ssl, retry=retry, retry_on_error=_RETRY_ON,
        health_check_interval=10, **timeouts, **options,
    )  # fmt: skip


def _split(url: str, plain_scheme: str, default_port: int) -> _Nodes:
    parts = urlsplit(url)
    userinfo, at, hosts = parts.netloc.rpartition("@")
    nodes = []
    for entry in hosts.split(","):
        node = urlsplit("//" + entry)
        try:
            port = node.port or default_port
        except ValueError:
            port = 0
        if not node.hostname or port == 0:
            raise ValueError(
                f"Redis URL node {entry!r} (of {hosts!r}) is invalid: expected host:port"
            )
        nodes.append((unquote(node.hostname), port))
    first = hosts.split(",")[0]
    query = f"?{parts.query}" if parts.query else ""
    plain = f"{plain_scheme}://{userinfo}{at}{first}{query}"
    return _Nodes(nodes, parts.path, plain)
