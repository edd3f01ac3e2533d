"""Names and paths of the filesystem queue: what lives where, and how ids are built.

Layout under the queue's root (seed 001, with ``tmp/``, ``quarantine/`` and ``owners/`` added)::

    data/<msgid>                 the message, one file: the raw body, then its checksummed
                                 envelope record (sender, params, body size and digest, every
                                 recipient with its zone and initial schedule), then a
                                 fixed-size trailer giving the record's length
    data/<msgid>.<i>             the entry's reference: a hard link to data/<msgid> per
                                 recipient not yet cleaned up, for messages of two or
                                 more recipients (an entry whose link damage removed
                                 leaves it, so recovery can name the entry lost)
    data/<msgid>.<i>.sched       the entry's schedule record, once rescheduled or cancelled
    data/<msgid>.<i>.<owner>.tmp a schedule record being written by <owner>
    queue/<msgid>.<i>            a hard link to data/<msgid>           (QUEUED)
    inflight/<msgid>.<i>@<owner> the same link, claimed by <owner>     (INFLIGHT)
    cleanup/<msgid>.<i>          the same link                         (PENDING_CLEANUP)
    held/<msgid>.<i>             the same link, set aside              (HELD)
    domains/<h>/<msgid>.<i>      the domain index: a hard link to domains/<h>/anchor, for every
                                 entry whose recipient's domain hashes to <h> (the first
                                 32 hex digits of the SHA-256 of the lower-cased domain:
                                 never a name built from an address).  A hint, never
                                 trusted alone: see ``FsQueue.list_domain``
    tmp/<owner>/<msgid>          a message file being written by <owner>
    quarantine/                  corrupt entries, their notes, and junk found in our directories
    owners/<owner>.lock          flock-held while <owner> (one open FsQueue) is alive
    owners/gate.lock             serialises opening and recovery (see fs_recovery.py)
    queue-ref.format             written when the queue is made (or converted): its entries
                                 are hard links

An entry's link is a hard link to its message file, made before the commit rename gives
the file its name ``data/<msgid>``: the file's link count counts the entries that still
hold it (their links and references), so the last entry released frees it (Mailismus's
hard links, seed 003), and no entry allocates an inode of its own.

The format before 2026-11-28 linked entries with symlinks ``-> ../data/<msgid>``, one
inode each; it has no ``queue-ref.format``.  Recovery converts such a
queue when no other process has it open; otherwise it refuses and names ``queue-ref
repair`` (see fs_recovery.py).

Ids are never built from addresses.  A message id is ``<time_ns:016x><counter:06x><owner>``:
time-ordered, and unique across processes because ``owner`` is a fresh token per open queue
(random unless given; see ``FsQueue``).  The time comes from the queue's ``clock``
(``time.time_ns`` unless given).  An entry id is ``<msgid>.<index>``.  Nothing here touches
the disk.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from os.path import join

DIRS = ("data", "queue", "inflight", "cleanup", "held", "domains", "tmp", "quarantine",
        "owners")
LINK_DIRS = ("queue", "inflight", "cleanup", "held")

OWNER_LEN = 16
MSGID_LEN = 16 + 6 + OWNER_LEN

_OWNER = rf"[0-9a-f]{{{OWNER_LEN}}}"
_MSGID = rf"[0-9a-f]{{{MSGID_LEN}}}"
_INDEX = r"(?:0|[1-9][0-9]{0,8})"

OWNER_RE = re.compile(rf"{_OWNER}\Z")
MSGID_RE = re.compile(rf"{_MSGID}\Z")
ENTRY_RE = re.compile(rf"(?P<msgid>{_MSGID})\.(?P<index>{_INDEX})\Z")
INFLIGHT_RE = re.compile(rf"(?P<msgid>{_MSGID})\.(?P<index>{_INDEX})@(?P<owner>{_OWNER})\Z")
DATA_RE = re.compile(  # every name we create under data/
    rf"(?P<msgid>{_MSGID})(?:\.(?P<index>{_INDEX})"
    rf"(?:\.(?P<sched>sched)|\.(?P<owner>{_OWNER})\.tmp)?)?\Z")
DOMAIN_DIR_RE = re.compile(r"[0-9a-f]{32}\Z")
DOMAIN_ANCHOR = "anchor"  # see Layout.domain_anchor; "anchor.<owner>" while one is replaced
OWNER_LOCK_RE = re.compile(rf"(?P<owner>{_OWNER})\.lock\Z")

SCHED = "sched"
GATE = "gate.lock"
FORMAT_MARKER = "queue-ref.format"
FORMAT_TEXT = b"queue-ref filesystem queue: entries are hard links to their message files\n"


def domain_of(address: str) -> str:
    """The part after the last ``@``, lower-cased (as every backend's domain listing)."""
    return address.rpartition("@")[2].lower()


def new_owner() -> str:
    """A fresh random owner token (64 bits)."""
    return secrets.token_hex(OWNER_LEN // 2)


def is_owner_token(value: object) -> bool:
    """Whether ``value`` is an owner token: ``OWNER_LEN`` lowercase hex digits."""
    return isinstance(value, str) and OWNER_RE.match(value) is not None


def owner_of_msgid(msgid: str) -> str:
    """The owner that created (and, until it commits, alone may touch) a message."""
    return msgid[MSGID_LEN - OWNER_LEN:]


@dataclass(frozen=True, order=True)
class EntryName:
    """One entry: a message id and a recipient index."""

    msgid: str
    index: int

    @property
    def entry_id(self) -> str:
        return f"{self.msgid}.{self.index}"

    @property
    def legacy_target(self) -> str:
        """The target of this entry's symlinks in the old format (converted by recovery)."""
        return f"../data/{self.msgid}"

    def inflight_name(self, owner: str) -> str:
        return f"{self.entry_id}@{owner}"

    @staticmethod
    def parse(entry_id: str) -> EntryName | None:
        """The entry named ``<msgid>.<index>``, or None for any other string."""
        m = ENTRY_RE.match(entry_id)
        return EntryName(m["msgid"], int(m["index"])) if m else None


def parse_inflight(name: str) -> tuple[EntryName, str] | None:
    """``<msgid>.<index>@<owner>`` -> (entry, owner), or None."""
    m = INFLIGHT_RE.match(name)
    if m is None:
        return None
    return EntryName(m["msgid"], int(m["index"])), m["owner"]


class Layout:
    """Absolute paths of everything under one root.  Pure string work."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.data = join(root, "data")
        self.queue = join(root, "queue")
        self.inflight = join(root, "inflight")
        self.cleanup = join(root, "cleanup")
        self.held = join(root, "held")
        self.domains = join(root, "domains")
        self.tmp = join(root, "tmp")
        self.quarantine = join(root, "quarantine")
        self.owners = join(root, "owners")
        self.gate = join(self.owners, GATE)
        self.format_marker = join(root, FORMAT_MARKER)

    def dirs(self) -> list[str]:
        return [join(self.root, d) for d in DIRS]

    # -- messages --

    # Paths are built with f-strings on the hot path: every part is a validated name (no
    # slash, never absolute), so the result is what os.path.join would give.

    def msg_file(self, msgid: str) -> str:
        """``data/<msgid>``: the committed message (body, envelope record, trailer)."""
        return f"{self.data}/{msgid}"

    def ref(self, e: EntryName) -> str:
        """``data/<msgid>.<i>``: the entry's reference, a hard link (2+ recipients)."""
        return f"{self.data}/{e.msgid}.{e.index}"

    def sched(self, e: EntryName) -> str:
        """``data/<msgid>.<i>.sched``: the entry's schedule record, if it has one."""
        return f"{self.data}/{e.msgid}.{e.index}.{SCHED}"

    def sched_tmp(self, e: EntryName, owner: str) -> str:
        return f"{self.data}/{e.msgid}.{e.index}.{owner}.tmp"

    def tmp_owner(self, owner: str) -> str:
        return f"{self.tmp}/{owner}"

    def tmp_msg(self, owner: str, msgid: str) -> str:
        return f"{self.tmp}/{owner}/{msgid}"

    # -- links --

    def queue_link(self, e: EntryName) -> str:
        return f"{self.queue}/{e.msgid}.{e.index}"

    def inflight_link(self, e: EntryName, owner: str) -> str:
        return f"{self.inflight}/{e.msgid}.{e.index}@{owner}"

    def cleanup_link(self, e: EntryName) -> str:
        return f"{self.cleanup}/{e.msgid}.{e.index}"

    def held_link(self, e: EntryName) -> str:
        return f"{self.held}/{e.msgid}.{e.index}"

    # -- the domain index --

    def domain_dir(self, domain: str) -> str:
        """``domains/<h>``: the index directory of a recipient domain (lower-cased by the
        caller); its name is a hash, so no address ever becomes a path."""
        h = hashlib.sha256(domain.encode("utf-8", "surrogateescape")).hexdigest()[:32]
        return f"{self.domains}/{h}"

    def domain_link(self, domain: str, e: EntryName) -> str:
        return f"{self.domain_dir(domain)}/{e.msgid}.{e.index}"

    def domain_anchor(self, domain: str) -> str:
        """``domains/<h>/anchor``: the empty file every index link of the domain is a hard
        link to (a hard link to an existing inode costs a tenth of a new symlink's inode
        on ext4 once earlier ones were freed).  Its name is no entry name."""
        return f"{self.domain_dir(domain)}/{DOMAIN_ANCHOR}"

    # -- owners and quarantine --

    def owner_lock(self, owner: str) -> str:
        return join(self.owners, f"{owner}.lock")

    def quarantined(self, name: str) -> str:
        return join(self.quarantine, name)


class MessageIds:
    """Time-ordered message ids for one owner; thread-safe.

    ``clock`` gives nanoseconds (a non-negative int); it is called once per id, under a
    lock.  Ids never go back in time even if the clock does, and stay unique within the
    owner through the counter (24 bits, wrapping).
    """

    def __init__(self, owner: str, clock: Callable[[], int] = time.time_ns) -> None:
        self.owner = owner
        self.clock = clock
        self._lock = threading.Lock()
        self._last = 0
        self._counter = 0

    def next(self) -> str:
        """The next id.  ``ValueError`` (nothing consumed) if the clock returns anything
        but a non-negative int."""
        with self._lock:
            t = self.clock()
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise ValueError(f"the message id clock returned {t!r}, not a non-negative "
                                 "int of nanoseconds")
            now = max(t, self._last)
            self._last = now
            self._counter = (self._counter + 1) % (1 << 24)
            return f"{now % (1 << 64):016x}{self._counter:06x}{self.owner}"
