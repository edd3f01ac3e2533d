"""The filesystem queue's domain index (``domains/<h>/``): list_domain without a scan,
exact (C13), never built from addresses (C12), rebuilt and pruned by recovery."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.layout import DOMAIN_ANCHOR, DOMAIN_DIR_RE, EntryName
from queue_ref.io import OsIO
from queue_ref.storage import Capability, Recipient, Schedule


def fill(q: FsQueue) -> list[str]:
    ids = []
    for i, rcpts in enumerate((["a@One.example", "b@two.example"], ["c@one.example"],
                               ["d@x/../y.example", "e@ONE.EXAMPLE"])):
        with q.enqueue(f"s{i}@example.org") as enq:
            enq.write(b"Subject: %d\r\n\r\nbody\r\n" % i)
            ids += [h.entry_id for h in enq.commit([Recipient(r, Schedule(i)) for r in rcpts])]
    return ids


def index_links(root: Path) -> list[str]:
    out = []
    for d in sorted(os.listdir(root / "domains")):
        assert DOMAIN_DIR_RE.match(d), d  # a hash, never a name made of an address
        out += sorted(n for n in os.listdir(root / "domains" / d) if n != DOMAIN_ANCHOR)
    return out


def test_list_domain_is_exact_and_follows_every_state(tmp_path: Path) -> None:
    q = FsQueue(str(tmp_path / "q"))
    assert Capability.DOMAIN_INDEX in q.capabilities
    a, b, c, d, e = fill(q)
    assert [h.entry_id for h in q.list_domain("one.EXAMPLE")] == [a, c, e]  # oldest first
    assert [h.entry_id for h in q.list_domain("two.example")] == [b]
    assert [h.entry_id for h in q.list_domain("x/../y.example")] == [d]
    assert list(q.list_domain("none.example")) == []
    qa = {h.entry_id: h for h in q.list_queue()}
    held = q.hold(qa[a])
    f = q.send_start(qa[c])
    assert held is not None and f is not None
    assert [h.entry_id for h in q.list_domain("one.example")] == [e]
    back = q.send_cancel(f, Schedule(99))
    assert back is not None
    got = list(q.list_domain("one.example"))
    assert [(h.entry_id, h.schedule) for h in got] == [(c, Schedule(99)), (e, Schedule(2))]
    assert q.release(held) is not None
    assert [h.entry_id for h in q.list_domain("one.example")] == [a, c, e]
    # drain: every index link goes with its entry
    for h in list(q.list_queue()):
        p = q.drop(h)
        assert p is not None and q.cleanup(p)
    assert index_links(tmp_path / "q") == []
    assert q.footprint().objects == 0
    q.close()


def test_recovery_rebuilds_a_lost_index_and_prunes_stale_links(tmp_path: Path) -> None:
    root = tmp_path / "q"
    q = FsQueue(str(root))
    a, b, c, _, e = fill(q)
    q.close()
    # a power cut lost the (never synced) index links of one domain
    dom = root / "domains" / os.path.basename(q.layout.domain_dir("one.example"))
    for n in os.listdir(dom):
        os.unlink(dom / n)
    # and left a link of an entry that is gone, and one of an entry of another domain
    gone = EntryName(a.rsplit(".", 1)[0], 7)
    os.symlink(gone.entry_id, dom / gone.entry_id)
    os.symlink(b, dom / b)
    q = FsQueue(str(root))
    assert [h.entry_id for h in q.list_domain("one.example")] == [a, c, e]
    assert sorted(os.listdir(dom)) == sorted([a, c, e, DOMAIN_ANCHOR])  # pruned, rebuilt
    anchor = os.stat(dom / DOMAIN_ANCHOR)
    assert all(os.stat(dom / n).st_ino == anchor.st_ino for n in (a, c, e))
    q.close()


def test_a_foreign_name_in_the_index_is_never_listed(tmp_path: Path) -> None:
    """An index link is a hint: an entry of another domain placed in a domain's directory
    (while another queue process keeps recovery from pruning it) is not listed there."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    a, b, c, _, e = fill(q)
    dom = Path(q.layout.domain_dir("one.example"))
    os.symlink(b, dom / b)
    assert [h.entry_id for h in q.list_domain("one.example")] == [a, c, e]
    assert [h.entry_id for h in q.list_domain("two.example")] == [b]
    q.close()


def test_index_links_are_hard_links_to_the_domain_anchor(tmp_path: Path) -> None:
    """One inode per domain: every index link is a name of ``domains/<h>/anchor``, which
    no listing shows; the last entry leaving takes its name, the anchor stays."""
    q = FsQueue(str(tmp_path / "q"))
    a, _, c, _, e = fill(q)
    dom = Path(q.layout.domain_dir("one.example"))
    anchor = os.stat(dom / DOMAIN_ANCHOR)
    assert anchor.st_size == 0 and anchor.st_nlink == 4  # the anchor and a, c, e
    assert {os.stat(dom / n).st_ino for n in (a, c, e)} == {anchor.st_ino}
    assert not os.path.islink(dom / a)
    assert [h.entry_id for h in q.list_domain("one.example")] == [a, c, e]
    for h in list(q.list_domain("one.example")):
        p = q.drop(h)
        assert p is not None and q.cleanup(p)
    assert os.listdir(dom) == [DOMAIN_ANCHOR] and os.stat(dom / DOMAIN_ANCHOR).st_nlink == 1
    q.close()


class TwoLinksPerFile(OsIO):
    """A file system whose files take at most three names (ext4 stops at 65,000)."""

    def link(self, src: str, dst: str) -> None:
        if os.stat(src, follow_symlinks=False).st_nlink >= 3:
            raise OSError(errno.EMLINK, os.strerror(errno.EMLINK), src)
        super().link(src, dst)


def test_a_full_anchor_is_replaced_and_every_entry_stays_indexed(tmp_path: Path) -> None:
    """EMLINK on the anchor: a fresh anchor is renamed over it, earlier links keep the old
    inode, and every entry is still listed; a missing anchor is made again."""
    root = tmp_path / "q"
    q = FsQueue(str(root), io=TwoLinksPerFile())
    ids = []
    for i in range(7):
        with q.enqueue("s@example.org") as enq:
            enq.write(b"x\r\n")
            ids += [h.entry_id for h in enq.commit([Recipient("r@full.example", Schedule(i))])]
    dom = Path(q.layout.domain_dir("full.example"))
    assert [h.entry_id for h in q.list_domain("full.example")] == ids
    assert len({os.stat(dom / n).st_ino for n in ids}) == 4  # 2 + 2 + 2 + 1
    assert sorted(os.listdir(dom)) == sorted([*ids, DOMAIN_ANCHOR])  # no anchor.<owner> left
    os.unlink(dom / DOMAIN_ANCHOR)  # damaged or lost to a power cut: only a hint is gone
    with q.enqueue("s@example.org") as enq:
        enq.write(b"x\r\n")
        ids += [h.entry_id for h in enq.commit([Recipient("r@full.example", Schedule(9))])]
    assert [h.entry_id for h in q.list_domain("full.example")] == ids
    q.close()


def test_an_index_of_symlinks_from_earlier_versions_is_still_read(tmp_path: Path) -> None:
    """Queues written before the anchor held one symlink per entry: they list the same,
    and recovery prunes them like any other name."""
    root = tmp_path / "q"
    q = FsQueue(str(root))
    a, b, c, d, e = fill(q)
    q.close()
    dom = root / "domains" / os.path.basename(q.layout.domain_dir("one.example"))
    for n in (a, c, e):
        os.unlink(dom / n)
        os.symlink(n, dom / n)
    os.unlink(dom / DOMAIN_ANCHOR)
    q = FsQueue(str(root))
    assert [h.entry_id for h in q.list_domain("one.example")] == [a, c, e]
    p = q.drop(next(iter(q.list_domain("one.example"))))
    assert p is not None and q.cleanup(p)
    assert sorted(index_links(root)) == sorted([b, c, d, e])
    q.close()
