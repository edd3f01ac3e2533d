"""Damage at rest: every file a backend wrote is damaged in turn; nothing may go silently.

The check fills a queue (messages of one and two recipients, some already delivered and
cleaned up), closes it, and keeps that directory as a template.  Each trial copies the
template, damages one file of the copy (every regular file and symbolic link the backend
left, so a backend with its own I/O is damaged through its directory as a whole) by a bit
flip (anywhere, or aimed at the framing near its end), a truncation (to any length, or of
its last writes only) or a removal, opens the copy and delivers everything it lists.  C6
requires, for every trial:

* opening either works or refuses with ``DamagedStoreError`` (a store that cannot tell
  what it lost must not start as if nothing happened, and must say that its files are
  damaged); any other exception fails C9, a ``StorageIOError`` or another
  ``QueueError`` included: it tells the operator the disk failed, or nothing useful,
  when the disk is fine and the store tripped over damage it did not recognise;
* no body is delivered with other bytes, and no entry with another recipient (C6);
* every acknowledged message not delivered is named: in the recovery report of the open
  (``Storage.last_recovery``: ``lost``, or counted in ``lost_unknown``), or by a typed
  error (``CorruptionError``) when its body is read (C6);
* the undamaged rest is still served: every message not named is delivered (C6), and a
  flipped bit takes out no message whose body lies whole after it in the same file
  beyond the next body (intact records after damage in the middle of a log are kept: a
  store that reads the rest of the file as a torn tail and names those messages lost
  fails C6);
* no message that was delivered and cleaned up before the damage comes back (C3);
* with ``Capability.DOMAIN_INDEX``, ``list_domain`` gives what ``list_queue`` gives (every
  recipient is in one domain): recovery mends the index it keeps (C13).

Every file is damaged at least once (in a way drawn at random), then in the other ways:
all of them in the thorough profile, up to 160 trials in all in the quick one.  A
framing flip aims at the end of a file, where a record's length or offset often is.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.suite_profiles import Profile
from queue_ref.storage import (
    Capability,
    CorruptionError,
    DamagedStoreError,
    QueueError,
    Recipient,
    RecoveryReport,
    Schedule,
    Storage,
)

DOMAIN = "example.net"  # every recipient's: list_domain must give what list_queue gives
KINDS = ("bit flip", "framing flip", "truncation", "tail cut", "removal")
FRAMING = 32  # a framing flip hits one of the last FRAMING bytes of a file
MESSAGES = 8
CLEANED = 2  # messages delivered and cleaned up before the damage


def _body(i: int) -> bytes:
    return b"Subject: at rest %d\r\n\r\n" % i + (b"line %03d of the body\r\n" % i) * (20 + 13 * i)


def _fill(backend: Backend, root: str
          ) -> tuple[dict[str, bytes], dict[str, str], set[str], dict[str, str]]:
    """The template queue: (message id -> body of messages still queued, entry id ->
    recipient, ids of messages delivered and cleaned up)."""
    store = backend.open(root)
    want: dict[str, bytes] = {}
    rcpt_of: dict[str, str] = {}
    message_of: dict[str, str] = {}
    try:
        for i in range(MESSAGES):
            rcpts = [Recipient(f"r{i}.{k}@{DOMAIN}", Schedule(i)) for k in range(1 + i % 2)]
            with store.enqueue(f"s{i}@example.org") as enq:
                enq.write(_body(i))
                handles = enq.commit(rcpts)
            want[handles[0].message_id] = _body(i)
            for h, r in zip(handles, rcpts, strict=True):
                rcpt_of[h.entry_id] = r.address
                message_of[h.entry_id] = h.message_id
        cleaned: set[str] = set()
        for h in list(store.list_queue()):
            if len(cleaned) == CLEANED and h.message_id not in cleaned:
                continue
            cleaned.add(h.message_id)
            f = store.send_start(h)
            done = store.send_done(f) if f is not None else None
            if done is not None:
                store.cleanup(done)
        for m in cleaned:
            want.pop(m, None)
    finally:
        store.close()
    return want, rcpt_of, cleaned, message_of


def copy_tree(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` as it is: symbolic links as links, and the names of one
    file as names of one file (hard links), so damage to one name is damage to all of
    them, as on the disk (``shutil.copytree`` would make each name a file of its own)."""
    seen: dict[tuple[int, int], str] = {}
    os.mkdir(dst)
    for d, dirs, names in os.walk(src):
        rel = os.path.relpath(d, src)
        for n in dirs:
            s = os.path.join(d, n)
            if os.path.islink(s):
                os.symlink(os.readlink(s), os.path.join(dst, rel, n))
            else:
                os.mkdir(os.path.join(dst, rel, n))
        for n in names:
            s, t = os.path.join(d, n), os.path.join(dst, rel, n)
            st = os.lstat(s)
            if os.path.islink(s):
                os.symlink(os.readlink(s), t)
            elif (st.st_dev, st.st_ino) in seen:
                os.link(seen[(st.st_dev, st.st_ino)], t)
            else:
                shutil.copy2(s, t)
                if st.st_nlink > 1:
                    seen[(st.st_dev, st.st_ino)] = t


def _files(root: str) -> list[str]:
    out = []
    for d, _dirs, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            if os.path.islink(p) or os.path.isfile(p):
                out.append(os.path.relpath(p, root))
    return sorted(out)


@dataclass(frozen=True)
class Damage:
    what: str  # for the finding
    flipped: int | None = None  # the offset of a flipped bit in a regular file


def damage(path: Path, kind: str, rng: random.Random) -> Damage:
    """Damage ``path`` in place; returns what was done."""
    if kind == "removal":
        path.unlink()
        return Damage(f"removed {path.name}")
    if path.is_symlink():
        target = bytearray(os.readlink(path).encode())
        if kind == "bit flip":
            i = rng.randrange(len(target))
            target[i] ^= 1 << rng.randrange(7)  # stays ASCII: a valid, wrong target
            what = f"flipped a bit of {path.name}'s target"
        else:
            del target[rng.randrange(len(target)):]
            what = f"cut {path.name}'s target to {len(target)} bytes"
        path.unlink()
        os.symlink(bytes(target) or b"x", path)
        return Damage(what)
    data = bytearray(path.read_bytes())
    if not data:
        path.write_bytes(b"\x01")
        return Damage(f"wrote a byte into the empty {path.name}")
    flipped: int | None = None
    if kind == "bit flip":
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
        what = f"flipped bit of byte {i} of {path.name} ({len(data)} bytes)"
        flipped = i
    elif kind == "framing flip":
        # Framing (a record's length or offset) often sits at the end of a file, and as
        # decimal digits in a text format: aim at a digit there when there is one, and
        # flip one of the low four bits (a digit stays a digit, a length grows or shrinks).
        tail = range(max(0, len(data) - FRAMING), len(data))
        digits = [j for j in tail if 0x30 <= data[j] <= 0x39]
        i = rng.choice(digits or list(tail))
        data[i] ^= 1 << rng.randrange(4)
        what = (f"flipped a low bit of byte {i} of {path.name} ({len(data)} bytes), in its "
                f"last {FRAMING}")
        flipped = i
    else:  # a truncation keeps any length; a tail cut loses at most the last quarter
        keep = (rng.randrange(len(data)) if kind == "truncation"
                else len(data) - 1 - rng.randrange(max(1, len(data) // 4)))
        del data[keep:]
        what = f"cut {path.name} to {keep} of its bytes"
    path.write_bytes(bytes(data))
    return Damage(what, flipped)


def after_flip(path: Path, at: int | None, bodies: dict[str, bytes]) -> dict[str, int]:
    """The messages whose body lies whole in the file ``path`` after byte ``at`` and after
    another message's body that lies whole after it (the offset of each): a flip damages
    one record, which may hold the next body after it (its header, the flip's record), but
    not the body after that one.  Those are undamaged records of a log, which recovery
    must keep."""
    if at is None or path.is_symlink() or not path.is_file():
        return {}
    data = path.read_bytes()
    found = sorted((pos, m) for m, body in bodies.items() if (pos := data.find(body)) > at)
    if not found:
        return {}
    first_end = found[0][0] + len(bodies[found[0][1]])
    return {m: pos for pos, m in found[1:] if pos >= first_end}


QUICK_TRIALS = 160


#: Bit flips per file at other random places, after every file was damaged every way
#: (a store of few files, such as the KV queue's one log, gets them in the quick
#: profile too: a flip in the middle of a log must leave the records after it served).
EXTRA_FLIPS = 8


def _plan(files: list[str], thorough: bool, rng: random.Random) -> list[tuple[str, str]]:
    """Every file once (in a random way), then the other ways, shuffled, then
    ``EXTRA_FLIPS`` more bit flips of each file: all of them when ``thorough``, else up
    to QUICK_TRIALS trials in all."""
    first = [(f, rng.choice(KINDS)) for f in files]
    rest = [(f, k) for f in files for k in KINDS if (f, k) not in set(first)]
    rng.shuffle(rest)
    extra = [(f, "bit flip") for f in files for _ in range(EXTRA_FLIPS)]
    rng.shuffle(extra)
    plan = first + rest + extra
    return plan if thorough else plan[:max(QUICK_TRIALS, len(files))]


def _trial(backend: Backend, template: str, rel: str, kind: str, rng: random.Random,
           want: dict[str, bytes], rcpt_of: dict[str, str], cleaned: set[str],
           message_of: dict[str, str],
           fail: list[Finding], stats: dict[str, int], scenario: str) -> None:
    work = tempfile.mkdtemp(prefix="queue-ref-atrest-")
    root = os.path.join(work, "q")
    try:
        copy_tree(template, root)
        hit = damage(Path(root, rel), kind, rng)
        what = hit.what
        later = after_flip(Path(root, rel), hit.flipped, want)
        steps = (f"fill a queue of {MESSAGES} messages, deliver {CLEANED}, close",
                 f"{kind}: {what}", "open the queue and deliver what it lists")

        def finding(clause: str, detail: str) -> None:
            fail.append(Finding(clause, f"{kind} of {rel}: {detail}", scenario, NO_CRASH,
                                steps))

        try:
            store: Storage = backend.open(root)
        except DamagedStoreError:
            stats["refused"] += 1
            return
        except Exception as e:
            finding("C9", f"opening raised {type(e).__name__} ({e}), not DamagedStoreError "
                          "(the store's files are damaged, not the disk)")
            return
        try:
            report = getattr(store, "last_recovery", None) or RecoveryReport()
            delivered: dict[str, bytes] = {}
            delivered_entries: set[str] = set()
            msg_of = {e: m for e, m in message_of.items() if m in want}
            named = set(report.lost)
            seen: set[str] = set()
            altered: set[str] = set()
            listed = list(store.list_queue())
            if Capability.DOMAIN_INDEX in store.capabilities:
                by_index = {h.entry_id for h in store.list_domain(DOMAIN)}
                queued = {h.entry_id for h in listed}
                if by_index != queued:
                    finding("C13", f"list_domain({DOMAIN!r}) gives {len(by_index)} entries, "
                                   f"list_queue {len(queued)} (every recipient is in that "
                                   "domain): recovery did not mend the domain index")
            for h in listed:
                if h.entry_id in seen:
                    finding("C6", f"entry {h.entry_id} was listed twice")
                seen.add(h.entry_id)
                try:
                    f = store.send_start(h)
                    if f is None:
                        continue
                    with store.read_inflight(f) as r:
                        body = r.read_all()
                        meta = r.meta
                except (CorruptionError, DamagedStoreError):
                    named.add(h.message_id)  # the store says the message is damaged
                    continue
                except QueueError as e:
                    finding("C9", f"claiming or reading listed message {h.message_id} "
                                  f"raised {type(e).__name__} ({e}), not CorruptionError: "
                                  "a damaged message must be named as damaged")
                    named.add(h.message_id)
                    continue
                if h.message_id in cleaned:
                    finding("C3", f"message {h.message_id}, delivered and cleaned up before "
                                  "the damage, came back")
                elif h.message_id not in want:
                    finding("C6", f"an entry of an unknown message {h.message_id} was listed")
                elif body != want[h.message_id]:
                    altered.add(h.message_id)
                    finding("C6", f"message {h.message_id} was delivered with other bytes "
                                  f"({len(body)} for {len(want[h.message_id])})")
                elif rcpt_of.get(h.entry_id) not in (None, meta.rcpt):
                    finding("C6", f"entry {h.entry_id} was delivered to {meta.rcpt!r}, "
                                  f"not {rcpt_of[h.entry_id]!r}")
                else:
                    delivered[h.message_id] = body
                    delivered_entries.add(h.entry_id)
                done = store.send_done(f)
                if done is not None:
                    store.cleanup(done)
            kept_out = sorted(m for m in later if m in named and m not in delivered)
            if kept_out:
                m = kept_out[0]
                finding("C6", f"{len(kept_out)} messages whose bodies lie whole after the "
                              f"flipped byte {hit.flipped} and the next body were named lost (first: {m}, "
                              f"its body at byte {later[m]}): intact records after damage "
                              "in the middle of a file are kept, not taken for a torn tail")
            silent = sorted(set(want) - set(delivered) - named - altered)
            if silent and not report.lost_unknown:
                finding("C6", f"{len(silent)} acknowledged messages were neither delivered "
                              f"nor named lost (first: {silent[0]})")
            missing = sorted(e for e, m in msg_of.items() if m in delivered
                             and e not in delivered_entries and m not in named | altered)
            if missing and not report.lost_unknown:
                finding("C6", f"{len(missing)} acknowledged entries of messages delivered to "
                              "their other recipients were neither delivered nor named lost "
                              f"(first: {missing[0]}, to {rcpt_of[missing[0]]!r})")
            stats["delivered"] += len(delivered)
            stats["named_lost"] += len(named & set(want))
            if report.damage_found or named:
                stats["detected"] += 1
        except QueueError:
            stats["refused_later"] += 1  # a typed error while serving: the store says so
        except Exception as e:
            finding("C9", f"serving the damaged queue raised {type(e).__name__} ({e}), "
                          "not a QueueError")
        finally:
            with contextlib.suppress(Exception):
                store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def scenario_id(seed: int, trial: int, kind: str, rel: str) -> str:
    """``damage-at-rest:seed=S:trial=N:<kind>:<file>``: the N-th trial of the plan drawn
    from S (the file is named for a person; the plan's order finds it again in a new fill,
    whose file names differ only in ids)."""
    return f"damage-at-rest:seed={seed}:trial={trial}:{kind}:{rel}"


def _shape(rel: str) -> str:
    """A file's name with its ids (runs of hex digits) masked: the same file of a new fill."""
    return re.sub(r"[0-9a-f]{8,}", "#", rel)


def _trials(backend: Backend, seed: int, every_way: bool, only: int | None,
            findings: list[Finding], stats: dict[str, int],
            expect: tuple[str, str] | None = None) -> None:
    """Fill a template, then run the plan drawn from ``seed`` (trial ``only`` alone when
    given).  Each trial draws its damage from its own generator, so it is the same trial
    whether run in the plan or alone."""
    base = tempfile.mkdtemp(prefix="queue-ref-atrest-template-")
    try:
        template = os.path.join(base, "q")
        os.mkdir(template)
        want, rcpt_of, cleaned, message_of = _fill(backend, template)
        files = _files(template)
        stats["files"] = len(files)
        plan = _plan(files, every_way or only is not None, random.Random(seed))
        if only is not None and expect is not None:
            if not 0 <= only < len(plan):
                raise ValueError(f"this backend's plan for seed {seed} has {len(plan)} "
                                 f"trials, no trial {only}")
            rel, kind = plan[only]
            if (kind, _shape(rel)) != (expect[0], _shape(expect[1])):
                raise ValueError(f"trial {only} of seed {seed} is a {kind} of {rel} for this "
                                 f"backend, not a {expect[0]} of {expect[1]}: the scenario "
                                 "comes from another backend or version")
        for n, (rel, kind) in enumerate(plan):
            if only is not None and n != only:
                continue
            stats["trials"] += 1
            _trial(backend, template, rel, kind, random.Random(f"{seed}:{n}"), want, rcpt_of,
                   cleaned, message_of, findings, stats, scenario_id(seed, n, kind, rel))
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _stats() -> dict[str, int]:
    return {"files": 0, "trials": 0, "refused": 0, "refused_later": 0, "detected": 0,
            "delivered": 0, "named_lost": 0}


def run(backend: Backend, profile: Profile, seed: int) -> CheckResult:
    start = time.perf_counter()
    if not backend.takes_root:
        return CheckResult("damage-at-rest", NO_CRASH, Status.UNSUPPORTED,
                           note="the backend keeps nothing at rest (its factory takes no root)")
    findings: list[Finding] = []
    stats = _stats()
    _trials(backend, seed, profile.damage_every_way, None, findings, stats)
    return finished("damage-at-rest", NO_CRASH, findings, seconds=time.perf_counter() - start,
                    seed=seed, stats=stats)


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The findings of one trial, by its scenario id (``scenario_id``)."""
    parts = scenario.split(":", 4)
    if (len(parts) < 4 or parts[0] != "damage-at-rest" or not parts[1].startswith("seed=")
            or not parts[2].startswith("trial=")):
        raise ValueError(f"{scenario!r}: expected damage-at-rest:seed=S:trial=N:<kind>:<file>")
    findings: list[Finding] = []
    expect = (parts[3], parts[4]) if len(parts) == 5 else None
    _trials(backend, int(parts[1][5:]), True, int(parts[2][6:]), findings, _stats(), expect)
    return findings
