"""``session_handoff``: the master hands accepted connections to the worker holding the
fewest sessions, over real SOCK_SEQPACKET pairs with real descriptors.

The whole path through ``queue-ref relay --processes N`` is in test_relay_processes.py;
here each rule is made to happen: ties taken in turn, ended sessions counted back, a
worker that is not ready, gone or closed passed over, a report held back by a full
channel sent with the next one.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from queue_ref.relay.relay_server import Relay
from queue_ref.relay.session_handoff import Dispatcher, SessionInbox, channel_pair
from tests.relay_support import _ListStream, relay_config


@pytest.fixture
def workers() -> Iterator[tuple[Dispatcher, list[socket.socket]]]:
    """A dispatcher with three ready workers; the workers' ends of their channels."""
    d = Dispatcher()
    theirs = []
    for i in range(3):
        mine, end = channel_pair()
        d.attach(i, mine)
        d.set_ready(i)
        end.setblocking(False)
        theirs.append(end)
    yield d, theirs
    d.close()
    for end in theirs:
        end.close()


def _one_worker() -> tuple[Dispatcher, socket.socket, socket.socket]:
    """A dispatcher with one ready worker: it, the master's end, the worker's end."""
    d = Dispatcher()
    mine, end = channel_pair()
    d.attach(0, mine)
    d.set_ready(0)
    return d, mine, end


def _hand(d: Dispatcher, n: int) -> list[socket.socket]:
    """Dispatch ``n`` connections (one end of a pair each); the client ends."""
    clients = []
    for _ in range(n):
        client, server = socket.socketpair()
        with server:
            assert d.dispatch(server)
        clients.append(client)
    return clients


def _fill(end: socket.socket) -> int:
    """Reports of nothing sent from a worker's ``end`` until its side of the channel is
    full (the master not reading); how many."""
    filled = 0
    while True:
        try:
            end.send(b"0")
        except BlockingIOError:
            return filled
        filled += 1


def _taken(end: socket.socket) -> list[socket.socket]:
    got = []
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(end, 16, 4)
        except BlockingIOError:
            return got
        assert msg == b"s" and len(fds) == 1
        got.append(socket.socket(fileno=fds[0]))


def test_connections_go_to_the_fewest_sessions_in_turn_and_ends_are_counted(workers):
    d, theirs = workers
    clients = _hand(d, 7)
    taken = [_taken(end) for end in theirs]
    assert [len(t) for t in taken] == [3, 2, 2]
    assert d.sessions() == {0: 3, 1: 2, 2: 2}
    # the descriptor a worker got is the connection itself: it reaches the client
    taken[1][0].sendall(b"220 hello\r\n")
    assert clients[1].recv(64) == b"220 hello\r\n"
    theirs[0].send(b"3")  # worker 0: three sessions ended
    d.read_reports()
    assert d.sessions() == {0: 0, 1: 2, 2: 2}
    more = _hand(d, 3)
    again = [_taken(end) for end in theirs]
    assert [len(t) for t in again] == [2, 1, 0]  # 0 until equal, then in turn
    for s in [*clients, *more, *(s for t in [*taken, *again] for s in t)]:
        s.close()


def test_a_worker_not_ready_gone_or_closed_is_passed_over(workers):
    d, theirs = workers
    mine, end = channel_pair()
    end.setblocking(False)
    d.attach(1, mine)  # worker 1 restarted: its successor is not ready yet
    theirs[2].close()  # worker 2 died: sending to it fails
    clients = _hand(d, 4)
    got = _taken(theirs[0])
    assert len(got) == 4 and _taken(end) == []
    clients += got
    assert d.sessions() == {0: 4, 1: 0, 2: 0}
    end.close()  # worker 1 closes its end (it stops): no longer waited on, never chosen
    d.set_ready(1)
    d.read_reports()
    d.set_ready(1)  # its ready line read after its channel closed: still passed over
    assert all(s.fileno() != mine.fileno() for s in d.sockets())
    d.drop(0)
    client, server = socket.socketpair()
    with client, server:
        assert not d.dispatch(server) and not d.any_ready()
    d.close()
    for s in clients:
        s.close()


def test_a_report_held_back_by_a_full_channel_goes_with_the_next():
    d, _, end = _one_worker()
    clients = _hand(d, 5)
    inbox = SessionInbox(end, asyncio.Protocol, lambda e: None, lambda e: None)
    for fd in _taken(end):
        fd.close()
    filled = _fill(end)  # the master does not read: the worker's side fills up
    inbox.ended()
    inbox.ended()  # both held back
    d.read_reports()  # the master reads the zeros: room again
    assert d.sessions() == {0: 5} and filled > 0
    inbox.ended()  # this one says three
    d.read_reports()
    assert d.sessions() == {0: 2}
    inbox.close()
    d.close()
    for s in clients:
        s.close()


def test_the_inbox_makes_sessions_and_reports_their_end():
    d, _, end = _one_worker()
    errors: list[BaseException] = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            transport.write(b"220 ready\r\n")  # type: ignore[attr-defined]

        def data_received(self, data: bytes) -> None:
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            inbox.ended()

    lost: list[BaseException | None] = []
    inbox = SessionInbox(end, Echo, errors.append, lost.append)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        inbox.start(loop)
        clients = await loop.run_in_executor(None, _hand, d, 2)
        for c in clients:
            c.settimeout(5)
            assert await loop.run_in_executor(None, c.recv, 64) == b"220 ready\r\n"
        assert d.sessions() == {0: 2}
        d.read_reports()  # the inbox said it took both before answering: no copy kept
        assert d._channels[0].handed == deque()
        clients[0].sendall(b"QUIT\r\n")
        assert await loop.run_in_executor(None, clients[0].recv, 64) == b""  # closed
        for _ in range(100):
            d.read_reports()
            if d.sessions() == {0: 1}:
                break
            await asyncio.sleep(0.01)
        assert d.sessions() == {0: 1}
        d.drop(0)  # the master goes: the inbox closes, the session made goes on
        for _ in range(100):
            if inbox._loop is None:
                break
            await asyncio.sleep(0.01)
        assert inbox._loop is None and lost == [None]  # told: the worker stops
        clients[1].sendall(b"QUIT\r\n")
        assert await loop.run_in_executor(None, clients[1].recv, 64) == b""
        for c in clients:
            c.close()

    asyncio.run(run())
    assert errors == []


def test_a_report_of_more_ended_sessions_than_handed_is_counted_not_hidden():
    d, _, end = _one_worker()
    end.setblocking(False)
    clients = _hand(d, 2)
    for s in _taken(end):
        s.close()
    end.send(b"3")  # a worker that miscounts: one more than it held
    assert d.read_reports() == 1 and d.sessions() == {0: 0}
    end.send(b"0")
    assert d.read_reports() == 0
    d.close()
    end.close()
    for s in clients:
        s.close()


def _descriptorless(end_buffer: socket.socket) -> None:
    """What a worker out of descriptors receives: the message, its descriptor dropped."""
    end_buffer.send(b"s")


def test_a_connection_without_its_descriptor_is_counted_ended_and_pauses_the_worker():
    """The kernel drops the descriptor of a message a worker cannot hold (EMFILE: the
    message arrives without it, MSG_CTRUNC).  That session is reported ended at once,
    the error is given, and the worker reads nothing for PAUSE so its channel fills
    and the master passes it over; then it reads again."""
    d, mine, end = _one_worker()
    errors: list[BaseException] = []

    class Hello(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.write(b"220 hi\r\n")  # type: ignore[attr-defined]

    async def run() -> None:
        loop = asyncio.get_running_loop()
        inbox = SessionInbox(end, Hello, errors.append, lambda e: None)
        inbox.PAUSE = 0.5
        inbox.start(loop)
        # the master counted the one whose descriptor is lost, and had no copy of it
        d._channels[0].sessions += 1
        d._channels[0].handed.append(None)
        _descriptorless(mine)
        (client,) = await loop.run_in_executor(None, _hand, d, 1)  # while the worker pauses
        client.settimeout(0.2)
        with pytest.raises(TimeoutError):  # not taken during the pause
            await loop.run_in_executor(None, client.recv, 64)
        d.read_reports()
        assert d.sessions() == {0: 1}  # the lost one ended, the next not taken yet
        assert len(errors) == 1 and "without a descriptor" in str(errors[0])
        assert inbox._paused is not None
        client.settimeout(5)
        assert await loop.run_in_executor(None, client.recv, 64) == b"220 hi\r\n"  # resumed
        assert inbox._paused is None
        d.read_reports()  # told: no copy of the lost one, the next one taken
        assert d._channels[0].handed == deque() and d.orphans == deque()
        inbox.close()
        client.close()

    asyncio.run(run())
    d.close()


def test_a_connection_that_came_without_its_descriptor_is_handed_on(workers):
    """A worker reports a connection that came without its descriptor (``n``, in the
    order received): the master hands its copy to another worker, whose client is
    answered, and logs why; the one reported taken (``y``) is not handed on."""
    d, theirs = workers
    clients = _hand(d, 4)  # in turn: 0, 1, 2, 0
    first, second = _taken(theirs[0])
    first.close()
    second.close()
    theirs[0].send(b"tny")  # the first came without its descriptor, the second taken
    d.read_reports()
    assert d.handed_on == [(0, 1, "the worker got it without its descriptor")]
    assert d._channels[0].handed == deque() and len(d.orphans) == 1
    orphan = d.orphans.popleft()
    with orphan:
        assert d.dispatch(orphan)
    for i in (1, 2):
        for got in _taken(theirs[i]):
            with got:
                got.sendall(b"220 worker %d\r\n" % i)
    clients[0].settimeout(5)
    assert clients[0].recv(64) in (b"220 worker 1\r\n", b"220 worker 2\r\n")
    for c in clients:
        c.close()


def test_emfile_in_the_worker_really_drops_the_descriptor_and_is_seen():
    """The same with a real EMFILE, in a child process with a descriptor limit."""
    script = r'''
import asyncio, resource, socket, sys
sys.path.insert(0, sys.argv[1])
from queue_ref.relay.session_handoff import Dispatcher, SessionInbox, channel_pair
d = Dispatcher(); mine, end = channel_pair(); d.attach(0, mine); d.set_ready(0)
errors = []
async def run():
    loop = asyncio.get_running_loop()
    inbox = SessionInbox(end, asyncio.Protocol, errors.append, lambda e: None)
    inbox.start(loop)
    client, server = socket.socketpair()
    hog = []
    while len(hog) < 100:  # every descriptor under the limit of 64 taken: EMFILE
        try:
            hog.append(socket.socket())
        except OSError:
            break
    assert d.dispatch(server)  # the master's send works: the worker cannot take it
    await asyncio.sleep(0.1)
    for s in hog:
        s.close()
    await asyncio.sleep(0.1)
    d.read_reports()
    print(d.sessions()[0], len(errors), inbox._paused is not None)
    inbox.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
asyncio.run(run())
'''
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    r = subprocess.run([sys.executable, "-c", script, root], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1", "True"], r.stdout


class _Bye(asyncio.Protocol):
    """A session of a stopping relay: its 421, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"421 closing\r\n")  # type: ignore[attr-defined]
        transport.close()


async def _heard(clients: list[socket.socket],
                 read: Callable[[socket.socket], bytes]) -> list[bytes]:
    """What each client read (``read``, in a thread, 10 s at most), each then closed."""
    loop = asyncio.get_running_loop()
    heard = []
    for c in clients:
        c.settimeout(10)
        heard.append(await loop.run_in_executor(None, read, c))
        c.close()
    return heard


def test_drain_takes_what_the_channel_holds_before_it_closes():
    """A worker that stops takes the connections still in its channel (they get the
    stopping relay's 421 as sessions); closing the channel instead would drop them."""
    d, _, end = _one_worker()

    async def run() -> list[bytes]:
        inbox = SessionInbox(end, _Bye, lambda e: None, lambda e: None)
        clients = _hand(d, 3)  # in the channel; the inbox has not read (not started)
        inbox.drain()
        assert end.fileno() == -1  # closed once drained
        late, server = socket.socketpair()
        with late, server:  # handed over after the drain: refused, for another worker
            assert not d.dispatch(server)
        return await _heard(clients, lambda c: c.recv(64))

    assert asyncio.run(run()) == [b"421 closing\r\n"] * 3
    d.close()


def test_drain_goes_past_a_connection_that_came_without_its_descriptor():
    """A stopping worker's channel holds a connection, then one whose descriptor the
    kernel dropped, then two more: all three that came whole get the 421, the lost one is
    counted ended and said, and the channel's end is not taken for a lost master."""
    d, mine, end = _one_worker()
    errors: list[BaseException] = []
    lost: list[BaseException | None] = []

    async def run() -> list[bytes]:
        inbox = SessionInbox(end, _Bye, errors.append, lost.append)
        clients = _hand(d, 1)
        # the master counted the one whose descriptor is lost, and had no copy of it
        d._channels[0].sessions += 1
        d._channels[0].handed.append(None)
        _descriptorless(mine)
        clients += _hand(d, 2)
        inbox.drain()
        assert inbox._paused is None and end.fileno() == -1
        return await _heard(clients, lambda c: c.recv(64))

    assert asyncio.run(run()) == [b"421 closing\r\n"] * 3
    assert len(errors) == 1 and "without a descriptor" in str(errors[0])
    assert "not reading" not in str(errors[0]) and lost == []
    d.read_reports()
    assert d.sessions() == {0: 3}  # the lost one reported ended; three sessions made
    assert d._channels[0].handed == deque()  # each reported on, in order
    d.close()


# ---- a relay worker's inbox: the real Relay over a real queue -------------------------


def _worker_relay(tmp_path: Path, end: socket.socket) -> tuple[Relay, list[str]]:
    lines: list[str] = []
    relay = Relay(relay_config(str(tmp_path / "q"), log_json=True), worker=0, handoff=end,
                  log_stream=_ListStream(lines))
    return relay, lines


def test_a_stopping_worker_gives_the_421_to_what_its_channel_holds(tmp_path: Path) -> None:
    """Connections in a worker's channel when it stops, not read yet: ``Relay.stop``
    takes them (``drain``), so each client hears the 421 of a stopping relay.  Closing
    the channel instead would drop them with their clients hearing nothing."""
    d, _, end = _one_worker()

    async def run() -> list[bytes]:
        relay, _ = _worker_relay(tmp_path, end)
        await relay.start()
        clients = _hand(d, 3)  # in the channel; the loop does not run before stop drains
        await relay.stop()
        d.read_reports()  # the drain said it took them: the master's copies go
        return await _heard(clients, _read_to_end)

    heard = asyncio.run(run())
    assert all(b"\r\n421 4.3.2 " in b"\r\n" + h for h in heard), heard
    d.close()


def test_a_worker_whose_master_closes_the_channel_stops(tmp_path: Path) -> None:
    """The channel's end (the master gone) means no connection will come: the worker
    logs it and asks itself to stop, as SIGTERM would."""
    d, _, end = _one_worker()

    async def run() -> list[str]:
        relay, lines = _worker_relay(tmp_path, end)
        await relay.start()
        assert relay._stop_requested is not None and not relay._stop_requested.is_set()
        assert not relay.channel_lost
        d.drop(0)
        await asyncio.wait_for(relay._stop_requested.wait(), 10)
        await relay.stop()
        assert relay.channel_lost  # the worker exits CHANNEL_LOST: the master logs a death
        return lines

    records = [json.loads(line) for line in asyncio.run(run())]
    said = [r for r in records if r.get("what") == "the channel from the master"]
    assert len(said) == 1 and said[0]["reason"] == "closed: stopping", said


def _read_to_end(c: socket.socket) -> bytes:
    out = b""
    while chunk := c.recv(4096):
        out += chunk
    return out


def test_an_etrn_is_passed_to_every_other_worker_and_one_not_sent_is_noted(workers):
    """Workers that each serve one root of the queue: an ETRN one of them took goes to
    the others (their roots may hold the domain's mail), not back to it; a worker whose
    channel is full is noted for the master to log, and the others still get it."""
    d, theirs = workers
    inbox = SessionInbox(theirs[0], asyncio.Protocol, lambda e: None, lambda e: None)
    assert inbox.send_etrn("example.net")
    d.read_reports()
    got = [end.recv(1024) for end in theirs[1:]]
    assert got == [b"e:example.net"] * 2 and d.unsent_etrn == []
    with pytest.raises(BlockingIOError):
        theirs[0].recv(1024)
    while True:  # fill worker 2's channel
        try:
            d._channels[2].sock.send(b"0")
        except BlockingIOError:
            break
    assert inbox.send_etrn("bücher.example")
    d.read_reports()
    assert theirs[1].recv(1024) == "e:bücher.example".encode()
    assert d.unsent_etrn == [(2, "bücher.example")]


def test_the_inbox_hands_an_etrn_from_another_worker_on_and_ignores_it_while_draining():
    d, mine, end = _one_worker()
    asked: list[str] = []

    async def run() -> None:
        inbox = SessionInbox(end, asyncio.Protocol, lambda e: None, lambda e: None,
                             asked.append)
        inbox.start(asyncio.get_running_loop())
        mine.send(b"e:example.net")
        for _ in range(100):
            if asked:
                break
            await asyncio.sleep(0.01)
        assert asked == ["example.net"]
        mine.send(b"e:example.org")
        inbox.drain()  # the worker stops: its flush would come too late
        assert asked == ["example.net"]

    asyncio.run(run())
    d.close()


def test_an_etrn_for_a_worker_being_started_again_waits_for_its_successor(workers):
    """Worker 1 died (its channel dropped) and worker 2 is stopping (its end closed) when
    worker 0 passes on an ETRN: each one's successor finds it in its new channel, once,
    however often it was passed on meanwhile."""
    d, theirs = workers
    d.drop(1)
    theirs[2].close()
    d.read_reports()  # the master sees worker 2's end closed
    inbox = SessionInbox(theirs[0], asyncio.Protocol, lambda e: None, lambda e: None)
    for _ in range(2):
        assert inbox.send_etrn("example.net")
        d.read_reports()
    assert d.unsent_etrn == []
    for i in (1, 2):
        mine, end = channel_pair()
        d.attach(i, mine)
        end.setblocking(False)
        assert end.recv(1024) == b"e:example.net"
        with pytest.raises(BlockingIOError):
            end.recv(1024)
        theirs[i].close()
        theirs[i] = end


def test_connections_a_dead_worker_did_not_take_are_handed_on(workers):
    """Worker 0 takes the first of its two connections, says so and answers it, then
    dies with the second unread: the master finds the second among its orphans (not the
    first), hands it to another worker, and that client is answered by it."""
    d, theirs = workers
    clients = _hand(d, 6)  # in turn: 0, 1, 2, 0, 1, 2
    msg, fds, _, _ = socket.recv_fds(theirs[0], 16, 4)
    assert msg == b"s" and len(fds) == 1
    theirs[0].send(b"ty")
    with socket.socket(fileno=fds[0]) as took:
        took.sendall(b"220 worker 0\r\n")
    assert clients[0].recv(64) == b"220 worker 0\r\n"
    theirs[0].close()  # it dies: the kernel drops what its channel held
    d.drop(0)
    assert len(d.orphans) == 1
    assert d.handed_on == [(0, 1, "the worker stopped before it took them")]
    orphan = d.orphans.popleft()
    with orphan:
        assert d.dispatch(orphan)
    assert sorted(d.sessions().values()) == [2, 3]
    for i in (1, 2):
        for got in _taken(theirs[i]):
            with got:
                got.sendall(b"220 worker %d\r\n" % i)
    assert clients[3].recv(64) in (b"220 worker 1\r\n", b"220 worker 2\r\n")
    clients[0].settimeout(5)
    assert clients[0].recv(64) == b""  # the one it took went with it: closed, not handed on
    for c in clients:
        c.close()


def test_a_connection_is_answered_only_once_the_master_was_told_it_was_taken():
    """The worker's side of the channel is full when a connection comes: the session is
    not made (no greeting) until the worker could say it took it; then it is."""
    d, _, end = _one_worker()
    greeted: list[int] = []

    class Greet(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            greeted.append(1)
            transport.write(b"220 ready\r\n")  # type: ignore[attr-defined]

    inbox = SessionInbox(end, Greet, lambda e: None, lambda e: None)
    end.setblocking(False)
    filled = _fill(end)  # the master does not read: the worker's side fills up

    async def run() -> bytes:
        loop = asyncio.get_running_loop()
        inbox.start(loop)
        [client] = await loop.run_in_executor(None, _hand, d, 1)
        await asyncio.sleep(0.3)
        assert greeted == [] and d._channels[0].handed  # received, not told, not answered
        d.read_reports()  # the master reads: room again, the worker tells it
        for _ in range(100):
            if greeted:
                break
            await asyncio.sleep(0.01)
        client.settimeout(5)
        heard: bytes = await loop.run_in_executor(None, client.recv, 64)
        d.read_reports()
        assert d._channels[0].handed == deque()
        client.close()
        return heard

    assert asyncio.run(run()) == b"220 ready\r\n" and filled > 0
    inbox.close()
    d.close()
