"""``session_handoff``: the master hands accepted connections to the worker holding the
fewest sessions, over real SOCK_SEQPACKET pairs with real descriptors.

The whole path through ``queue-ref relay --processes N`` is in test_relay_processes.py;
here each rule is made to happen: ties taken in turn, ended sessions counted back, a
worker that is not ready, gone or closed passed over, a report held back by a full
channel sent with the next one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import pytest

from queue_ref.relay.session_handoff import Dispatcher, SessionInbox, channel_pair


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
    for i in range(3):
        d.drop(i)
    for end in theirs:
        end.close()


def _hand(d: Dispatcher, n: int) -> list[socket.socket]:
    """Dispatch ``n`` connections (one end of a pair each); the client ends."""
    clients = []
    for _ in range(n):
        client, server = socket.socketpair()
        with server:
            assert d.dispatch(server)
        clients.append(client)
    return clients


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
    assert all(s.fileno() != mine.fileno() for s in d.sockets())
    d.drop(0)
    client, server = socket.socketpair()
    with client, server:
        assert not d.dispatch(server) and not d.any_ready()
    for s in clients:
        s.close()


def test_a_report_held_back_by_a_full_channel_goes_with_the_next():
    d = Dispatcher()
    mine, end = channel_pair()
    d.attach(0, mine)
    d.set_ready(0)
    clients = _hand(d, 5)
    inbox = SessionInbox(end, asyncio.Protocol, lambda e: None)
    for fd in _taken(end):
        fd.close()
    filled = 0
    while True:  # the master does not read: the worker's side fills up
        try:
            end.send(b"0")
            filled += 1
        except BlockingIOError:
            break
    inbox.ended()
    inbox.ended()  # both held back
    d.read_reports()  # the master reads the zeros: room again
    assert d.sessions() == {0: 5} and filled > 0
    inbox.ended()  # this one says three
    d.read_reports()
    assert d.sessions() == {0: 2}
    inbox.close()
    d.drop(0)
    for s in clients:
        s.close()


def test_the_inbox_makes_sessions_and_reports_their_end():
    d = Dispatcher()
    mine, end = channel_pair()
    d.attach(0, mine)
    d.set_ready(0)
    errors: list[BaseException] = []

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport
            transport.write(b"220 ready\r\n")  # type: ignore[attr-defined]

        def data_received(self, data: bytes) -> None:
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            inbox.ended()

    inbox = SessionInbox(end, Echo, errors.append)

    async def run() -> None:
        loop = asyncio.get_running_loop()
        inbox.start(loop)
        clients = await loop.run_in_executor(None, _hand, d, 2)
        for c in clients:
            c.settimeout(5)
            assert await loop.run_in_executor(None, c.recv, 64) == b"220 ready\r\n"
        assert d.sessions() == {0: 2}
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
        assert inbox._loop is None
        clients[1].sendall(b"QUIT\r\n")
        assert await loop.run_in_executor(None, clients[1].recv, 64) == b""
        for c in clients:
            c.close()

    asyncio.run(run())
    assert errors == []
