"""Mail as varied as real mail in the linearizable and lifecycle-edges checks.

* the plain draws of ``conformance/harness/mail_data.py`` (what the history workers use,
  outside Hypothesis) are deterministic from their seed and within the contract, and
  reach what the strategies reach (UTF-8, trailing dots, far-future schedules, reasons,
  bodies with and without a final CRLF);
* the linearizability search compares what each call handed back byte for byte: a read's
  sender, recipient, index and body against its enqueue's (C6), every schedule with its
  reason (C5), ``list_domain`` against the model's entries of the domain (API);
* the broken variants of ``conformance/examples/broken_mail_data.py`` fail the
  linearizable check on one round (seed 1, as ``queue-ref certify --seed 1`` derives it)
  and, where they apply (the multi-process filesystem ones), a trial of lifecycle-edges;
  the backends they break pass the same runs.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from conformance.certify.suite_runner import check_seed
from conformance.checks import lifecycle_edges_check, linearizability_check
from conformance.checks.lifecycle_edges_judge import Run, Trial, judge_trial
from conformance.concurrency.linearizability import Recorded, body_token, check_history
from conformance.crashexplore.recovered_queue import Recovered, RecoveredEntry
from conformance.examples import broken_mail_data
from conformance.harness.backend_factory import Backend
from conformance.harness.check_results import CheckResult, Status
from conformance.harness.mail_data import (
    ENDINGS,
    MAX_LOCAL,
    draw_address,
    draw_body,
    draw_schedule,
    draw_sender,
)
from conformance.harness.suite_profiles import QUICK
from queue_ref.storage import (
    MAX_SCHEDULE,
    Capability,
    Schedule,
    validate_address,
    validate_schedule,
)
from spec.model import Model
from spec.states import Op

# ---- the plain draws ---------------------------------------------------------------------


def _draws(seed: int, n: int) -> list[object]:
    rng = random.Random(seed)
    return [(draw_sender(rng), draw_address(rng), draw_schedule(rng), draw_body(rng))
            for _ in range(n)]


def test_the_draws_are_deterministic_within_the_contract_and_varied() -> None:
    assert _draws(7, 50) == _draws(7, 50)
    assert _draws(7, 50) != _draws(8, 50)
    rng = random.Random(1)
    addresses = [draw_address(rng) for _ in range(2000)]
    for a in addresses:
        validate_address(a, "address")
        local, at, _ = a.rpartition("@")
        assert not at or len(local.encode()) <= MAX_LOCAL or a.startswith("x" * 100), a
    assert any(not a.isascii() for a in addresses)
    assert any(a.endswith(".") for a in addresses)
    assert any(a.startswith('"') for a in addresses)
    assert any(a.rpartition("@")[0] != a.rpartition("@")[0].lower() for a in addresses)
    schedules = [draw_schedule(rng) for _ in range(500)]
    for s in schedules:
        assert validate_schedule(s) == s
    assert any(s.at > 2**31 - 1 for s in schedules) and any(s.at <= 1 for s in schedules)
    assert any(s.at == MAX_SCHEDULE for s in schedules)
    assert any("\r\n" in s.reason for s in schedules) and any(s.reason == "" for s in schedules)
    bodies = [draw_body(rng) for _ in range(500)]
    assert {e for e in ENDINGS if e} <= {e for b in bodies for e in ENDINGS if e and
                                         b.endswith(e)}
    assert any(b.endswith(b"\r\n") for b in bodies) and any(b"." in b for b in bodies)
    assert "" in {draw_sender(rng) for _ in range(200)}


# ---- the search compares what came back ------------------------------------------------------

BODY = b"Subject: x\r\n\r\n.\r\nbare\rCR\r\n"
ENQ = Recorded("setup", "enqueue", 0, 10, "moved", entries=("a", "b"),
               schedules=((5, 0, "421 4.4.2 Pe\u0301rez\r\n"), (6, 1, "")),
               mail_from="Pe\u0301rez@b.example", rcpts=("Rcpt@a.example", "x@C.example."),
               body=body_token(BODY))


def R(worker: str, call: str, t0: int, t1: int, outcome: str, entry: str = "",
      **kw: object) -> Recorded:
    return Recorded(worker, call, t0, t1, outcome, entry, **kw)  # type: ignore[arg-type]


def _read(**kw: object) -> Recorded:
    fields: dict[str, object] = {"mail_from": ENQ.mail_from, "rcpts": ("Rcpt@a.example",),
                                 "body": body_token(BODY), "index": 0}
    fields.update(kw)
    return R("t0", "read_inflight", 30, 31, "read", "a", **fields)


CLAIM = R("t0", "send_start", 20, 25, "moved", "a", got_schedule=ENQ.schedules[0])


def test_a_read_of_what_was_committed_passes() -> None:
    v = check_history([ENQ, CLAIM, _read()])
    assert v.linearizable is True, v.detail


@pytest.mark.parametrize(("change", "field"), [
    ({"rcpts": ("rcpt@a.example",)}, "meta.rcpt"),
    ({"mail_from": "P\u00e9rez@b.example"}, "meta.mail_from"),
    ({"index": 1}, "meta.rcpt_index"),
    ({"body": body_token(BODY[:-2])}, "the body read"),
])
def test_a_read_of_other_data_than_committed_is_c6(change: dict[str, object],
                                                   field: str) -> None:
    v = check_history([ENQ, CLAIM, _read(**change)])
    assert v.linearizable is False and v.clause == "C6" and field in v.detail, v.detail
    assert any("read_inflight(a)" in line for line in v.lines)


def test_a_schedule_handed_back_without_its_reason_is_c5() -> None:
    lost = R("t0", "send_start", 20, 25, "moved", "a", got_schedule=(5, 0, ""))
    v = check_history([ENQ, lost])
    assert v.linearizable is False and v.clause == "C5" and "reason=" in v.detail
    listed = R("t1", "list_queue", 20, 25, "listed", entries=("a", "b"),
               schedules=((5, 0, "421 4.4.2 P\u00e9rez\r\n"), (6, 1, "")))
    v = check_history([ENQ, listed])
    assert v.linearizable is False and v.clause == "C5"
    resched = R("t0", "reschedule", 20, 25, "moved", "b", schedule=(2**40, 2, "\u212b"),
                got_schedule=(2**40, 2, "\u212b"))
    after = R("t1", "list_queue", 30, 35, "listed", entries=("a", "b"),
              schedules=(ENQ.schedules[0], (2**40, 2, "\u212b")))
    assert check_history([ENQ, resched, after]).linearizable is True
    stale = replace(after, schedules=(ENQ.schedules[0], (2**40, 2, "\u00c5")))
    assert check_history([ENQ, resched, stale]).clause == "C5"


def test_list_domain_lists_the_domain_lower_cased_and_nothing_else() -> None:
    def listing(domain: str, *entries: str) -> Recorded:
        scheds = {"a": ENQ.schedules[0], "b": ENQ.schedules[1]}
        return R("t1", "list_domain", 20, 25, "listed", entries=entries,
                 schedules=tuple(scheds[e] for e in entries), arg=domain)

    assert check_history([ENQ, listing("A.EXAMPLE", "a")]).linearizable is True
    assert check_history([ENQ, listing("c.example.", "b")]).linearizable is True
    v = check_history([ENQ, listing("a.example")])
    assert v.clause == "API" and "left out entry a" in v.detail
    v = check_history([ENQ, listing("c.example", "b")])  # not the trailing-dot domain
    assert v.clause == "API" and "whose recipient is" in v.detail
    # left out while a claim of it took effect: allowed, as for list_queue
    claim = R("t0", "send_start", 18, 30, "moved", "a", got_schedule=ENQ.schedules[0])
    assert check_history([ENQ, claim, listing("a.example")]).linearizable is True


def test_histories_with_data_round_trip_through_json() -> None:
    for r in (ENQ, _read(), R("t1", "list_domain", 1, 2, "listed", entries=("a",),
                              schedules=((1, 2, "r\x00"),), arg="A.example.")):
        assert Recorded.from_json(r.to_json()) == r


# ---- the checks on the broken variants and on what they break --------------------------------

ONE_ROUND = replace(QUICK, linearizable_rounds=1)
#: Each variant, the clauses the linearizable check fails it on.
LINEARIZABLE = {
    "fs_local_part_lowered": {"C6"},
    "kv_addresses_nfc": {"C6"},
    "fs_far_future_unlisted": {"API", "C8"},
    "kv_domain_trailing_dot": {"API"},
    "fs_body_final_crlf_stripped": {"C6"},
}


def _linearizable(backend: Backend, seed: int) -> CheckResult:
    # without the paused races (seconds each): the rounds are what reads the data back
    caps = backend.probe().capabilities - {Capability.IO_SEAM}
    return linearizability_check.run(backend, ONE_ROUND, check_seed(seed, "linearizable"),
                                     caps)


@pytest.mark.parametrize("variant", sorted(LINEARIZABLE))
def test_the_linearizable_check_fails_each_variant(variant: str) -> None:
    backend = Backend.from_factory(getattr(broken_mail_data, variant), variant)
    res = _linearizable(backend, 1)
    assert res.status is Status.FAIL, f"{variant} passed"
    assert {f.clause for f in res.findings} <= LINEARIZABLE[variant], \
        [(f.clause, f.detail) for f in res.findings]


@pytest.mark.parametrize("factory", ["conformance.examples.backends:fs",
                                     "conformance.examples.backends:kv_log"])
def test_the_backends_the_variants_break_pass_the_same_round(factory: str) -> None:
    res = _linearizable(Backend.from_factory(factory), 1)
    assert res.status is Status.PASS, [(f.clause, f.detail, f.steps) for f in res.findings]


#: The multi-process variants (the filesystem queue's), and what lifecycle-edges finds
#: when two recoveries run at once (the observer reads back every entry it claimed).
EDGES = {
    "fs_local_part_lowered": ({"C6"}, "meta.rcpt"),
    # C13 too: after its recovery, scan_queue (mailq's) gives the entries list_queue hides
    "fs_far_future_unlisted": ({"API", "C1", "C8", "C13"}, "did not list the queued entries"),
    "fs_body_final_crlf_stripped": ({"C6"}, "other bytes than committed"),
}
EDGES_TRIAL = "lifecycle-edges:open:pair:0"


@pytest.mark.parametrize("variant", sorted(EDGES))
def test_a_lifecycle_edges_trial_fails_each_variant_it_can_run(variant: str) -> None:
    clauses, words = EDGES[variant]
    backend = Backend.from_factory(getattr(broken_mail_data, variant), variant)
    found = lifecycle_edges_check.replay(backend, EDGES_TRIAL)
    assert found and {f.clause for f in found} <= clauses, found
    assert any(words in f.detail for f in found), [f.detail for f in found]


def test_the_filesystem_queue_passes_that_trial() -> None:
    fs = Backend.from_factory("conformance.examples.backends:fs")
    with lifecycle_edges_check.Bench(fs, seam=True) as bench:
        out = lifecycle_edges_check.run_trial(bench, Trial("open", "pair", 0))
    assert out.stopped and out.findings == [], out.findings


def test_the_lifecycle_judge_compares_reasons() -> None:
    """A claim whose handle lost its schedule's reason is C5 (a listing's too)."""
    r = Run()
    r.model, _ = Model().enqueue("P\u00e9rez@b.example", b"x\r\n",
                                 [("Rcpt@a.example", Schedule(5, 1, "why\r\n"))])
    r.msgids["m0"] = 0
    r.keys["m0.0"] = (0, 0)
    seen = {"observed": True, "listed": ["m0.0"], "adopted": {},
            "listed_schedules": {"m0.0": [5, 1, "why"]}, "claimed": {"m0.0": [5, 1, ""]}}
    after, _ = r.model.apply(Op.SEND_START, (0, 0))
    rec = Recovered(tuple(RecoveredEntry("m0", "m0.0", 0, "Rcpt@a.example", "P\u00e9rez@b.example",
                                         m.digest, e.schedule, e.state)
                          for (mid, _i), e in after.restart().entries.items()
                          for m in [after.messages[mid]]))
    found = judge_trial(r, Trial("send_start", "single", 0), seen, {"moved": False}, None,
                        {"finished": []}, rec)
    c5 = [d for c, d in found if c == "C5"]
    assert any("listed (0, 0)" in d and "reason" in d for d in c5), found
    assert any("claimed (0, 0)" in d and "reason" in d for d in c5), found
