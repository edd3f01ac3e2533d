"""Broken variants of the project's backends that change what the queue hands back on
real mail data, without any crash: what a stored address is, which entries a listing
shows, what a body is.  Each passes the lockstep's tame data (lower-case ASCII local
parts, random bodies, schedules up to 10**9) and is caught once the data is as varied as
mail (``conformance/harness/mail_data.py``); ``docs/certify.md`` names the check and
the clause.  Never use them for mail.

    queue-ref certify conformance.examples.broken_mail_data:fs_local_part_lowered \\
        --only lockstep
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence

from queue_ref.fsqueue import FsQueue
from queue_ref.io import IO
from queue_ref.kv.kv_queue import KvQueue
from queue_ref.storage import Enqueuer, QueuedMail, Recipient, Storage


class _RewritingEnqueuer(Enqueuer):
    """An Enqueuer that hands ``inner`` every recipient's address rewritten by
    ``address``, and the body with a final CRLF held back and dropped when
    ``strip_final_crlf``."""

    def __init__(self, inner: Enqueuer, address: Callable[[str], str] = str,
                 strip_final_crlf: bool = False) -> None:
        self.inner = inner
        self.address = address
        self.strip = strip_final_crlf
        self.held = b""

    @property
    def message_id(self) -> str | None:
        return self.inner.message_id

    def write(self, data: bytes) -> None:
        if not self.strip:
            self.inner.write(data)
            return
        data = self.held + bytes(data)
        self.held = data[-2:]
        if data[:-2]:
            self.inner.write(data[:-2])

    def commit(self, rcpts: Sequence[Recipient]) -> list[QueuedMail]:
        if self.held and self.held != b"\r\n":  # the bug: a final CRLF is never written
            self.inner.write(self.held)
        self.held = b""
        return self.inner.commit([Recipient(self.address(r.address), r.schedule, r.zone)
                                  if isinstance(r, Recipient) else r for r in rcpts])

    def abort(self) -> None:
        self.inner.abort()


def _lower_local(address: str) -> str:
    local, at, domain = address.rpartition("@")
    return local.lower() + at + domain


def fs_local_part_lowered(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue that stores each recipient with its local part lower-cased,
    as a site whose own mailboxes are case-insensitive may (RFC 5321 2.4: a local part is
    case-sensitive; ``Rcpt@`` and ``rcpt@`` are two mailboxes elsewhere).  The domain is
    kept, so the tame data (lower-case local parts; ``C.Example``) never shows it.  The
    lockstep check fails it on C6 (``read_inflight`` gives ``meta.rcpt`` other than
    committed)::

        queue-ref certify conformance.examples.broken_mail_data:fs_local_part_lowered \\
            --only lockstep
    """

    class LocalPartLowered(FsQueue):
        def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
            return _RewritingEnqueuer(super().enqueue(mail_from, params), _lower_local)

    return _open_fs(LocalPartLowered, root, io)


def kv_addresses_nfc(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) that stores the sender and each recipient in Unicode
    NFC, as a layer that "canonicalizes" UTF-8 may: ``Pe\\u0301rez@`` comes back as
    ``P\\u00e9rez@``, the Angstrom sign as ``\\u00c5``, which are other mailboxes (RFC 6531
    asks for no normalization of local parts).  ASCII data never shows it.  The
    lockstep check fails it on C6 (``meta.rcpt`` or ``meta.mail_from``)::

        queue-ref certify conformance.examples.broken_mail_data:kv_addresses_nfc \\
            --only lockstep
    """

    def nfc(address: str) -> str:
        return unicodedata.normalize("NFC", address)

    class AddressesNfc(KvQueue):
        def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
            return _RewritingEnqueuer(super().enqueue(nfc(mail_from), params), nfc)

    store = AddressesNfc.open_log(root, io)
    assert isinstance(store, AddressesNfc)
    return store


#: The last second a signed 32-bit time_t holds (19 January 2038).
TIME_T_MAX = 2**31 - 1


def fs_far_future_unlisted(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue whose ``list_queue`` leaves out entries due after
    ``2**31 - 1`` (a lister that compares times as a signed 32-bit ``time_t``, or drops a
    schedule past 2038 as bogus): such an entry is stored and can be read, but no
    scheduler ever sees it, and it is never delivered, bounced or expired.  The
    contract lets a schedule go to ``2**63 - 1``; the tame data stops at 10**9.  The
    lockstep check fails it on API (``list_queue`` misses a queued entry; C13)::

        queue-ref certify conformance.examples.broken_mail_data:fs_far_future_unlisted \\
            --only lockstep
    """

    class FarFutureUnlisted(FsQueue):
        def list_queue(self) -> Iterator[QueuedMail]:
            return (h for h in super().list_queue() if h.schedule.at <= TIME_T_MAX)

    return _open_fs(FarFutureUnlisted, root, io)


def kv_domain_trailing_dot(root: str, io: IO | None = None) -> Storage:
    """The KV queue (log engine) whose ``list_domain`` takes the domain asked without its
    trailing dot (``a.example.`` as ``a.example``, as DNS would): entries at
    ``a.example.`` are never listed for it, and those at ``a.example`` are listed instead.
    The contract compares domains lower-cased and nothing else, so an ETRN for one
    flushes the other's mail.  The listing check fails it on API (``list_domain`` of a
    domain the model holds; C13)::

        queue-ref certify conformance.examples.broken_mail_data:kv_domain_trailing_dot \\
            --only listing
    """

    class TrailingDotDropped(KvQueue):
        def list_domain(self, domain: str) -> Iterator[QueuedMail]:
            return super().list_domain(domain.rstrip(".") if domain != "." else domain)

    store = TrailingDotDropped.open_log(root, io)
    assert isinstance(store, TrailingDotDropped)
    return store


def fs_body_final_crlf_stripped(root: str, io: IO | None = None) -> Storage:
    """The filesystem queue that stores a body without its final CRLF (a receiver that
    takes the CRLF before the terminating ``.`` as part of the terminator): the mail
    is sent on one line short, and a body that ends in a line of its own loses it.  A
    random body ends in CRLF once in 65 536, so the tame data never shows it; mail's
    bodies end in CRLF, a dot line, a bare CR or LF, or nothing.  The lockstep check
    fails it on C6 (the body, or ``meta.body_size``, read back)::

        queue-ref certify conformance.examples.broken_mail_data:fs_body_final_crlf_stripped \\
            --only lockstep
    """

    class FinalCrlfStripped(FsQueue):
        def enqueue(self, mail_from: str, params: Mapping[str, str] | None = None) -> Enqueuer:
            return _RewritingEnqueuer(super().enqueue(mail_from, params),
                                      strip_final_crlf=True)

    return _open_fs(FinalCrlfStripped, root, io)


def _open_fs(cls: type[FsQueue], root: str, io: IO | None) -> Storage:
    """``cls`` at ``root``: on the real disk when no I/O seam is given, else through it."""
    return cls(root) if io is None else cls(root, io)
