"""Head announcements: every commit tells searchers the data source's new head, on Redis, before its writers
are acknowledged.

Two things per commit, in one round trip (a script): the key `shoal:head:<source id>` is raised to the new
head (never lowered: concurrent committers may announce out of order), and the head is published on
HEADS_CHANNEL. Searchers follow the channel to keep their young tier (the log not yet built into segments)
up to date without polling, and read the key to answer `strong` without a catalog round trip: the key is
set before the commit's writers learn their tokens, so a query that began after an acknowledgement reads a
head at least that acknowledged seq.

An announcement that fails (Redis unreachable) is owed: it is retried in the background until it lands,
and searchers distrust the keys for a while after they reconnect to Redis (see the searcher), since commits
made while Redis was away were not announced.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import redis

from shoal.errors import ShoalError

log = logging.getLogger(__name__)

HEADS_CHANNEL = "shoal:heads"
RETRY_S = 0.5  # how often owed announcements are tried again while Redis is unreachable

# KEYS[1]: the head key; ARGV[1]: the head; ARGV[2]: the channel; ARGV[3]: the message.
_RAISE_AND_PUBLISH = """
local current = tonumber(redis.call('GET', KEYS[1]) or '0')
if current < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""


def head_key(source_id: int) -> str:
    """The Redis key holding the newest announced head of a data source."""
    return f"shoal:head:{source_id}"


def parse_announcement(data: bytes | str) -> tuple[int, int] | None:
    """(source id, head) of a message on HEADS_CHANNEL; None when it is not one."""
    try:
        message = json.loads(data)
        return int(message["source"]), int(message["head"])
    except (ValueError, KeyError, TypeError):
        return None


def read_head(client: redis.Redis, source_id: int) -> int | None:
    """The newest head announced for the data source, or None when none is known (never announced, or
    Redis lost it). Raises redis.RedisError when Redis does not answer."""
    value: Any = client.get(head_key(source_id))
    return None if value is None else int(value)


class SentRead:
    """One Redis command sent at once and answered later, so that a `strong` search runs over what it already
    holds while the round trip is under way (shoal.searcher.announce.HeadAndTokenRead reads the head this way).
    `answer()` takes the reply (once); `close()` gives the connection back unread (dropping it) when the reply is
    not wanted. Raises redis.RedisError (or OSError) when Redis does not answer, from either."""

    def __init__(self, client: redis.Redis, *command: Any) -> None:
        self._pool = client.connection_pool
        self._conn: Any = self._pool.get_connection()
        try:
            self._conn.send_command(*command)
        except BaseException:
            self._give_back(drop=True)
            raise

    def answer(self) -> Any:
        """The command's reply, waiting for it if need be."""
        if self._conn is None:
            raise RuntimeError("the read was already answered or closed")
        try:
            value = self._conn.read_response()
        except BaseException:
            self._give_back(drop=True)
            raise
        self._give_back(drop=False)
        return value

    def close(self) -> None:
        """Give the connection back if its answer was never read: dropped, since a reply is still due on it."""
        if self._conn is not None:
            self._give_back(drop=True)

    def _give_back(self, drop: bool) -> None:
        conn, self._conn = self._conn, None
        if drop:
            conn.disconnect()
        self._pool.release(conn)


class HeadAnnouncer:
    """Announces heads on one Redis client; what fails is owed and retried until it lands. Thread-safe."""

    def __init__(self, client_of: Any) -> None:
        """`client_of()` returns the Redis client to use (called per announcement: it may start the
        embedded server, or raise when there is none)."""
        self._client_of = client_of
        self._owed: dict[int, int] = {}
        self._lock = threading.Lock()
        self._retrying = False
        self._closed = threading.Event()

    def announce(self, source_id: int, head: int) -> bool:
        """Announce `head` for the data source now; True when it landed (else it is owed and retried)."""
        try:
            self._send(source_id, head)
        except ShoalError:  # no broker configured or startable: no searcher can follow heads either
            return False
        except Exception as exc:  # noqa: BLE001 - Redis unreachable: the commit stands regardless
            self._owe(source_id, head, exc)
            return False
        return True

    def close(self) -> None:
        """Stop retrying what is owed (the process is done with this runtime)."""
        self._closed.set()

    def _send(self, source_id: int, head: int) -> None:
        client = self._client_of()
        message = json.dumps({"source": source_id, "head": head})
        client.eval(_RAISE_AND_PUBLISH, 1, head_key(source_id), head, HEADS_CHANNEL, message)

    def _owe(self, source_id: int, head: int, exc: BaseException) -> None:
        with self._lock:
            first = not self._owed
            self._owed[source_id] = max(head, self._owed.get(source_id, 0))
            start = not self._retrying
            self._retrying = True
        if first:
            log.warning("could not announce the head of data source %s (%s); retrying in the background", source_id,
                        exc)
        if start:
            threading.Thread(target=self._retry_loop, name="shoal-heads-retry", daemon=True).start()

    def _retry_loop(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                owed = dict(self._owed)
                if not owed:
                    self._retrying = False
                    return
            for source_id, head in owed.items():
                try:
                    self._send(source_id, head)
                except Exception:  # noqa: BLE001 - still unreachable: try again shortly
                    break
                with self._lock:
                    if self._owed.get(source_id) == head:
                        del self._owed[source_id]
            else:
                continue
            self._closed.wait(RETRY_S)
        with self._lock:
            self._retrying = False

    @property
    def owed(self) -> dict[int, int]:
        """Data source id -> head not yet announced (Redis unreachable since)."""
        with self._lock:
            return dict(self._owed)
