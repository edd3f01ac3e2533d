"""Damage at rest: every file a backend wrote is damaged in turn; nothing may go silently.

The check fills a queue (messages of one and two recipients, some already delivered and
cleaned up, an entry of two others rescheduled), closes it, and keeps that directory as
a template. Each trial copies the template, damages one file of the copy (every regular
file and symbolic link the backend left, so a backend with its own I/O is damaged
through its directory as a whole) by a bit flip (anywhere, or aimed at the framing near
its end), a truncation (to any length, or of its last writes only), a removal, or (for a
symbolic link) a stray link beside it, a name the store never wrote, opens
the copy and delivers everything it lists. C6 requires, for every trial:

* opening either works or refuses with ``DamagedStoreError`` (a store that cannot tell
  what it lost must not start as if nothing happened, and must say that its files are
  damaged); any other exception fails C9, a ``StorageIOError`` or another
  ``QueueError`` included: it tells the operator the disk failed, or nothing useful,
  when the disk is fine and the store tripped over damage it did not recognise;
* no body is delivered with other bytes, no entry with another recipient, and no entry
  the store never committed (C6);
* every acknowledged message not delivered is named: in the recovery report of the open
  (``Storage.last_recovery``: ``lost``, or counted in ``lost_unknown``), or by a typed
  error (``CorruptionError``) when its body is read (C6); counted only when its id is
  unreadable: a flipped bit changes one byte, so a message whose id lies readable within
  ``ID_WINDOW`` bytes of the flip (a word of its own of at least ``ID_WORD`` characters,
  leading zeros aside) must be named;
* the undamaged rest is still served: every message not named is delivered (C6), and a
  flipped bit takes out no message whose body lies whole after it in the same file
  beyond the next body (intact records after damage in the middle of a log are kept: a
  store that reads the rest of the file as a torn tail and names those messages lost
  fails C6);
* no message that was delivered and cleaned up before the damage comes back (C3);
* with ``Capability.DOMAIN_INDEX``, ``list_domain`` gives what ``list_queue`` gives (every
  recipient is in one domain): recovery mends the index it keeps (C13).

Also, in every trial: a ``CorruptionError`` whose ``quarantined_to`` is a path holds the
damaged bytes there (C6: "keeping the damaged files aside"); with nothing damaged,
nothing is named lost; and a message none of whose entries was delivered before the
damage, delivered whole to every recipient, is not named lost (C6: a false name sends
the operator and a bounce after mail that is fine).

A refusal that declares its repair (``DamagedStoreError.repair``: for the project's KV
queue, ``queue-ref repair``) has it run: it must not raise, the store it leaves must open
(C6: a repair "salvages every intact message"), and that open is judged by the rules
above, the names in the repair's report counting as named.

Every file is damaged at least once (in a way drawn at random), then in the other ways:
all of them in the thorough profile, up to 160 trials in all in the quick one.  A
framing flip aims at the end of a file, where a record's length or offset often is.

A second, *deep* template goes past a store's write buffer twice: a message of
``DEEP_RCPTS`` recipients, a body of ``DEEP_BODY`` bytes, a few deliveries of the first
message, another such body.  A store that buffers writes and flushes them to sorted
tables (LevelDB's 4 MiB write buffer, the log engine's memtable) then holds two tables
whose key ranges overlap, the older one with many small keys.  Its first trial damages
nothing: every message must read back whole (a store that takes a key missing from the
newer table for a deletion loses the older table's messages).  Then every file whose
kind the first template has none of (a table, say) is damaged every way, then swept at
its end (an *end flip* of the first zero byte of each run of zeros among its last
``FRAMING`` bytes outside every body: a footer's count or offset, small for its field,
made large), then flipped ``DEEP_FLIPS`` times outside every body (a *structure flip*: in
keys, lengths, headers, where no body digest can see it), with the same requirements.
A store that serves every message whole over such damage (but a structure flip's) and
reports nothing is used once more and must drain as the undamaged template does
(``unseen_damage_drain``, C8): bytes it never checks may steer what it keeps.

Both templates are filled once more by a child process that is then killed (SIGKILL)
with the queue open (plans ``killed`` and ``deep-killed``; ``damage_templates.py``): a
store that compares what it finds with the record of its last clean close has none to
compare with, so damage meets a store recovering from a crash (a log removed then must
still be named: LevelDB replays the logs it finds and says nothing of one that is gone).
The small one has nothing damaged, then a framing flip and a removal of every file, then
every file once more (flipped or removed: not cut short, which after a crash is what a torn write
leaves too) and ``EXTRA_FLIPS`` bit flips of each; the deep one is read back undamaged.
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from conformance.checks.damage_templates import (
    DEEP_STEPS,
    DOMAIN,
    KILLED,
    SHALLOW_STEPS,
    Template,
    fill,
)
from conformance.checks.disk_growth_check import Tree
from conformance.checks.file_damage import (
    END_FLIP,
    FRAMING,
    ID_WINDOW,
    KINDS,
    NOTHING,
    STRAY,
    STRUCTURE,
    Damage,
    after_flip,
    copy_tree,
    damage,
    files_of,
    held_whole,
    ids_readable,
    outside_bodies,
)
from conformance.checks.unseen_damage_drain import baseline, judge
from conformance.harness.backend_factory import Backend
from conformance.harness.check_catalog import NO_CRASH
from conformance.harness.check_results import CheckResult, Finding, Status, finished
from conformance.harness.suite_profiles import Profile
from queue_ref.storage import (
    Capability,
    CorruptionError,
    DamagedStoreError,
    QueueError,
    RecoveryReport,
    Storage,
)

__all__ = ["Damage", "after_flip", "copy_tree", "damage", "outside_bodies", "replay", "run",
           "scenario_id"]
#: Structure flips of each new kind of file of the deep template (most flips there are
#: caught by a record's own checksum, or harmless: few reach a key the store misreads).
DEEP_FLIPS = 64
#: Most trials on the deep template in the quick profile (its first, undamaged, included).
DEEP_QUICK_TRIALS = 72
#: Most trials on the killed template in the quick profile (its first, undamaged, included).
KILLED_QUICK_TRIALS = 40
#: The ways the killed template is damaged.  Not a file cut short: after a crash that is
#: what a write torn by a power cut leaves too, and a log-structured store cannot tell one
#: from the other without a record of what it held, which only a clean close leaves (the
#: cleanly closed templates are cut short every way).
KILLED_KINDS = ("bit flip", "framing flip", "removal")


QUICK_TRIALS = 160


#: Bit flips per file at other random places, after every file was damaged every way
#: (a store of few files, such as the KV queue's one log, gets them in the quick
#: profile too: a flip in the middle of a log must leave the records after it served).
EXTRA_FLIPS = 8


def _plan(files: list[str], thorough: bool, rng: random.Random,
          links: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """Every file once (in a random way), then a stray link beside one link of
    each kind (``links``: the files that are links; ``_kind``), then the other ways,
    shuffled (a stray beside every other link among them), then ``EXTRA_FLIPS`` more bit
    flips of each file: all of them when ``thorough``, else up to QUICK_TRIALS trials in
    all."""
    first = [(f, rng.choice(KINDS)) for f in files]
    by_kind: dict[str, list[str]] = {}
    for f in files:
        if f in links:
            by_kind.setdefault(_kind(f), []).append(f)
    strays = [(rng.choice(fs), STRAY) for _, fs in sorted(by_kind.items())]
    done = set(first) | set(strays)
    rest = [(f, k) for f in files for k in KINDS + ((STRAY,) if f in links else ())
            if (f, k) not in done]
    rng.shuffle(rest)
    extra = [(f, "bit flip") for f in files for _ in range(EXTRA_FLIPS)]
    rng.shuffle(extra)
    plan = first + strays + rest + extra
    return plan if thorough else plan[:max(QUICK_TRIALS, len(files) + len(strays))]


def _link_names(template: str, files: list[str]) -> frozenset[str]:
    """The files that are links: symbolic links, and every name of a file of several
    names but its first (the filesystem queue's entries are hard links to their message
    files): a stray link goes beside them."""
    first: dict[tuple[int, int], str] = {}
    out = set()
    for f in sorted(files):
        st = os.lstat(os.path.join(template, f))
        if stat.S_ISLNK(st.st_mode):
            out.add(f)
        elif st.st_nlink > 1:
            if (st.st_dev, st.st_ino) in first:
                out.add(f)
            else:
                first[(st.st_dev, st.st_ino)] = f
    return frozenset(out)


def _deep_plan(files: list[str], known: set[str], thorough: bool, rng: random.Random,
               ends: Callable[[str], list[int]]) -> list[tuple[str, str]]:
    """The deep template's trials: nothing damaged; then one file of each kind the first
    template has none of, every way, then the end flips ``ends`` gives for every file of
    those kinds, then ``DEEP_FLIPS`` structure flips of each first file (outside every
    body, where only the store's own checks can see them); then the same for the other
    files of those kinds.  All of it when ``thorough``, else the first DEEP_QUICK_TRIALS
    and the end flips (the quick plan is the start of the thorough one, so that a replay
    finds its trial)."""
    by_kind: dict[str, list[str]] = {}
    for f in files:
        if _kind(f) not in known:
            by_kind.setdefault(_kind(f), []).append(f)
    firsts = [rng.choice(fs) for _, fs in sorted(by_kind.items())]
    others = [f for fs in by_kind.values() for f in fs if f not in firsts]
    plan: list[tuple[str, str]] = [("", NOTHING)]
    sweep = [(f, f"{END_FLIP} {k}") for f in sorted(firsts + others) for k in ends(f)]
    for group in (firsts, others):
        ways = [(f, k) for f in group for k in KINDS]
        extra = [(f, STRUCTURE) for f in group for _ in range(DEEP_FLIPS)]
        rng.shuffle(ways)
        rng.shuffle(extra)
        plan += ways + (sweep if group is firsts else []) + extra
    return plan if thorough else plan[:DEEP_QUICK_TRIALS + len(sweep)]


def _end_flips(template: str, filled: Template, rel: str) -> list[int]:
    """Where the end-flip sweep flips a top bit in ``rel`` (``k``: the k-th byte from the
    end): the first byte of every run of zero bytes among its last FRAMING bytes that lie
    outside every body.  A count or offset small for its field has zero high bytes, so
    that flip makes the field large whichever its byte order; the other bytes are
    framing flips' and structure flips' to damage."""
    path = Path(template, rel)
    if path.is_symlink() or not path.is_file():
        return []
    data = path.read_bytes()
    ranges = filled.structure(rel)(data)
    ks = []
    for i in range(max(0, len(data) - FRAMING), len(data)):
        if (data[i] == 0 and (i == 0 or data[i - 1] != 0 or i == len(data) - FRAMING)
                and any(a <= i < b for a, b in ranges)):
            ks.append(len(data) - i)
    return ks


def _killed_plan(files: list[str], thorough: bool, rng: random.Random) -> list[tuple[str, str]]:
    """The killed template's trials: nothing damaged, then a framing flip and a removal of
    every file (its last bytes: a log's last record, the commit no clean-close record
    names after a crash; and a log LevelDB would open without), then every file once more
    in a random way (``KILLED_KINDS``), then ``EXTRA_FLIPS`` bit flips of each; all of it when
    ``thorough``, else the first ``KILLED_QUICK_TRIALS``."""
    order = list(files)
    rng.shuffle(order)
    each = [(f, k) for f in order for k in ("framing flip", "removal")]
    first = [(f, rng.choice(KILLED_KINDS)) for f in files]
    extra = [(f, "bit flip") for f in files for _ in range(EXTRA_FLIPS)]
    rng.shuffle(extra)
    plan = [("", NOTHING), *each, *first, *extra]
    return plan if thorough else plan[:KILLED_QUICK_TRIALS]


def _kind(rel: str) -> str:
    """A file's name with every number masked: ``000003.tbl`` and ``000011.tbl`` are
    files of one kind."""
    return re.sub(r"[0-9]+", "#", _shape(rel))


def _trial(backend: Backend, template: str, rel: str, kind: str, rng: random.Random,
           filled: Template, fill_steps: str, fail: list[Finding], stats: dict[str, int],
           scenario: str, undamaged: Callable[[int], Tree] | None = None) -> None:
    """One trial (the module's rules); ``undamaged(n)``: the tree of the undamaged
    template used again ``n`` times (``unseen_damage_drain``), to judge a store served
    over damage it did not see by."""
    work = tempfile.mkdtemp(prefix="queue-ref-atrest-")
    root = os.path.join(work, "q")
    try:
        copy_tree(template, root)
        hit = damage(Path(root, rel), kind, rng, filled.structure(rel))
        later = after_flip(Path(root, rel), hit.flipped, filled.want)
        steps = (fill_steps, f"{kind}: {hit.what}", "open the queue and deliver what it lists")
        damaged = "no damage" if kind == NOTHING else f"{kind} of {rel}"
        whole = held_whole(root, filled.want)  # what salvage could still find
        flipped = Path(root, rel).read_bytes() if hit.flipped is not None else None

        def finding(clause: str, detail: str) -> None:
            fail.append(Finding(clause, f"{damaged}: {detail}", scenario, NO_CRASH, steps))

        def kept(delivered: set[str], when: str) -> None:
            """Every message not delivered whose body lay whole in a file before the
            open still lies whole in one after it: the damaged files were kept."""
            now = held_whole(root, {m: filled.want[m] for m in whole if m not in delivered})
            gone = sorted(m for m in whole if m not in delivered and m not in now)
            if gone:
                m = gone[0]
                finding("C6", f"{len(gone)} messages not delivered whose bodies lay whole "
                              f"on the disk before the open are gone from it {when} (first: "
                              f"{m}, whole in {whole[m]}): a store that cannot serve a "
                              "message keeps the damaged files aside for `queue-ref "
                              "repair`, never deletes them or starts afresh over them")

        repaired: RecoveryReport | None = None
        try:
            store: Storage = backend.open(root)
        except DamagedStoreError as e:
            stats["refused"] += 1
            kept(set(), "after the open refused")
            if e.repair is None:
                return
            got = _repair(backend, root, e, finding, stats)
            if got is None:
                return
            kept(set(), "after the repair the refusal declares")
            store, repaired = got
            steps += ("the open refused: run the repair it declares, open again, deliver "
                      "what it lists",)
        except Exception as e:
            finding("C9", f"opening raised {type(e).__name__} ({e}), not DamagedStoreError "
                          "(the store's files are damaged, not the disk)")
            return
        seen = getattr(store, "last_recovery", None)
        failed = len(fail)
        delivered = _serve(store, filled, repaired, later, hit, kind == NOTHING, finding, stats,
                           flipped)
        kept(set(delivered), "once the queue was opened, served and closed")
        if (undamaged is not None and kind not in (NOTHING, STRUCTURE) and repaired is None
                and len(fail) == failed
                and not (seen is not None and seen.damage_found)
                and set(delivered) == set(filled.want)):
            stats["unseen"] += 1
            wrong = judge(backend, root, undamaged)
            if wrong is not None:
                finding(*wrong)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _repair(backend: Backend, root: str, refused: DamagedStoreError,
            finding: Callable[[str, str], None], stats: dict[str, int]
            ) -> tuple[Storage, RecoveryReport] | None:
    """Run the repair a refusal declares (``DamagedStoreError.repair``), then open the
    queue again: a store it leaves must open (C6: the repair "salvages every intact
    message"; a repair that fails, or leaves a store that cannot be opened, loses them
    all).  The open queue and the repair's report, or None after a finding."""
    stats["repaired"] += 1
    assert refused.repair is not None
    try:
        report = refused.repair()
    except Exception as e:
        finding("C6", f"the open refused ({refused}); the repair it declares raised "
                      f"{type(e).__name__} ({e}): every intact message is lost to the "
                      "operator")
        return None
    if not isinstance(report, RecoveryReport):
        finding("C9", f"the repair the refusal declares returned {report!r}, not a "
                      "RecoveryReport of what it could not save")
        return None
    try:
        return backend.open(root), report
    except Exception as e:
        finding("C6", f"after the repair the refusal declares, opening raised "
                      f"{type(e).__name__} ({e}): a repaired store opens and serves every "
                      "intact message")
        return None


def _serve(store: Storage, filled: Template, repaired: RecoveryReport | None, later: dict[str, int],
           hit: Damage, undamaged: bool, finding: Callable[[str, str], None],
           stats: dict[str, int], flipped: bytes | None = None) -> dict[str, bytes]:
    """Deliver everything the open ``store`` lists and judge it (the module's rules);
    ``repaired`` is the report of a repair run before the open (its names count as named);
    ``undamaged``: the trial damaged nothing; ``flipped``: the bytes of a file a bit flip
    damaged, as the store found them.
    Closes the store; returns the messages delivered whole to every entry still queued
    at the damage (a message delivered to some only must still lie whole somewhere, or be
    named)."""
    want, rcpt_of, cleaned = filled.want, filled.rcpt_of, filled.cleaned
    after = "after the repair, " if repaired is not None else ""
    repaired = repaired or RecoveryReport()
    delivered: dict[str, bytes] = {}
    delivered_entries: set[str] = set()
    msg_of = {e: m for e, m in filled.message_of.items() if m in want and e not in filled.sent}
    try:
        report = getattr(store, "last_recovery", None) or RecoveryReport()
        lost_unknown = report.lost_unknown + repaired.lost_unknown
        named = set(report.lost) | set(repaired.lost)
        seen: set[str] = set()
        altered: set[str] = set()
        listed = list(store.list_queue())
        if Capability.DOMAIN_INDEX in store.capabilities:
            by_index = {h.entry_id for h in store.list_domain(DOMAIN)}
            queued = {h.entry_id for h in listed}
            if by_index != queued:
                finding("C13", f"{after}list_domain({DOMAIN!r}) gives {len(by_index)} "
                               f"entries, list_queue {len(queued)} (every recipient is in "
                               "that domain): recovery did not mend the domain index")
        for h in listed:
            if h.entry_id in seen:
                finding("C6", f"{after}entry {h.entry_id} was listed twice")
            seen.add(h.entry_id)
            try:
                f = store.send_start(h)
                if f is None:
                    continue
                with store.read_inflight(f) as r:
                    body = r.read_all()
                    meta = r.meta
            except (CorruptionError, DamagedStoreError) as e:
                named.add(h.message_id)  # the store says the message is damaged
                # Where the error says the damaged bytes went (a path in the queue's
                # directory; a KV store names a key) must hold them, also after another
                # entry of the message was delivered and cleaned up: damage that took a
                # name counting the message's holders must not let that cleanup free it.
                kept = getattr(e, "quarantined_to", None)
                if kept and os.path.isabs(kept) and not os.path.lexists(kept):
                    finding("C6", f"{after}reading message {h.message_id} raised "
                                  f"CorruptionError saying it was quarantined to {kept}, "
                                  "which does not exist: the damaged bytes were not kept "
                                  "where the error says (or not kept at all)")
                continue
            except QueueError as e:
                finding("C9", f"{after}claiming or reading listed message {h.message_id} "
                              f"raised {type(e).__name__} ({e}), not CorruptionError: "
                              "a damaged message must be named as damaged")
                named.add(h.message_id)
                continue
            if h.message_id in cleaned:
                finding("C3", f"{after}message {h.message_id}, delivered and cleaned up "
                              "before the damage, came back")
            elif h.entry_id in filled.sent:
                finding("C3", f"{after}entry {h.entry_id}, delivered before the damage, "
                              "came back")
            elif h.message_id not in want:
                finding("C6", f"{after}an entry of an unknown message {h.message_id} was "
                              "listed")
            elif h.entry_id not in rcpt_of:
                finding("C6", f"{after}entry {h.entry_id} of message {h.message_id}, which "
                              "was never committed (the message has no such recipient), "
                              f"was delivered to {meta.rcpt!r}: a name the store did not "
                              "write is damage, not an entry")
            elif body != want[h.message_id]:
                altered.add(h.message_id)
                finding("C6", f"{after}message {h.message_id} was delivered with other "
                              f"bytes ({len(body)} for {len(want[h.message_id])})")
            elif rcpt_of.get(h.entry_id) not in (None, meta.rcpt):
                finding("C6", f"{after}entry {h.entry_id} was delivered to {meta.rcpt!r}, "
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
            finding("C6", f"{after}{len(kept_out)} messages whose bodies lie whole after "
                          f"the flipped byte {hit.flipped} and the next body were named "
                          f"lost (first: {m}, its body at byte {later[m]}): intact records "
                          "after damage in the middle of a file are kept, not taken for a "
                          "torn tail")
        reported = set(report.lost) | set(repaired.lost)
        if undamaged and (reported or lost_unknown):
            finding("C6", f"{after}nothing was damaged, yet recovery names "
                          f"{len(reported)} messages lost (first: {min(reported, default='-')}) "
                          f"and {lost_unknown} records of unknown messages")
        # a message none of whose entries was delivered before the damage, delivered
        # whole to every recipient now (a message with an entry delivered before may be
        # named when damage took that entry's name: recovery cannot tell it was done)
        untouched = set(want) - {filled.message_of[e] for e in filled.sent}
        false = sorted(m for m in reported & set(delivered) & untouched
                       if all(e in delivered_entries for e, mm in msg_of.items() if mm == m))
        if false:
            finding("C6", f"{after}recovery names {len(false)} messages lost that were "
                          f"then delivered whole to every recipient (first: {false[0]}): "
                          "`lost` names what damage took; a false name sends the operator "
                          "and a bounce after mail that is fine")
        silent = sorted(set(want) - set(delivered) - named - altered)
        if silent and not lost_unknown:
            finding("C6", f"{after}{len(silent)} acknowledged messages were neither "
                          f"delivered nor named lost (first: {silent[0]})")
        missing = sorted(e for e, m in msg_of.items() if m in delivered
                         and e not in delivered_entries and m not in named | altered)
        if missing and not lost_unknown:
            finding("C6", f"{after}{len(missing)} acknowledged entries of messages "
                          "delivered to their other recipients were neither delivered nor "
                          f"named lost (first: {missing[0]}, to {rcpt_of[missing[0]]!r})")
        counted = set(silent) | {msg_of[e] for e in missing}
        readable = (ids_readable(flipped, counted, hit.flipped)
                    if flipped is not None and hit.flipped is not None and lost_unknown
                    and counted else set())
        if readable:
            m = min(readable)
            finding("C6", f"{after}{len(readable)} acknowledged messages not delivered were "
                          f"only counted in lost_unknown ({lost_unknown}), not named, though "
                          f"their ids lie readable next to the flipped bit (first: {m}, "
                          f"within {ID_WINDOW} bytes of byte {hit.flipped}): a flipped bit "
                          "changes one byte, so a store that reads the damaged bytes names "
                          "every id they hold; `lost_unknown` counts records whose ids are "
                          "unreadable")
        stats["delivered"] += len(delivered)
        stats["named_lost"] += len(named & set(want))
        if report.damage_found or named:
            stats["detected"] += 1
    except QueueError:
        stats["refused_later"] += 1  # a typed error while serving: the store says so
    except Exception as e:
        finding("C9", f"{after}serving the damaged queue raised {type(e).__name__} ({e}), "
                      "not a QueueError")
    finally:
        with contextlib.suppress(Exception):
            store.close()
    return {m: b for m, b in delivered.items()
            if all(e in delivered_entries for e, mm in msg_of.items() if mm == m)}


def scenario_id(seed: int, trial: int, kind: str, rel: str, plan: str = "trial") -> str:
    """``damage-at-rest:seed=S:trial=N:<kind>:<file>``: the N-th trial of the plan drawn
    from S (the file is named for a person; the plan's order finds it again in a new fill,
    whose file names differ only in ids); ``deep=N`` for the deep template's plan."""
    return f"damage-at-rest:seed={seed}:{plan}={trial}:{kind}:{rel}"


def _shape(rel: str) -> str:
    """A file's name with its ids (runs of hex digits) masked: the same file of a new fill."""
    return re.sub(r"[0-9a-f]{8,}", "#", rel)


#: The plans, each over a template of its own: the small queue closed cleanly, the deep
#: one, and both left by a filler that was killed instead of closing (no clean-close
#: record: what a store compares with at its next open is not there).
PLANS = ("trial", "deep", "killed", "deep-killed")
STEPS_OF = {"trial": SHALLOW_STEPS, "deep": DEEP_STEPS,
            "killed": SHALLOW_STEPS.replace(", close", KILLED),
            "deep-killed": DEEP_STEPS.replace(", close", KILLED)}
STATS_OF = {"trial": "trials", "deep": "deep_trials", "killed": "killed_trials",
            "deep-killed": "killed_trials"}


def _trials(backend: Backend, seed: int, every_way: bool, only: tuple[str, int] | None,
            findings: list[Finding], stats: dict[str, int],
            expect: tuple[str, str] | None = None) -> None:
    """Fill the templates, then run the plans drawn from ``seed`` (only the trial
    ``only`` = (plan, number) when given).  Each trial draws its damage from its own
    generator, so it is the same trial whether run in the plan or alone."""
    base = tempfile.mkdtemp(prefix="queue-ref-atrest-template-")
    thorough = every_way or only is not None
    try:
        known: set[str] = set()  # the kinds of file of the first template
        for plan_name in PLANS:
            # the deep plan needs the kinds of file of the first template
            if only is not None and only[0] != plan_name and (plan_name, only[0]) != (
                    "trial", "deep"):
                continue
            deep = plan_name.startswith("deep")
            template = os.path.join(base, plan_name)
            os.mkdir(template)
            filled = fill(backend, template, deep, killed=plan_name.endswith("killed"))
            files = files_of(template)
            if plan_name == "deep":
                plan = _deep_plan(files, known, thorough, random.Random(f"{seed}:deep"),
                                  functools.partial(_end_flips, template, filled))
                stats["deep_files"] = len({f for f, _ in plan[1:]})
            elif plan_name == "trial":
                known = {_kind(f) for f in files}
                stats["files"] = len(files)
                if only is not None and only[0] != plan_name:
                    continue
                links = _link_names(template, files)
                plan = _plan(files, thorough, random.Random(seed), links)
            elif plan_name == "killed":
                plan = _killed_plan(files, thorough, random.Random(f"{seed}:killed"))
            else:  # the deep template read back after its filler was killed
                plan = [("", NOTHING)]
            if only is not None and expect is not None:
                n = only[1]
                if not 0 <= n < len(plan):
                    raise ValueError(f"this backend's {plan_name} plan for seed {seed} has "
                                     f"{len(plan)} trials, no trial {n}")
                rel, kind = plan[n]
                if (kind, _shape(rel)) != (expect[0], _shape(expect[1])):
                    raise ValueError(f"{plan_name} {n} of seed {seed} is a {kind} of {rel} "
                                     f"for this backend, not a {expect[0]} of {expect[1]}: "
                                     "the scenario comes from another backend or version")
            undamaged = (functools.cache(functools.partial(baseline, backend, template))
                         if plan_name == "deep" else None)
            for n, (rel, kind) in enumerate(plan):
                if only is not None and n != only[1]:
                    continue
                stats[STATS_OF[plan_name]] += 1
                rng = random.Random(f"{seed}:{n}" if plan_name == "trial"
                                    else f"{seed}:{plan_name}:{n}")
                _trial(backend, template, rel, kind, rng, filled, STEPS_OF[plan_name],
                       findings, stats, scenario_id(seed, n, kind, rel, plan_name), undamaged)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _stats() -> dict[str, int]:
    return {"files": 0, "trials": 0, "deep_files": 0, "deep_trials": 0, "killed_trials": 0,
            "refused": 0,
            "unseen": 0, "repaired": 0, "refused_later": 0, "detected": 0, "delivered": 0, "named_lost": 0}


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


#: How many fresh templates ``replay`` fills before it reports that a trial found nothing.
REPLAY_TRIES = 12


def replay(backend: Backend, scenario: str) -> list[Finding]:
    """The findings of one trial, by its scenario id (``scenario_id``).  The template is
    filled anew, and a store that writes its clock into its files (a creation time) gives
    other bytes each time: the same damage at the same offset then meets other bytes, and
    what follows from it may differ (a checksum compared the wrong way passes about half
    the blocks).  So a trial that finds nothing is run again on a new fill, up to
    ``REPLAY_TRIES`` times."""
    parts = scenario.split(":", 4)
    plan, _, number = parts[2].partition("=") if len(parts) > 2 else ("", "", "")
    if (len(parts) < 4 or parts[0] != "damage-at-rest" or not parts[1].startswith("seed=")
            or plan not in PLANS or not number.isdigit()
            or not parts[1][5:].isdigit()):
        raise ValueError(f"{scenario!r}: expected damage-at-rest:seed=S:<plan>=N:<kind>:<file> "
                         f"(plan: one of {', '.join(PLANS)})")
    findings: list[Finding] = []
    expect = (parts[3], parts[4]) if len(parts) == 5 else None
    for _ in range(REPLAY_TRIES):
        _trials(backend, int(parts[1][5:]), True, (plan, int(number)), findings, _stats(),
                expect)
        if findings:
            break
    return findings
