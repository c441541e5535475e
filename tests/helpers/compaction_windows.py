"""Windows the compaction crash test kills its child in, observed from storage and the catalog only (not from
what the child prints): a compaction's rewrite written but not swapped in, GC deleting queued files before it
records that, a batch's segment written but not committed, a swap committed with the replaced files not yet
collected."""

from __future__ import annotations

import re
import select as io_select
import subprocess

from sqlalchemy import select
from sqlalchemy.orm import Session

from helpers.compaction_checks import COMPACT_SPEC
from helpers.kill_points import freeze_inside
from shoal import Shoal
from shoal.catalog.models import GarbageFile
from shoal.log.compaction_swap import COMPACTED

NAME, VERSION = COMPACT_SPEC.name, COMPACT_SPEC.version
TARGETS = ("compact", "gc", "upload", "swap")
_SEGMENT_FILE = re.compile(r"(\d{20})-[0-9a-f-]{36}\.parquet")  # a log segment: its first seq, a uuid


class LogWindow:
    """Where the compaction crasher child is, read from storage and the catalog only (not from what it
    prints): which files it wrote that no row references yet, which queued files it deleted. What is there
    when the window opens (left by earlier kills) does not count."""

    def __init__(self, shoal: Shoal) -> None:
        self.shoal = shoal
        self.folder = shoal.log_dir(NAME, VERSION)
        self.files_before = set(shoal.storage.list_files(self.folder))
        self.queued_before = {path for path, _ in self.queued()}

    def queued(self) -> list[tuple[str, str]]:
        """(path, reason) of every log file of the data source waiting in the GC queue."""
        with Session(self.shoal.engine) as s:
            rows = s.execute(select(GarbageFile.path, GarbageFile.reason).where(
                GarbageFile.deleted_at.is_(None), GarbageFile.path.startswith(f"{self.folder}/"))).all()
        return [(path, reason) for path, reason in rows]

    def unreferenced(self) -> tuple[list[int], int]:
        """(the first seqs of the new segment files no row references, the head); listed before the rows are
        read, so a commit landing in between shows its file as referenced."""
        files = set(self.shoal.storage.list_files(self.folder)) - self.files_before
        head = self.shoal.get_data_source(NAME, VERSION).head_seq
        referenced = {seg.path for seg in self.shoal.log_segments(NAME, VERSION)}
        firsts = [int(m.group(1)) for p in files - referenced if (m := _SEGMENT_FILE.fullmatch(p.rsplit("/", 1)[1]))]
        return firsts, head

    def inside(self, target: str) -> bool:
        """True while the child is inside `target`'s window (see TARGETS)."""
        if target in ("compact", "upload"):
            firsts, head = self.unreferenced()
            # A rewrite starts at an old seq; a batch's segment right after the head it will move.
            return any(first <= head if target == "compact" else first > head for first in firsts)
        queued = self.queued()
        if target == "gc":
            return any(p not in self.queued_before and not self.shoal.storage.exists(p) for p, _ in queued)
        return any(reason == COMPACTED and p not in self.queued_before and self.shoal.storage.exists(p)
                   for p, reason in queued)



def freeze_child_inside(proc: subprocess.Popen[str], window: LogWindow, target: str, lines: list[str]) -> None:
    """Stop the crasher child inside `target`'s window, appending what it prints meanwhile to `lines`."""
    assert proc.stdout is not None

    def drain() -> None:
        # The child prints every step: read what is there so that a full pipe never blocks it.
        while io_select.select([proc.stdout], [], [], 0)[0] and (line := proc.stdout.readline()):
            lines.append(line)

    # A batch's file lives a few milliseconds before its COMMIT: sample the stopped child for that one.
    freeze_inside(proc.pid, lambda: window.inside(target), 60, f"the child to be inside {target}", tick=drain,
                  narrow=target == "upload")
