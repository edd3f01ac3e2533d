"""``queue-ref demo --relay``: accepting, deferring, retrying, delivering and bouncing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from conformance.cli import main


def test_relay_demo_accepts_defers_retries_delivers_and_bounces(tmp_path: Path,
                                                                capsys: Any) -> None:
    assert main(["demo", "--relay", "--dir", str(tmp_path / "q"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["accepted"].startswith("250 2.0.0 Ok: queued as ")
    assert sorted(out["sent"]) == ["alice@example.org", "bob@example.net", "busy@example.net"]
    assert out["deferred"] == ["busy@example.net"]
    assert out["bounced"] == ["nobody@example.net"]
    assert out["bounce"]["recipients"] == ["rfc822; nobody@example.net"]
    assert out["bounce"]["status"] == ["5.1.1"]
    assert {"from": "", "to": ["alice@example.org"]} in out["next_hop_received"]
    assert out["queue_left"] == 0 and out["footprint"] == {"objects": 0, "bytes": 0}
