"""Which messages damage took: the ids a KV queue reports after its engine met damage.

Three sources, merged into the ``RecoveryReport`` of an open:

* recovery itself: messages and entries whose records failed their checksums were
  quarantined (``kv_recovery.py`` names them);
* the engine's damage (``LogEngine.damage``): bytes of the log that hold no intact
  record.  Their CRC failed, so nothing in them is trusted, but the keys are plain ASCII
  and a flipped bit leaves most of them readable: every message id they name is read
  out.  A message so named that is no longer stored, and that no intact later record
  touched, is lost (its commit was in the damaged bytes); one still stored may have lost
  a state change, which is reported as a problem.  Damaged bytes that name no id count
  in ``lost_unknown``;
* the record of the last clean close (``atrest.py``): every entry held then and not now.
"""

from __future__ import annotations

import os
import re
from dataclasses import replace

from queue_ref.kv import keys
from queue_ref.kv.atrest import AtRest, compare, entries_of
from queue_ref.kv.base import KV
from queue_ref.kv.engine_errors import Damage
from queue_ref.storage import RecoveryReport

_ID = rb"(\d{%d})" % keys.ID_WIDTH
_NAMED = re.compile(rb"(?:message |live |inflight |cleanup |(?:delivery-zone|domain) \S{1,2048} )"
                    + _ID)


def ids_named(data: bytes) -> set[int]:
    """Message ids that keys in ``data`` name (data may be damaged)."""
    return {int(m.group(1)) for m in _NAMED.finditer(data)}


def _stored(kv: KV, mid: int) -> bool:
    p = keys.message_prefix(mid)
    return any(True for _ in kv.iterate(p, keys.end_of(p)))


def merge(report: RecoveryReport, kv: KV, root: str, damage: list[Damage],
          rest: AtRest | None, problems: list[str], kept: list[str]) -> RecoveryReport:
    """``report`` with the damage the engine met and the comparison with the last clean
    close added (``problems`` and ``kept``: what checking the files at rest found)."""
    lost = {int(m) for m in report.lost}
    unknown = report.lost_unknown
    out_problems = list(problems) + list(report.problems)
    files = list(kept)
    for d in damage:
        files.append(os.path.relpath(d.kept, root))
        later = ids_named(b"\n".join(d.later_keys))
        named = ids_named(d.sample)
        if not named:
            unknown += 1
            out_problems.append(f"{d.detail}; no message id readable in them (kept in "
                                f"{files[-1]})")
            continue
        gone = sorted(m for m in named if m not in later and not _stored(kv, m))
        stays = sorted(m for m in named if m not in gone)
        lost.update(gone)
        out_problems.append(
            f"{d.detail}; they named message(s) {', '.join(map(str, sorted(named)))}: "
            + (f"lost {', '.join(map(str, gone))}" if gone else "none of them lost whole")
            + (f"; {', '.join(map(str, stays))} still stored or changed later (a state "
               "change of theirs may be undone, and a body chunk may be gone: a read of "
               "it finds that, and quarantines the message)" if stays else "")
            + f" (kept in {files[-1]})")
    if rest is not None:
        gone_entries, changed = compare(rest, entries_of(kv))
        out_problems += changed
        for mid, idxs in gone_entries.items():
            lost.add(mid)
            out_problems.append(
                f"message {mid}: entries {', '.join(keys.entry_id(mid, i) for i in idxs)} "
                "were queued at the last clean close and are lost to damage at rest")
    if lost == {int(m) for m in report.lost} and unknown == report.lost_unknown and (
            not files and out_problems == list(report.problems)):
        return report
    return replace(report, lost=tuple(str(m) for m in sorted(lost)), lost_unknown=unknown,
                   damaged_files=tuple(report.damaged_files) + tuple(files),
                   problems=tuple(out_problems))
