"""The planner's first contact with Redis: waited for, one line a try, while Redis is away.

A planner may start before its Redis does (a deployment's pods start in any order), so one that
cannot reach Redis says so in one warning line and tries again with backoff, as long as it takes.
Redis refusing its credentials is no reason to wait: that ends the start at once, in one line
(the CLI exits 1).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis.exceptions import RedisClusterException

from prefixgrove.jobs.redis_store.connection import connect

log = logging.getLogger(__name__)
_FIRST_WAIT_S = 1.0
_LONGEST_WAIT_S = 30.0
_PROBE_TIMEOUT_S = 5.0
# NOTE: AuthenticationError is a ConnectionError too: it is told apart first.
_AWAY = (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError, RedisClusterException,
         OSError)  # fmt: skip


def wait_for_redis(url: str, sleep: Callable[[float], None] = time.sleep) -> None:
    """Returns once Redis at `url` answers a PING; raises ConnectionError (an OSError) when it
    refuses the planner's credentials."""
    wait = _FIRST_WAIT_S
    while True:
        try:
            connect(url, retries=0, socket_timeout=_PROBE_TIMEOUT_S).ping()
            return
        except redis.AuthenticationError as exc:
            raise ConnectionError(
                f"Redis at {shown_url(url)} refused the planner's credentials ({_one_line(exc)}): "
                "check the password in the Redis URL"
            ) from None
        except _AWAY as exc:
            log.warning("cannot reach Redis at %s (%s); trying again in %.0fs",
                        shown_url(url), _one_line(exc), wait)  # fmt: skip
        sleep(wait)
        wait = min(wait * 2, _LONGEST_WAIT_S)


def shown_url(url: str) -> str:
    """`url` without its passwords (the URL's own, and a Sentinel's in its query)."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if parts.password is not None:
        netloc = f"{parts.username or ''}:***@{netloc.rpartition('@')[2]}"
    pairs = parse_qsl(parts.query)
    if netloc == parts.netloc and not any("password" in k.lower() for k, _ in pairs):
        return url
    query = [(k, "***" if "password" in k.lower() else v) for k, v in pairs]
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query, safe="*")))


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
