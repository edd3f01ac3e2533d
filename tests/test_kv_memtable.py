"""The log engine's memtable limits: a relay's bodies in flight die in memory, a big body
streamed in does not stay there (``KV.spill``)."""

from __future__ import annotations

import os
from pathlib import Path

from conformance.checks import streaming_check
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import API
from conformance.harness.check_results import Status
from conformance.harness.suite_profiles import QUICK
from queue_ref.io import OsIO
from queue_ref.kv.core import BATCH_BYTES, CHUNK, SPILL_AFTER
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.kv.logengine import LogEngine
from queue_ref.kv.logengine.engine import LOG_LIMIT_MAX, SPILL_LIMIT
from queue_ref.storage import Recipient, Schedule

MiB = 1 << 20


class TableBytes(OsIO):
    """Counts the bytes written to table files."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: set[int] = set()
        self.written = 0

    def open_create(self, path: str, *, exclusive: bool = True, append: bool = False) -> int:
        fd = super().open_create(path, exclusive=exclusive, append=append)
        if path.endswith(".tbl.tmp"):
            self.tables.add(fd)
        return fd

    def write(self, fd: int, data: bytes) -> int:
        if fd in self.tables:
            self.written += len(data)
        return super().write(fd, data)

    def close(self, fd: int) -> None:
        self.tables.discard(fd)
        super().close(fd)


def _in_flight(kv: LogEngine, values: int, window: int) -> None:
    """``values`` values of 1 MiB put one after another, each deleted once ``window``
    more were put: mail in flight, taken in and delivered."""
    body = os.urandom(MiB)
    for i in range(values):
        kv.put(b"body%06d" % i, body, sync=False)
        if i >= window:
            kv.delete(b"body%06d" % (i - window), sync=False)


def test_bodies_in_flight_die_in_memory(tmp_path: Path) -> None:
    """With the default limits, 100 bodies of 1 MiB with 10 in flight at a time cost at
    most the one flush the log's limit makes (the bodies then live, about 10 MiB) in
    table writes; with the memtable of 4 MiB the engine had until 2026-11-29 nearly every
    body went to a table before it was deleted."""
    io = TableBytes()
    # the default limits of a file system of 1 GiB or more (the log's is at most a
    # sixteenth of the file system)
    kv = LogEngine(str(tmp_path / "default"), io, log_limit=LOG_LIMIT_MAX)
    try:
        _in_flight(kv, 100, 10)
    finally:
        kv.close()
    assert io.written <= 16 * MiB, io.written

    small = TableBytes()
    kv = LogEngine(str(tmp_path / "small"), small, memtable_limit=4 * MiB)
    try:
        _in_flight(kv, 100, 10)
    finally:
        kv.close()
    assert small.written >= 60 * MiB, small.written


class PeakMemtable(LogEngine):
    """Records the most the memtable held after a write returned (``peak``; since the
    first hint, ``spilled_peak``) and the hints."""

    peak = spilled_peak = spills = 0

    def write(self, *args: object, **kwargs: object) -> None:
        super().write(*args, **kwargs)  # type: ignore[arg-type]
        held = self._mem.approx_bytes
        PeakMemtable.peak = max(PeakMemtable.peak, held)
        if PeakMemtable.spills:
            PeakMemtable.spilled_peak = max(PeakMemtable.spilled_peak, held)

    def spill(self) -> None:
        PeakMemtable.spills += 1
        super().spill()


def _tables(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.endswith(".tbl"))


def test_a_big_body_spills_and_mail_of_a_few_megabytes_does_not(tmp_path: Path) -> None:
    """Ten messages of 1 MiB and one of 3 MiB leave no table (nothing told the engine to
    spill: that starts at ``SPILL_AFTER`` bytes of one body); a body of 40 MiB written in
    64 KiB pieces, once past ``SPILL_AFTER``, keeps the memtable under ``SPILL_LIMIT`` and
    a batch while it streams in (its first hint flushes the earlier mail too), and reads
    back whole."""
    root = tmp_path / "q"
    PeakMemtable.peak = PeakMemtable.spilled_peak = PeakMemtable.spills = 0
    q = KvQueue.open_log(str(root), engine=lambda p, io: PeakMemtable(p, io))
    try:
        for size in [MiB] * 10 + [SPILL_AFTER - MiB]:
            with q.enqueue("a@example.org") as enq:
                enq.write(os.urandom(size))
                enq.commit([Recipient("b@example.org", Schedule(0))])
        assert PeakMemtable.spills == 0
        assert _tables(root) == []
        assert PeakMemtable.peak > SPILL_LIMIT + BATCH_BYTES + 64 * 1024  # see below

        body = os.urandom(40 * MiB)
        with q.enqueue("a@example.org") as enq:
            for off in range(0, len(body), CHUNK):
                enq.write(body[off:off + CHUNK])
            [big] = enq.commit([Recipient("c@example.org", Schedule(0))])
        assert PeakMemtable.spills == (len(body) - SPILL_AFTER) // BATCH_BYTES + 1
        assert PeakMemtable.spilled_peak <= SPILL_LIMIT + BATCH_BYTES + 64 * 1024, \
            PeakMemtable.spilled_peak
        assert _tables(root) != []
        mail = q.send_start(big)
        with q.read_inflight(mail) as r:
            assert r.read_all() == body
    finally:
        q.close()


def test_the_streaming_check_fails_an_engine_that_ignores_the_hint() -> None:
    """A 100 MB body keeps the heap under 16 MiB on the log engine; on the variant whose
    engine ignores ``spill`` the memtable's 32 MiB hold it, and the streaming check says
    so."""
    real = streaming_check.run(Backend.from_factory("conformance.examples.backends:kv_log"),
                               QUICK)
    assert real.status is Status.PASS, real.findings
    broken = streaming_check.run(
        Backend.from_factory("conformance.examples.broken_backends:kv_log_never_spills"), QUICK)
    assert broken.status is Status.FAIL
    assert [f.clause for f in broken.findings] == [API]
    assert "grew by" in broken.findings[0].detail and "written" in broken.findings[0].detail


def test_a_big_body_moved_to_quarantine_spills(tmp_path: Path) -> None:
    """Quarantining a message moves its chunks in batches; once 4 MiB have moved the
    engine is told after each batch, so a 40 MiB body is not gathered in the memtable."""
    PeakMemtable.peak = PeakMemtable.spilled_peak = PeakMemtable.spills = 0
    q = KvQueue.open_log(str(tmp_path / "q"), engine=lambda p, io: PeakMemtable(p, io))
    try:
        with q.enqueue("a@example.org") as enq:
            enq.write(os.urandom(40 * MiB))
            [mail] = enq.commit([Recipient("c@example.org", Schedule(0))])
        PeakMemtable.spilled_peak = PeakMemtable.spills = 0
        q._core.quarantine_chunks(int(mail.message_id))
        assert PeakMemtable.spills > 0
        assert PeakMemtable.spilled_peak <= SPILL_LIMIT + 2 * MiB, PeakMemtable.spilled_peak
    finally:
        q.close()
