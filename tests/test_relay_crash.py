"""Crash exploration of the relay (conformance/crashexplore/relay_crash.py): the
receiver's commits and a delivery round crashed at every storage call under every
persistence model, the relay run again on each recovered disk, and the whole history
judged by the relay contract.  Broken schedulers show that the judge catches what it is
for; scenario ids replay one state through ``queue-ref crash reproduce``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conformance.crashexplore import relay_crash
from conformance.crashexplore.backend_registry import resolve
from conformance.crashexplore.traced_runs import ScratchIO, scratch_dir
from faultinject.disk import materialize
from faultinject.models import MODELS
from spec.delivery_model import DeliveryEntry, DeliveryPolicy, Origin, parked_at, retry_at


@pytest.mark.parametrize("backend", ["fs", "kv"])
def test_the_relay_keeps_its_contract_at_every_crash_point(backend):
    res = relay_crash.explore_relay(backend, every=2 if backend == "fs" else 1)
    assert res.findings == [], [(f.scenario, f.violations) for f in res.findings[:3]]
    assert set(res.per_model) == set(MODELS)
    assert res.points >= 20 and all(n >= res.points // 2 for n in res.per_model.values())


def test_each_scenario_acknowledges_delivers_defers_and_bounces_before_any_crash():
    backend = resolve("fs")
    run = relay_crash.crashed_run(backend, relay_crash.SCENARIOS["mixed"], None)
    assert not run.crashed and run.history.acked == {0, 1}
    assert [d.rcpt for d in run.history.deliveries] == ["ok1@dst.test"]
    # the refused recipients are finished (their bounce committed first); soft1 is deferred
    assert run.history.done == {"ok1@dst.test", "rej1@dst.test", "rej2@dst.test"}
    after = relay_crash.run_after(backend, _image_of(run))
    assert [d.rcpt for d in after.deliveries] == ["soft1@dst.test", "alice@src.test"]
    assert after.deliveries[1].bounce_for == ("rej1@dst.test",)
    assert relay_crash.judge(relay_crash.SCENARIOS["mixed"], run.history, after) == []


def test_atrn_mail_waits_for_its_client_and_bounces_when_its_lifetime_is_over():
    backend = resolve("fs")
    mails = relay_crash.SCENARIOS["atrn"]
    run = relay_crash.crashed_run(backend, mails, None)
    assert [d.rcpt for d in run.history.deliveries] == ["ok4@dst.test"]
    assert run.history.handed == ["ok4@dst.test"]  # user@atrn.test never reached the hop
    # parked as the model's D8 says: due the first second past its lifetime, one attempt
    policy = DeliveryPolicy(minimal_backoff_time=60.0, maximal_backoff_time=120.0,
                            backoff_jitter=0.0, maximal_queue_lifetime=relay_crash.LIFETIME)
    entry = DeliveryEntry(arrival=relay_crash.T0, sender="carol@src.test", origin=Origin.MAIL,
                          attempts=0, due=int(relay_crash.T0))
    with scratch_dir() as d:
        materialize(_image_of(run), d)
        with backend.open(d, ScratchIO()) as store:
            [parked] = [h.schedule for h in store.list_queue()]
    assert (parked.at, parked.attempts) == (
        parked_at(policy, entry, retry_at(policy, relay_crash.T0, 1)), 1)
    after = relay_crash.run_after(backend, _image_of(run))
    assert [(d.rcpt, d.bounce_for) for d in after.deliveries] == [
        ("carol@src.test", ("user@atrn.test",))]
    assert relay_crash.judge(mails, run.history, after) == []


def _image_of(run):
    from faultinject.models import crash_states

    return crash_states(run.initial, run.events, "process-kill")[0].image


@pytest.mark.parametrize(("variant", "scenario", "kind"), [
    ("done-before-bounce", "mixed", "bounce-lost"), ("cancel-as-done", "mixed", "lost"),
    ("atrn-by-mx", "atrn", "sent-by-mx")])
def test_a_broken_scheduler_is_caught_and_its_scenario_replays(variant, scenario, kind):
    res = relay_crash.explore_relay("fs", (scenario,), ("weak",), every=2, variant=variant)
    kinds = {k for f in res.findings for k, _ in f.violations}
    assert kind in kinds, kinds
    first = next(f for f in res.findings if any(k == kind for k, _ in f.violations))
    rep = relay_crash.reproduce_relay(first.scenario)
    assert [k for k, _ in rep.violations] == [k for k, _ in first.violations]


def test_the_command_line(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "conformance.cli", "crash", *args],
                              capture_output=True, text=True, timeout=300)

    good = run("relay", "--backend", "kv", "--json")
    assert good.returncode == 0, good.stdout + good.stderr
    summary = json.loads(good.stdout.strip().splitlines()[-1])
    assert summary["violations"] == {} and summary["states"] > 0
    bad = run("relay", "--variant", "done-before-bounce", "--model", "weak", "--every", "3",
              "--scenario", "mixed", "--json")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    found = json.loads(bad.stdout.strip().splitlines()[-1])["findings"][0]["scenario"]
    again = run("reproduce", found)
    assert again.returncode == 1 and "VIOLATION bounce-lost" in again.stdout, again.stdout
    assert run("reproduce", "relay:fs:nosuch:weak:c1a:all").returncode == 2
    assert run("relay", "--model", "nosuch").returncode == 2
