"""The rules D1 to D7 of ``spec/delivery_model.py``, one by one, and two properties: a
retry is due within its jitter window, and an entry warns at most once."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spec.delivery_model import (
    FATE,
    Attempt,
    Decision,
    DeliveryEntry,
    DeliveryPolicy,
    Dsn,
    Fate,
    Met,
    Origin,
    decide,
    delivery_round,
    dsn_entry,
    expired,
    lifetime,
    parked_at,
    report_to,
    retry_at,
    retry_delay,
    retry_window,
)

POLICY = DeliveryPolicy(minimal_backoff_time=300, maximal_backoff_time=4000, backoff_jitter=0,
                        maximal_queue_lifetime=5000, bounce_queue_lifetime=1000)


def mail(sender: str = "s@x.test", attempts: int = 0, due: int = 0, arrival: float = 0,
         origin: Origin = Origin.MAIL) -> DeliveryEntry:
    return DeliveryEntry(arrival, sender, origin, attempts, due)


def test_every_outcome_has_a_fate() -> None:  # D1
    assert set(FATE) == set(Attempt)
    assert [a for a, f in FATE.items() if f is Fate.DELIVERED] == [Attempt.REPLY_2XX]
    assert {a for a, f in FATE.items() if f is Fate.PERMANENT} == {
        Attempt.REPLY_5XX, Attempt.ROUTE_PERMANENT}
    assert {a for a, f in FATE.items() if f in (Fate.QUARANTINED, Fate.RETURNED)} == {
        Attempt.BODY_DAMAGED, Attempt.BODY_UNREADABLE}


def test_a_damaged_body_is_quarantined_and_an_unreadable_one_tried_a_minute_later() -> None:
    """D9: nothing reported, whatever the age; an unreadable body counts no attempt."""
    old = mail(attempts=3, arrival=0)
    late = 10 * 86400.5  # past every lifetime
    assert decide(POLICY, old, Met(Attempt.BODY_DAMAGED, ""), late) == Decision(
        Fate.QUARANTINED)
    assert decide(POLICY, old, Met(Attempt.BODY_UNREADABLE, ""), late) == Decision(
        Fate.RETURNED, int(late) + 60, 3)
    rnd = delivery_round(POLICY, [
        ("a@x.test", old, Met(Attempt.BODY_DAMAGED, ""), Decision(Fate.QUARANTINED)),
        ("b@x.test", old, Met(Attempt.BODY_UNREADABLE, ""), Decision(Fate.RETURNED, 1, 3))])
    assert rnd.bounce is None and rnd.warning is None and rnd.dropped == 0


def test_backoff_doubles_up_to_its_cap_or_follows_retry_delays() -> None:  # D3
    assert [retry_delay(POLICY, n) for n in range(1, 7)] == [300, 600, 1200, 2400, 4000, 4000]
    fixed = DeliveryPolicy(retry_delays=(900, 1800, 7200))
    assert [retry_delay(fixed, n) for n in range(1, 6)] == [900, 1800, 7200, 7200, 7200]
    assert retry_delay(POLICY, 10_000) == 4000  # no overflow
    with pytest.raises(ValueError, match="attempts counts failures from 1"):
        retry_delay(POLICY, 0)


def test_jitter_takes_up_to_its_fraction_and_a_retry_is_a_second_later_at_least() -> None:
    p = DeliveryPolicy(minimal_backoff_time=100, maximal_backoff_time=100, backoff_jitter=0.25)
    assert retry_at(p, 1000.5, 1) == 1100
    assert retry_at(p, 1000, 1, draw=0.5) == 1087
    assert retry_window(p, 1000, 1) == (1075, 1100)
    tiny = DeliveryPolicy(minimal_backoff_time=0.1, maximal_backoff_time=0.1)
    assert retry_at(tiny, 50, 1) == 51
    with pytest.raises(ValueError, match="draw"):
        retry_at(p, 0, 1, draw=1.0)


def test_lifetime_runs_from_arrival_and_is_shorter_for_the_null_sender() -> None:  # D3
    assert lifetime(POLICY, "s@x.test") == 5000 and lifetime(POLICY, "") == 1000
    late_retry = mail(arrival=0, due=4990, attempts=7)
    assert not expired(POLICY, late_retry, 4999)
    assert expired(POLICY, late_retry, 5000)  # at the lifetime: Postfix's ">="
    assert expired(POLICY, mail(sender="", due=999), 1000)
    d = decide(POLICY, late_retry, Met(Attempt.REPLY_4XX, "4.2.0"), 5000)
    assert d == decide(POLICY, late_retry, Met(Attempt.NO_CONNECTION, "4.4.1"), 6000)
    assert d.fate is Fate.PERMANENT and d.expired


@pytest.mark.parametrize(("entry", "postmaster", "to"), [
    (mail("s@x.test"), "", ("s@x.test", Origin.BOUNCE)),
    (mail("s@x.test"), "pm@x.test", ("s@x.test", Origin.BOUNCE)),
    (mail(""), "", None),
    (mail(""), "pm@x.test", ("pm@x.test", Origin.DOUBLE)),
    (mail("", origin=Origin.BOUNCE), "pm@x.test", ("pm@x.test", Origin.DOUBLE)),
    (mail("", origin=Origin.DELAY), "pm@x.test", ("pm@x.test", Origin.DOUBLE)),
    (mail("", origin=Origin.BOUNCE), "", None),
    (mail("", origin=Origin.DOUBLE), "pm@x.test", None),
])
def test_who_a_failure_is_reported_to(entry: DeliveryEntry, postmaster: str,
                                      to: tuple[str, Origin] | None) -> None:  # D4
    assert report_to(DeliveryPolicy(double_bounce_recipient=postmaster), entry) == to


def test_each_fate_gives_its_next_state() -> None:  # D2, D3, D4
    e = mail(attempts=2, due=100, arrival=0)
    assert decide(POLICY, e, Met(Attempt.REPLY_2XX, "2.0.0"), 100) == Decision(Fate.DELIVERED)
    assert decide(POLICY, e, Met(Attempt.REPLY_5XX, "5.1.1"), 100).fate is Fate.PERMANENT
    assert not decide(POLICY, e, Met(Attempt.ROUTE_PERMANENT, "5.1.2"), 100).expired
    for attempt in (Attempt.REPLY_4XX, Attempt.NO_CONNECTION, Attempt.LOST_CONNECTION,
                    Attempt.RELAY_ERROR, Attempt.ROUTE_TEMPORARY):
        d = decide(POLICY, e, Met(attempt, "4.0.0"), 130)
        assert (d.fate, d.at, d.attempts) == (Fate.TEMPORARY, 130 + 1200, 3), attempt


def test_a_delay_warning_goes_on_the_deferral_whose_interval_spans_the_warning_time() -> None:
    p = DeliveryPolicy(minimal_backoff_time=100, maximal_backoff_time=100, backoff_jitter=0,
                       delay_warning_time=250)
    temp = Met(Attempt.REPLY_4XX, "4.2.0")
    assert not decide(p, mail(due=100, attempts=1), temp, 100).warn  # next at 200
    assert decide(p, mail(due=200, attempts=2), temp, 200).warn  # (200, 300] spans 250
    assert decide(p, mail(due=200, attempts=2), temp, 260).warn  # a late attempt still warns
    assert not decide(p, mail(due=300, attempts=3), temp, 300).warn
    assert not decide(p, mail("", due=200), temp, 200).warn  # the null sender: never
    assert not decide(p, mail("", due=200, origin=Origin.BOUNCE), temp, 200).warn
    off = DeliveryPolicy(minimal_backoff_time=100, maximal_backoff_time=100)
    assert not decide(off, mail(due=200), temp, 200).warn


def test_one_report_per_round_with_each_recipients_status() -> None:  # D5, D6
    p = DeliveryPolicy(minimal_backoff_time=100, maximal_backoff_time=100, backoff_jitter=0,
                       maximal_queue_lifetime=1000, delay_warning_time=150)
    fresh, old = mail(due=100, attempts=1), mail(due=990, attempts=5)
    results = []
    for rcpt, entry, met in [("a@y", fresh, Met(Attempt.REPLY_5XX, "5.1.1")),
                             ("b@y", old, Met(Attempt.NO_CONNECTION, "4.4.1")),
                             ("c@y", fresh, Met(Attempt.REPLY_4XX, "4.2.0")),
                             ("d@y", fresh, Met(Attempt.REPLY_2XX, "2.0.0")),
                             ("e@y", fresh, Met(Attempt.ROUTE_PERMANENT, ""))]:
        now = 1000 if entry is old else 100
        results.append((rcpt, entry, met, decide(p, entry, met, now)))
    rnd = delivery_round(p, results)
    assert rnd.bounce == Dsn("s@x.test", Origin.BOUNCE, "failed",
                             (("a@y", "5.1.1"), ("b@y", "4.4.1"), ("e@y", "5.0.0")))
    assert rnd.warning == Dsn("s@x.test", Origin.DELAY, "delayed", (("c@y", "4.2.0"),), 1000)
    assert rnd.dropped == 0
    # the null sender: no warning, and b@y is not expired (bounce_queue_lifetime 5 d)
    null = [(r, mail("", e.attempts, e.due), m) for r, e, m, _ in results]
    dropped = delivery_round(p, [(r, e, m, decide(p, e, m, 1000 if e.due == 990 else 100))
                                 for r, e, m in null])
    assert (dropped.bounce, dropped.warning, dropped.dropped) == (None, None, 2)


def test_a_report_is_new_null_sender_mail_due_now() -> None:  # D7
    dsn = Dsn("s@x.test", Origin.BOUNCE, "failed", (("a@y", "5.1.1"),))
    assert dsn_entry(dsn, 123.7) == DeliveryEntry(123.7, "", Origin.BOUNCE, 0, 123)


def test_bad_input_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="minimal_backoff_time"):
        DeliveryPolicy(minimal_backoff_time=10, maximal_backoff_time=5)
    with pytest.raises(ValueError, match="backoff_jitter"):
        DeliveryPolicy(backoff_jitter=1.0)
    with pytest.raises(ValueError, match="retry_delays"):
        DeliveryPolicy(retry_delays=(60, 0))
    with pytest.raises(ValueError, match="null sender"):
        mail("s@x.test", origin=Origin.BOUNCE)
    with pytest.raises(ValueError, match="at least 0"):
        mail(attempts=-1)


policies = st.builds(
    DeliveryPolicy, minimal_backoff_time=st.integers(1, 50), maximal_backoff_time=st.just(200),
    backoff_jitter=st.sampled_from([0.0, 0.1, 0.5]),
    retry_delays=st.sampled_from([(), (5.0, 30.0), (1.0,)]),
    maximal_queue_lifetime=st.integers(0, 2000), delay_warning_time=st.integers(0, 1000))


@given(policies, st.lists(st.tuples(st.integers(0, 40), st.floats(0, 0.999)), max_size=40),
       st.sampled_from(["", "s@x.test"]))
def test_an_entry_is_retried_within_its_window_and_warned_once_at_most(
        policy: DeliveryPolicy, lateness: list[tuple[int, float]], sender: str) -> None:
    """Temporary failures only, each attempt some seconds after it was due."""
    entry = mail(sender, due=0)
    warnings = 0
    for late, draw in lateness:
        now = entry.due + late
        d = decide(policy, entry, Met(Attempt.REPLY_4XX, "4.2.0"), now, draw)
        if d.fate is Fate.PERMANENT:
            assert d.expired and now >= lifetime(policy, sender)
            break
        lo, hi = retry_window(policy, now, entry.attempts + 1)
        assert lo <= d.at <= hi and d.at >= now + 1 and d.attempts == entry.attempts + 1
        warnings += d.warn
        entry = DeliveryEntry(entry.arrival, sender, Origin.MAIL, d.attempts, d.at)
    assert warnings <= 1
    if sender and policy.delay_warning_time and entry.due >= policy.delay_warning_time:
        assert warnings == 1


def test_d8_on_demand_mail_is_parked_until_its_lifetime_is_over() -> None:
    policy = DeliveryPolicy(maximal_queue_lifetime=900.0, bounce_queue_lifetime=300.0)
    mail = DeliveryEntry(arrival=1000.5, sender="a@src.test", origin=Origin.MAIL,
                         attempts=0, due=1000)
    assert parked_at(policy, mail, retry=1300) == 1901  # the first second past 1900.5
    assert parked_at(policy, mail, retry=5000) == 5000  # never earlier than D3's retry
    dsn = DeliveryEntry(arrival=1000.0, sender="", origin=Origin.BOUNCE, attempts=0, due=1000)
    assert parked_at(policy, dsn, retry=1001) == 1301  # a DSN's lifetime is the bounce one
    # at that time the entry has expired: D4 ends it with a report
    assert expired(policy, mail, parked_at(policy, mail, retry=1300))
