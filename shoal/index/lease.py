"""Build leases that a dead worker cannot hold for long: owner names a successor can check, and a heartbeat.

A shard's build lease is short (SHOAL_LEASE_SECONDS) and renewed by a heartbeat thread while the build runs,
so a worker that dies mid-build stops renewing and its lease ends within one lease period wherever it ran.
On the same machine a successor does not even wait for that: the owner name says which process holds the
lease (pid, start time, pid namespace and boot), and a lease whose process is gone is taken over at once.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from functools import cache

from shoal.catalog.indexes import ShardCatalog

log = logging.getLogger(__name__)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" when unknown or gone): with the pid, it names
    one process for the life of the machine, even after the pid is reused."""
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return ""
    # The fields after the command name (in parentheses, which may hold spaces): state is the first, and
    # starttime the 20th.
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] if len(fields) > 19 else ""


@cache
def _machine() -> str:
    """This kernel's boot and this process's pid namespace ("" when unknown): pids are comparable only
    between processes that share both."""
    boot = _read("/proc/sys/kernel/random/boot_id").strip().replace("-", "")[:12]
    try:
        namespace = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return ""
    return f"{boot}.{namespace}" if boot else ""


def default_owner() -> str:
    """A lease owner name unique to this process: `host:pid:random:boot.pidns.starttime`."""
    pid = os.getpid()
    machine = _machine()
    where = f"{machine}.{_start_time(pid)}" if machine else ""
    return f"{socket.gethostname()}:{pid}:{uuid.uuid4().hex[:8]}:{where}"


def owner_is_dead(owner: str) -> bool:
    """True only when `owner` names a process of this machine and pid namespace that no longer runs (or is
    a zombie); False when it runs, when it is unknown, or when it ran elsewhere (then only its lease's
    expiry tells)."""
    parts = owner.split(":")
    if len(parts) != 4 or not parts[1].isdigit() or not _machine():
        return False
    machine, _, started = parts[3].rpartition(".")
    if machine != _machine() or not started:
        return False
    pid = int(parts[1])
    stat = _read(f"/proc/{pid}/stat")
    if not stat:
        return True  # no such process
    state = stat.rsplit(")", 1)[1].split()[0]
    # A zombie finished (killed, not yet reaped); another start time is another process reusing the pid.
    return state in ("Z", "X") or _start_time(pid) != started


class LeaseHeartbeat:
    """Renews one shard's build lease every `interval` seconds from a daemon thread, from `start()` until
    `stop()`. `lost` is set once a renewal finds the lease gone to another owner: the build must not publish
    (publish_version refuses it anyway). A renewal the catalog fails (it is briefly away) is retried at the
    next beat; the lease may expire meanwhile, which only lets another worker take over."""

    def __init__(self, shards: ShardCatalog, shard_id: int, owner: str, seconds: float, interval: float) -> None:
        self.shards = shards
        self.shard_id = shard_id
        self.owner = owner
        self.seconds = seconds
        self.interval = interval
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"shoal-lease-{shard_id}", daemon=True)

    def start(self) -> LeaseHeartbeat:
        """Start renewing; returns self."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing (the caller releases the lease)."""
        self._stop.set()
        self._thread.join(timeout=max(5.0, self.interval))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                held = self.shards.renew_lease(self.shard_id, self.owner, self.seconds)
            except Exception as exc:  # noqa: BLE001 - the catalog is away: try again at the next beat
                log.warning("could not renew the build lease of index shard %s: %s", self.shard_id,
                            type(exc).__name__)
                continue
            if not held:
                log.warning("index shard %s: the build lease was taken over; this build will not publish",
                            self.shard_id)
                self.lost.set()
                return
