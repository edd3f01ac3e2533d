"""The relay's delivery decisions, as one table and a few small functions.

An *entry* is one recipient of a message in the relay's queue.  When an attempt to
deliver it ends, the relay (``queue_ref/relay/delivery_scheduler.py``) decides its next
state from what the attempt met, when the message arrived, its sender and its attempts
so far; and it reports failures to someone.  What docs/relay.md ("Delivering") promises,
written as rules that the table and the functions below encode and nothing else may add to:

D1. An attempt meets one outcome (``Attempt``).  ``FATE`` says what each outcome is:
    a 2xx reply delivers; a 4xx reply, no connection, a connection lost in the
    transaction, an error inside the relay and a temporary routing failure (SERVFAIL, no
    address) are temporary; a 5xx reply and a permanent routing failure (NXDOMAIN, null
    MX) are permanent.
D2. Delivered: the entry is done (``send_done``, ``cleanup``); nothing is reported.
D3. Temporary, while the message is younger than its lifetime (``now - arrival <
    lifetime``; ``bounce_queue_lifetime`` for the null sender, else
    ``maximal_queue_lifetime``; measured from arrival, never from the last attempt): the
    entry is queued again with ``attempts + 1`` and due at ``now + max(1, delay -
    jitter)``, cut to whole seconds.  ``delay`` after the n-th failure is
    ``retry_delays[min(n, len) - 1]`` when ``retry_delays`` is set (its last delay
    repeats), else ``minimal_backoff_time * 2^(n-1)`` up to ``maximal_backoff_time``;
    ``jitter`` is up to ``backoff_jitter`` of ``delay`` (``draw`` in [0, 1) of it).
D4. Permanent, or temporary at or past the lifetime (*expired*): the entry is finished
    and reported.  Mail with a sender is reported to its sender (a *bounce*).  Mail with
    the null sender (a DSN is such mail) is never reported to its sender: it goes to
    ``double_bounce_recipient`` once (a *double* bounce), unless it is a double bounce
    itself or no such recipient is set: then it is *dropped* (finished, logged).
D5. A report covers every entry of one message that failed in one delivery round (one
    report per message and round): Action ``failed``, and per recipient the outcome's
    status code (a 4.x.x code stays 4.x.x when the entry expired), 5.0.0 when the
    outcome gave no 4.x.x or 5.x.x code.
D6. A deferral (D3) of mail with a sender warns when ``delay_warning_time`` is set and
    the retry interval spans ``arrival + delay_warning_time``: the attempt was due before
    it and the next is due at or after it (``due < warn <= next``), so an entry's
    intervals, which never overlap, warn once.  The warnings of one message and round
    are one "delayed" DSN to the sender: Action ``delayed``, the outcome's status code,
    Will-Retry-Until ``arrival + maximal_queue_lifetime``.
D7. A report is a new message with the null sender, arriving now, with one entry (its
    recipient) due now and no attempts: it is delivered, retried and expired by the
    same rules (its lifetime is ``bounce_queue_lifetime``).
D8. An entry whose domain is on demand -- an ATRN domain (``atrn_domains``) always, an
    ``ondemand_domains`` domain whenever its attempt was temporary -- is not retried:
    a deferral (D3) queues it again at ``parked_at``, the later of its D3 retry time and
    the first whole second past ``arrival + lifetime``, with ``attempts + 1``.  Mail for
    an ATRN domain meets no next hop (its attempt is ``NO_CONNECTION``); it leaves the
    queue when its client says ATRN (delivered there by D1-D7) or, at ``parked_at``,
    expired (D4).  A successful probe or ETRN of an on-demand domain makes its entries due
    at once (an operator's action: no rule of this table).
D9. An attempt whose body the queue found damaged (C6) delivers nothing (a body being
    sent is cut before its final dot): the message is quarantined with every entry of
    it, due or not; none is retried, expired or reported.  An attempt whose body could
    not be read (an I/O error) delivers nothing either: the entry is queued again a
    minute later (``floor(now) + 60``) with its attempts unchanged (none was made),
    whatever its age: its next attempt may expire it.

No I/O lives here; nothing outside ``spec`` is imported.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "FATE",
    "UNREADABLE_RETRY",
    "Attempt",
    "Decision",
    "DeliveryEntry",
    "DeliveryPolicy",
    "Dsn",
    "Fate",
    "Met",
    "Origin",
    "Round",
    "decide",
    "delivery_round",
    "dsn_entry",
    "expired",
    "lifetime",
    "parked_at",
    "report_to",
    "retry_at",
    "retry_delay",
    "retry_window",
]


class Attempt(enum.Enum):
    """What one delivery attempt of an entry met."""

    REPLY_2XX = "2xx"
    REPLY_4XX = "4xx"  # at RCPT or after DATA
    REPLY_5XX = "5xx"  # at MAIL, RCPT or after DATA
    NO_CONNECTION = "no connection"  # refused, or closed before the greeting, at every address
    LOST_CONNECTION = "lost connection"  # in the transaction: the outcome is unknown
    RELAY_ERROR = "relay error"  # an exception inside the relay (logged)
    ROUTE_PERMANENT = "route permanent"  # NXDOMAIN, null MX, no MX and no address
    ROUTE_TEMPORARY = "route temporary"  # SERVFAIL, a DNS timeout, no address for any MX
    BODY_DAMAGED = "body damaged"  # the queue found the body damaged: quarantined (D9)
    BODY_UNREADABLE = "body unreadable"  # the queue could not read the body (D9)


class Fate(enum.Enum):
    DELIVERED = "delivered"
    TEMPORARY = "temporary"
    PERMANENT = "permanent"
    QUARANTINED = "quarantined"  # the whole message set aside, nothing reported (D9)
    RETURNED = "returned"  # queued again, no attempt counted (D9)


#: D1: the fate of each outcome.
FATE: dict[Attempt, Fate] = {
    Attempt.REPLY_2XX: Fate.DELIVERED,
    Attempt.REPLY_4XX: Fate.TEMPORARY,
    Attempt.REPLY_5XX: Fate.PERMANENT,
    Attempt.NO_CONNECTION: Fate.TEMPORARY,
    Attempt.LOST_CONNECTION: Fate.TEMPORARY,
    Attempt.RELAY_ERROR: Fate.TEMPORARY,
    Attempt.ROUTE_PERMANENT: Fate.PERMANENT,
    Attempt.ROUTE_TEMPORARY: Fate.TEMPORARY,
    Attempt.BODY_DAMAGED: Fate.QUARANTINED,
    Attempt.BODY_UNREADABLE: Fate.RETURNED,
}

#: D9: a body that could not be read is tried again this many seconds later.
UNREADABLE_RETRY = 60


class Origin(enum.Enum):
    """What an entry's message is (the queue parameter ``dsn``; MAIL has none)."""

    MAIL = "mail"  # mail the relay received; its sender may be null
    BOUNCE = "bounce"  # a failure report to a sender
    DELAY = "delay"  # a delay warning to a sender
    DOUBLE = "double"  # a failure report on null-sender mail, to double_bounce_recipient


@dataclass(frozen=True)
class DeliveryPolicy:
    """The configuration the decisions depend on (RelayConfig's names, seconds)."""

    minimal_backoff_time: float = 300.0
    maximal_backoff_time: float = 4000.0
    backoff_jitter: float = 0.1
    retry_delays: tuple[float, ...] = ()
    maximal_queue_lifetime: float = 5 * 86400.0
    bounce_queue_lifetime: float = 5 * 86400.0
    delay_warning_time: float = 0.0  # 0: no warnings
    double_bounce_recipient: str = ""  # "": undeliverable null-sender mail is dropped

    def __post_init__(self) -> None:
        if not 0 < self.minimal_backoff_time <= self.maximal_backoff_time:
            raise ValueError("need 0 < minimal_backoff_time <= maximal_backoff_time, got "
                             f"{self.minimal_backoff_time} and {self.maximal_backoff_time}")
        if not 0 <= self.backoff_jitter < 1:
            raise ValueError(f"backoff_jitter must be in [0, 1), got {self.backoff_jitter}")
        if any(not d > 0 for d in self.retry_delays):
            raise ValueError(f"retry_delays must be positive, got {self.retry_delays}")
        if self.maximal_queue_lifetime < 0 or self.bounce_queue_lifetime < 0:
            raise ValueError("queue lifetimes must be at least 0")
        if self.delay_warning_time < 0:
            raise ValueError(f"delay_warning_time must be at least 0, got "
                             f"{self.delay_warning_time}")


@dataclass(frozen=True)
class DeliveryEntry:
    """One entry as its attempt began: its message's arrival, sender ("" null) and
    origin, the attempts before this one, and the time it was due (``schedule.at``)."""

    arrival: float
    sender: str
    origin: Origin
    attempts: int
    due: int

    def __post_init__(self) -> None:
        if self.attempts < 0 or self.due < 0:
            raise ValueError(f"attempts and due must be at least 0: {self}")
        if self.origin is not Origin.MAIL and self.sender:
            raise ValueError(f"a DSN has the null sender, not {self.sender!r}")


@dataclass(frozen=True)
class Met:
    """The outcome of an attempt and its enhanced status code (RFC 3463)."""

    attempt: Attempt
    status: str


@dataclass(frozen=True)
class Decision:
    """An entry's next state: ``fate`` DELIVERED (done), TEMPORARY (queued again at
    ``at`` with ``attempts``; ``warn``: its deferral sends a delay warning), PERMANENT
    (finished and reported; ``expired``: a temporary failure past the lifetime),
    QUARANTINED (its message set aside, nothing reported) or RETURNED (queued again at
    ``at`` with ``attempts`` unchanged)."""

    fate: Fate
    at: int = 0
    attempts: int = 0
    expired: bool = False
    warn: bool = False


@dataclass(frozen=True)
class Dsn:
    """A report: to whom, what it is, its Action, and (recipient, Status) per entry."""

    to: str
    origin: Origin
    action: str
    recipients: tuple[tuple[str, str], ...]
    retry_until: float | None = None


@dataclass(frozen=True)
class Round:
    """What one delivery round of one message reports (D4 to D6)."""

    bounce: Dsn | None
    warning: Dsn | None
    dropped: int  # failed entries reported to no one


def lifetime(policy: DeliveryPolicy, sender: str) -> float:
    """D3: how long mail may stay queued, from its arrival."""
    return policy.maximal_queue_lifetime if sender else policy.bounce_queue_lifetime


def expired(policy: DeliveryPolicy, entry: DeliveryEntry, now: float) -> bool:
    """D3, D4: whether a temporary failure at ``now`` ends the entry."""
    return now - entry.arrival >= lifetime(policy, entry.sender)


def retry_delay(policy: DeliveryPolicy, attempts: int) -> float:
    """D3: the delay after the ``attempts``-th failed attempt (1 for the first), unjittered."""
    if attempts < 1:
        raise ValueError(f"attempts counts failures from 1, got {attempts}")
    if policy.retry_delays:
        return policy.retry_delays[min(attempts, len(policy.retry_delays)) - 1]
    return min(policy.minimal_backoff_time * 2.0 ** min(attempts - 1, 62),
               policy.maximal_backoff_time)


def retry_at(policy: DeliveryPolicy, now: float, attempts: int, draw: float = 0.0) -> int:
    """D3: when the entry is due after its ``attempts``-th failure at ``now``; ``draw``
    in [0, 1) is the fraction of the allowed jitter taken."""
    if not 0 <= draw < 1:
        raise ValueError(f"draw must be in [0, 1), got {draw}")
    delay = retry_delay(policy, attempts)
    return math.floor(now + max(1.0, delay - delay * policy.backoff_jitter * draw))


def parked_at(policy: DeliveryPolicy, entry: DeliveryEntry, retry: int) -> int:
    """D8: when a deferred entry of an on-demand domain is due again, given its D3
    ``retry`` time: not before its lifetime is over.

    pre: 0 <= entry.arrival < 2 ** 40 and 0 <= lifetime(policy, entry.sender) < 2 ** 40
    post: __return__ >= retry
    post: __return__ > entry.arrival + lifetime(policy, entry.sender)
    """
    return max(retry, math.floor(entry.arrival + lifetime(policy, entry.sender)) + 1)


def retry_window(policy: DeliveryPolicy, now: float, attempts: int) -> tuple[int, int]:
    """D3: the earliest and latest ``retry_at`` over every jitter draw."""
    delay = retry_delay(policy, attempts)
    earliest = math.floor(now + max(1.0, delay - delay * policy.backoff_jitter))
    return earliest, retry_at(policy, now, attempts)


def report_to(policy: DeliveryPolicy, entry: DeliveryEntry) -> tuple[str, Origin] | None:
    """D4: the recipient and kind of the report on a failed entry; None: dropped.

    post: __return__ is None or __return__[0] != ""
    post: __return__ is None or __return__[1] in (Origin.BOUNCE, Origin.DOUBLE)
    post: entry.origin is not Origin.DOUBLE or __return__ is None
    post: entry.origin is not Origin.MAIL or not entry.sender or __return__ == (entry.sender, Origin.BOUNCE)
    post: __return__ in (None, (entry.sender, Origin.BOUNCE), (policy.double_bounce_recipient, Origin.DOUBLE))
    """
    if entry.origin is Origin.MAIL and entry.sender:
        return entry.sender, Origin.BOUNCE
    if entry.origin is not Origin.DOUBLE and policy.double_bounce_recipient:
        return policy.double_bounce_recipient, Origin.DOUBLE
    return None


def decide(policy: DeliveryPolicy, entry: DeliveryEntry, met: Met, now: float,
           draw: float = 0.0) -> Decision:
    """D1 to D3, D6, D9: the entry's next state after its attempt met ``met`` at ``now``.

    pre: 0 <= draw < 1 and 0 <= now < 2 ** 40
    post: __return__.fate is FATE[met.attempt] or (__return__.fate is Fate.PERMANENT and __return__.expired)
    post: __return__.fate is not Fate.TEMPORARY or __return__.at > now
    post: __return__.fate is not Fate.TEMPORARY or __return__.attempts == entry.attempts + 1
    post: not __return__.expired or now - entry.arrival >= lifetime(policy, entry.sender)
    post: not __return__.warn or (entry.sender != "" and entry.origin is Origin.MAIL)
    post: __return__.fate is not Fate.RETURNED or __return__.at > now
    post: __return__.fate is not Fate.RETURNED or __return__.attempts == entry.attempts
    """
    fate = FATE[met.attempt]
    if fate in (Fate.DELIVERED, Fate.QUARANTINED):
        return Decision(fate)
    if fate is Fate.RETURNED:
        return Decision(Fate.RETURNED, math.floor(now) + UNREADABLE_RETRY, entry.attempts)
    if fate is Fate.PERMANENT:
        return Decision(Fate.PERMANENT)
    if expired(policy, entry, now):
        return Decision(Fate.PERMANENT, expired=True)
    attempts = entry.attempts + 1
    at = retry_at(policy, now, attempts, draw)
    warn_at = entry.arrival + policy.delay_warning_time
    warn = (policy.delay_warning_time > 0 and entry.origin is Origin.MAIL
            and bool(entry.sender) and entry.due < warn_at <= at)
    return Decision(Fate.TEMPORARY, at, attempts, warn=warn)


def _status(status: str) -> str:
    return status if status[:1] in ("4", "5") else "5.0.0"


def delivery_round(policy: DeliveryPolicy,
                   results: Sequence[tuple[str, DeliveryEntry, Met, Decision]]) -> Round:
    """D4 to D6: the reports of one message's delivery round, from each entry's
    (recipient, entry as the attempt began, outcome, decision)."""
    failed = [(rcpt, entry, met) for rcpt, entry, met, d in results
              if d.fate is Fate.PERMANENT]
    warned = [(rcpt, entry, met) for rcpt, entry, met, d in results if d.warn]
    bounce: Dsn | None = None
    dropped = 0
    if failed:
        to = report_to(policy, failed[0][1])
        if to is None:
            dropped = len(failed)
        else:
            bounce = Dsn(to[0], to[1], "failed",
                         tuple((rcpt, _status(met.status)) for rcpt, _, met in failed))
    warning: Dsn | None = None
    if warned:
        first = warned[0][1]
        warning = Dsn(first.sender, Origin.DELAY, "delayed",
                      tuple((rcpt, met.status) for rcpt, _, met in warned),
                      first.arrival + policy.maximal_queue_lifetime)
    return Round(bounce, warning, dropped)


def dsn_entry(dsn: Dsn, now: float) -> DeliveryEntry:
    """D7: the entry of a report made at ``now``."""
    return DeliveryEntry(arrival=now, sender="", origin=dsn.origin, attempts=0,
                         due=math.floor(now))
