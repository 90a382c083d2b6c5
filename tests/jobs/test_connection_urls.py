"""The Redis URL forms connect() reads, and the errors it gives for the ones it does not (no Redis is
reached here: a Sentinel client connects on its first command; the real processes are in
test_redis_cluster.py and test_redis_sentinel.py)."""

from __future__ import annotations

import pytest
import redis

from prefixgrove.jobs.redis_store.connection import connect


def test_a_sentinel_url_names_the_sentinels_the_master_its_password_and_db() -> None:
    url = "redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2/cache/2?sentinel_password=watch"
    client = connect(url)
    assert isinstance(client, redis.Redis)
    pool = client.connection_pool
    assert pool.service_name == "cache"  # type: ignore[attr-defined]
    assert (pool.connection_kwargs["password"], pool.connection_kwargs["db"]) == ("s3cret", 2)
    sentinels = pool.sentinel_manager.sentinels  # type: ignore[attr-defined]
    addresses = [(s.connection_pool.connection_kwargs["host"],
                  s.connection_pool.connection_kwargs["port"]) for s in sentinels]  # fmt: skip
    assert addresses == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
    assert {s.connection_pool.connection_kwargs["password"] for s in sentinels} == {"watch"}


def test_a_tls_sentinel_url_uses_tls_to_the_master_and_the_sentinels() -> None:
    client = connect("rediss+sentinel://10.0.0.1:26379/cache")
    pool = client.connection_pool
    assert "SSL" in pool.connection_class.__name__
    sentinel = pool.sentinel_manager.sentinels[0]  # type: ignore[attr-defined]
    assert "SSL" in sentinel.connection_pool.connection_class.__name__


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("memcached://:pw@h:1", "scheme 'memcached' is not supported"),
        ("redis+sentinel://h:26379", "expected /<master-name>[/<db>]"),
        ("redis+sentinel://h:26379/m/zero", "expected /<master-name>[/<db>]"),
        ("redis+cluster://h:7000/3", "a cluster has database 0 only"),
        ("redis+cluster://h:7000,h:port", "node 'h:port'"),
        ("redis+cluster://:pw@h:7000,:1", "node ':1'"),
    ],
)
def test_a_url_connect_cannot_read_is_refused_with_what_it_accepts(url: str, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")) as error:
        connect(url)
    assert "pw" not in str(error.value)  # a password never reaches an error message
