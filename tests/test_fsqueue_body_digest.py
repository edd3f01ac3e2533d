"""The body digest of the filesystem queue: CRC-32 in what it writes, sha256 in what an
older version wrote, each checked as its kind while the body is read, and a message file
of either kind opened, delivered and repaired as it is."""

from __future__ import annotations

import hashlib
import json
import os
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from queue_ref import CorruptionError, Recipient, Schedule
from queue_ref.body_digest import BodyDigest, is_digest, is_sha256
from queue_ref.fsqueue import FsQueue
from queue_ref.fsqueue.fs_records import Envelope, RecordError, decode, encode
from tests.test_damage_fs import repair
from tests.test_fsqueue_support import message_parts
from tests.test_multi_root import deliver_all

BODY = b"Subject: digest\r\n\r\n" + b"".join(b"line %06d\r\n" % i for i in range(20_000))


@given(st.lists(st.binary(max_size=300), max_size=6))
def test_a_digest_fed_in_pieces_is_the_digest_of_the_whole(pieces: list[bytes]) -> None:
    crc, sha = BodyDigest(), BodyDigest("0" * 64)
    for p in pieces:
        crc.update(p)
        sha.update(memoryview(p))
    whole = b"".join(pieces)
    assert crc.value() == f"crc32:{zlib.crc32(whole):08x}"
    assert sha.value() == hashlib.sha256(whole).hexdigest()
    assert is_digest(crc.value()) and not is_sha256(crc.value())
    assert is_digest(sha.value()) and is_sha256(sha.value())


def _enqueue(q: FsQueue, n: int = 2) -> str:
    with q.enqueue("a@example.org", {"SIZE": str(len(BODY))}) as e:
        e.write(BODY[:70_000])  # past the write buffer: the digest runs over two writes
        e.write(BODY[70_000:])
        return e.commit([Recipient(f"r{k}@example.net", Schedule(0)) for k in range(n)]
                        )[0].message_id


def _envelope_fields(q: FsQueue, msgid: str) -> dict[str, object]:
    record = message_parts(os.path.join(q.root, "data", msgid))[1]
    return decode(record, "envelope")


def write_sha256_digests(monkeypatch: pytest.MonkeyPatch) -> None:
    """Write as the versions before did: a sha256 of each body (under ``body_sha256`` in
    an fs envelope, ``sha256`` in a KV metadata record)."""
    monkeypatch.setattr(BodyDigest.__init__, "__defaults__", ("0" * 64,))


def _two_messages(root: str, monkeypatch: pytest.MonkeyPatch, old: bool) -> tuple[str, str]:
    """A queue at ``root`` holding two messages of one recipient (each with a sha256 if
    ``old``), closed: their ids."""
    with monkeypatch.context() as m:
        if old:
            write_sha256_digests(m)
        q = FsQueue(root)
        ids = _enqueue(q, 1), _enqueue(q, 1)
        q.close()
    return ids


def test_a_message_is_written_with_a_crc32_and_delivered_whole(tmp_path) -> None:
    q = FsQueue(str(tmp_path / "q"))
    msgid = _enqueue(q)
    fields = _envelope_fields(q, msgid)
    assert fields["body_digest"] == f"crc32:{zlib.crc32(BODY):08x}"
    assert "body_sha256" not in fields
    assert deliver_all(q) == [BODY, BODY]
    q.close()


def test_a_queue_an_older_version_wrote_opens_and_delivers_as_it_is(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(tmp_path / "q")
    with monkeypatch.context() as m:
        write_sha256_digests(m)
        q = FsQueue(root)
        old = _enqueue(q)
        q.close()
    q = FsQueue(root)  # the version now
    assert _envelope_fields(q, old)["body_sha256"] == hashlib.sha256(BODY).hexdigest()
    assert "body_digest" not in _envelope_fields(q, old)
    new = _enqueue(q, 1)
    assert "body_digest" in _envelope_fields(q, new)
    assert not q.recover().lost
    assert sorted(deliver_all(q)) == [BODY] * 3
    q.close()


@pytest.mark.parametrize("old", [False, True], ids=["crc32", "sha256"])
def test_a_flipped_bit_is_caught_whichever_digest_the_message_carries(
        tmp_path, monkeypatch: pytest.MonkeyPatch, old: bool) -> None:
    """A bit flipped in the body is never delivered: the last bytes are withheld and the
    message quarantined, under either digest."""
    root = str(tmp_path / "q")
    bad, good = _two_messages(root, monkeypatch, old)
    path = os.path.join(root, "data", bad)
    with open(path, "r+b") as f:
        f.seek(123_456)
        byte = f.read(1)
        f.seek(123_456)
        f.write(bytes([byte[0] ^ 0x10]))
    q = FsQueue(root)
    got, caught, sent = [], [], []
    for h in list(q.list_queue()):
        f = q.send_start(h)
        assert f is not None
        try:
            with q.read_inflight(f) as r:
                got.append(r.read_all())
                sent.append(h.message_id)
        except CorruptionError as e:
            caught.append(h.message_id)
            assert "digest does not match" in str(e)
    assert got == [BODY] and sent == [good] and caught == [bad]
    assert os.path.exists(os.path.join(root, "quarantine", bad + ".msg"))
    q.close()


def test_an_envelope_holds_exactly_one_digest_of_its_kind() -> None:
    """A record with both fields, neither, a sha256 named ``body_digest`` or a CRC-32
    named ``body_sha256`` is refused (the message is quarantined, not guessed at)."""
    env = Envelope("m" * 38, "", {}, 3, "crc32:0a0b0c0d", (Recipient("a@b", Schedule(1)),))
    assert Envelope.decode(env.encode(), "m" * 38) == env
    old = Envelope("m" * 38, "", {}, 3, "ab" * 32, (Recipient("a@b", Schedule(1)),))
    assert b'"body_sha256":"' + b"ab" * 32 in old.encode()
    assert Envelope.decode(old.encode(), "m" * 38) == old
    base = json.loads(env.encode().partition(b"\n")[2])
    del base["kind"], base["body_digest"]
    for fields in ({}, {"body_digest": "crc32:0a0b0c0d", "body_sha256": "ab" * 32},
                   {"body_digest": "ab" * 32}, {"body_sha256": "crc32:0a0b0c0d"},
                   {"body_digest": "crc32:0A0B0C0D"}, {"body_digest": "crc32:0a0b0c"},
                   {"body_digest": 5}):
        with pytest.raises(RecordError):
            Envelope.decode(encode("envelope", {**base, **fields}), "m" * 38)


@pytest.mark.parametrize("old", [False, True], ids=["crc32", "sha256"])
def test_repair_puts_back_an_intact_message_of_either_kind_and_not_a_damaged_one(
        tmp_path, monkeypatch: pytest.MonkeyPatch, old: bool) -> None:
    """Two messages lose their only link (recovery sets them aside, reported lost); one
    of them also has a byte of its body changed.  ``queue-ref repair`` checks each body
    against its envelope's digest, whichever its kind: the intact one goes back and is
    delivered whole, the damaged one stays in quarantine."""
    root = str(tmp_path / "q")
    intact, bad = _two_messages(root, monkeypatch, old)
    for msgid in (intact, bad):
        os.unlink(os.path.join(root, "queue", f"{msgid}.0"))
    q = FsQueue(root)
    assert sorted(q.last_recovery.lost) == sorted([intact, bad])
    q.close()
    with open(os.path.join(root, "quarantine", f"{bad}.unlinked"), "r+b") as f:
        f.seek(len(BODY) - 1)
        f.write(b"?")
    done = repair(root)
    assert done["restored"] == [intact]
    assert any(bad in a and "digest" in a for a in done["actions"]), done["actions"]
    assert deliver_all(FsQueue(root)) == [BODY]
