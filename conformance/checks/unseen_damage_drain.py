"""Damage a store did not see must not change how it drains (C8), for damage-at-rest.

A store that opens over a damaged file, reports nothing and serves every message whole
has either met damage that changes nothing, or trusted bytes it never checked.  Bytes
that steer what the store keeps do not show in what it serves: a table's entry count
that decides which tables a merge takes (a count flipped high keeps a table out of
every merge, its dead keys on the disk for good).  So after such a trial of the deep
template the store is used once more as it will be in service: opened, one message of
``DEEP_BODY`` bytes (past a buffered store's write buffer again) enqueued, delivered
and cleaned up, closed.  The bytes its directory then holds are compared with those of
the undamaged template treated the same way (``baseline``): more than ``SLACK_RATIO``
times them plus ``SLACK_BYTES``, still after the store is used a second time (against
the template used twice), is C8 (nothing outside the footprint grows with use; here it
stays for good).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

from conformance.checks.damage_templates import DEEP_BODY, DOMAIN, deep_body
from conformance.checks.disk_growth_check import Tree, drain, measure
from conformance.checks.file_damage import copy_tree
from conformance.harness.backend_factory import Backend
from queue_ref.storage import QueueError, Recipient, Schedule

#: How much more a store served over damage it did not see may hold once used again
#: and drained, than the undamaged one: background work (LevelDB's compactions) makes
#: two runs differ a little.  (The undamaged tree holds a disk reserve too, when the
#: store keeps one: the ratio is of the whole.)
SLACK_RATIO = 1.1
SLACK_BYTES = 1 << 20
#: The message that uses the store again.
AGAIN = deep_body(9, DEEP_BODY)


def used_again(backend: Backend, root: str) -> Tree:
    """Open the queue at ``root``, drain it, enqueue ``AGAIN`` to one recipient, deliver
    and clean it up, close: the tree the store leaves."""
    store = backend.open(root)
    try:
        drain(store)
        with store.enqueue("again@example.org") as enq:
            enq.write(AGAIN)
            enq.commit([Recipient(f"again@{DOMAIN}", Schedule(0))])
        drain(store)
    finally:
        store.close()
    return measure(root)


def baseline(backend: Backend, template: str, times: int = 1) -> Tree:
    """The tree the undamaged ``template`` leaves once drained and used again ``times``
    times."""
    work = tempfile.mkdtemp(prefix="queue-ref-atrest-baseline-")
    try:
        root = os.path.join(work, "q")
        copy_tree(template, root)
        tree = used_again(backend, root)
        for _ in range(times - 1):
            tree = used_again(backend, root)
        return tree
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _over(got: Tree, undamaged: Tree) -> bool:
    return got.bytes > undamaged.bytes * SLACK_RATIO + SLACK_BYTES


def judge(backend: Backend, root: str, undamaged: Callable[[int], Tree]
          ) -> tuple[str, str] | None:
    """Use the served store at ``root`` again (``used_again``); the clause and what is
    wrong with the tree it leaves next to the undamaged one (``undamaged(n)``: the
    template used ``n`` times), or None.  An excess must last: a store whose background
    work (LevelDB's compactions, abandoned at a close) left more this time is used once
    more, and judged against the template used twice.  A typed error meanwhile is the
    store seeing the damage after all (a merge reading a damaged block), which it may."""
    try:
        got = used_again(backend, root)
        if _over(got, undamaged(1)):
            got = used_again(backend, root)
    except QueueError:
        return None
    except Exception as e:
        return "C9", (f"using the served store again raised {type(e).__name__} ({e}), not a "
                      "QueueError")
    base = undamaged(2)
    if not _over(got, base):
        return None
    return "C8", (f"the store reported no damage and served every message whole, but used "
                  f"again twice (each time a message of {len(AGAIN)} bytes enqueued, "
                  f"delivered and cleaned up) its drained directory holds {got.bytes} "
                  f"bytes, where the undamaged template so used holds {base.bytes}: damage "
                  "it did not check for steers what it keeps (a count that decides what a "
                  "merge takes), and dead data stays on the disk for good")
