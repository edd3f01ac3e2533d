"""SMTP connections the master accepts and hands to the worker with the fewest sessions
(``processes = N``, ``relay_master``).

Why not SO_REUSEPORT (each worker listening on the port, as before 2026-11-29): the kernel
picks a worker by a hash of the connection's addresses and ports, not by load.  Five
sessions of ``smtp-source`` from one host landed on one worker in 3 runs of 5, which then
served all of them while the other idled: 42 messages of 100 recipients a second against
64-66 when they were spread 3 to 2 (``benchmarks/relay.py --scenario wide``).

The master accepts and sends each connection's descriptor to a worker over a
``SOCK_SEQPACKET`` pair (``SCM_RIGHTS``), one message per connection, and keeps a copy
of the descriptor until the worker says what became of it: ``t`` and one octet per
connection message, in the order received, ``y`` for one it took (sent before any of
them is answered) and ``n`` for one that came without its descriptor; the worker
sends a message back for each session that ended (the number of sessions, ASCII
digits), so the master knows how many each holds.  It picks the ready worker holding
the fewest, the next in turn among equals.
Workers that each serve one root of a KV queue also pass ETRNs over it (``e:`` and the
domain): a worker sends one to the master, which sends it to every other worker (held
for a worker being started again).

What holds after a failure:

* a worker that dies before it said it took a connection has not answered it: the
  master reads what the dead worker's channel still holds (its last reports) and hands
  each connection it did not take to another worker (``orphans``), whose client is
  greeted as if nothing happened (until 2026-11-29 they were closed unanswered).  A
  connection it took goes with it.  The master forgets its count and sends it nothing
  until its successor is ready.  A worker that stops takes what its channel holds
  first, and those sessions get the 421 of a stopping relay like the others (one it
  cannot say it took, its channel full, it closes unanswered, and the master hands it
  on);
* a worker that cannot take more (its channel full) is passed over; a connection no
  worker can take waits in the master (``dispatch`` returns False), which stops
  accepting until one can: the rest wait in the kernel's accept queue, as before;
* a worker out of descriptors gets the message without its descriptor (the kernel drops
  it, ``MSG_CTRUNC``): the master hands that connection to another worker from its copy
  (closed unanswered if the master had none: itself out of descriptors); the worker
  counts the session as ended, logs it and stops reading its channel for a second, so
  that the channel fills and the master passes it over;
* a worker whose channel fails or closes stops (``on_lost``), and the master starts
  another; a master that dies closes the channels (and its workers die with it,
  ``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from collections import deque
from collections.abc import Callable

__all__ = ["Dispatcher", "SessionInbox", "channel_pair"]

_TAKE = b"s"  # the byte that carries a connection's descriptor
_TAKEN = b"t"  # what became of connections: ``t``, then ``y`` or ``n`` for each one
_YES, _NO = ord("y"), ord("n")
_FLAGS = 1000  # connections reported at most in one message (``_MAX_MESSAGE``)
#: a send error by which the master is gone (not a full or short-of-memory channel)
_GONE = (errno.EPIPE, errno.ECONNRESET, errno.ENOTCONN, errno.EBADF)
#: the start of an ETRN passed between workers that each serve one root of the queue:
#: ``e:`` and the domain (UTF-8), from a worker to the master, which sends it on to the
#: other workers
_ETRN = b"e:"
_MAX_MESSAGE = 1024  # a domain is at most 255 octets
HELD_ETRN = 256  # ETRNs (distinct domains) held at most for a worker being started again


def _domain(msg: bytes) -> str:
    return msg[len(_ETRN):].decode("utf-8", "replace")


def channel_pair() -> tuple[socket.socket, socket.socket]:
    """(the master's end, the worker's end): a SOCK_SEQPACKET pair, each message one
    connection handed over, one count of sessions ended, or one ETRN passed on."""
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mine.setblocking(False)
    return mine, theirs


class _Channel:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sessions = 0  # handed to the worker and not yet reported ended
        self.ready = False
        self.closed = False  # the worker closed its end: nothing more to read
        #: copies of the connections handed over and not yet reported on, in the order
        #: sent (None: the master had no descriptor to spare for a copy)
        self.handed: deque[socket.socket | None] = deque()


class Dispatcher:
    """The master's side: one channel per worker index."""

    def __init__(self) -> None:
        self._channels: dict[int, _Channel] = {}
        self._turn = 0
        #: (worker, domain) of ETRNs that could not be passed on (the master logs them)
        self.unsent_etrn: list[tuple[int, str]] = []
        #: ETRNs for a worker index with no live channel, sent to its successor
        self._held: dict[int, list[bytes]] = {}
        #: connections a worker did not take (it died or stopped first, or got them
        #: without their descriptor): the master hands them on (``dispatch``) and closes
        #: its own descriptor
        self.orphans: deque[socket.socket] = deque()
        #: (worker, connections, why) of each time connections became orphans, for the
        #: master's log
        self.handed_on: list[tuple[int, int, str]] = []

    def attach(self, index: int, sock: socket.socket) -> None:
        """A new worker at ``index`` (its predecessor's channel dropped): not ready yet.
        The ETRNs passed on while there was none at ``index`` wait in its channel."""
        self.drop(index)
        self._channels[index] = _Channel(sock)
        for msg in self._held.pop(index, []):
            self._send_etrn(index, sock, msg)

    def drop(self, index: int) -> None:
        """The worker at ``index`` died or stopped: what its channel still holds is read
        (it said it took connections just before it died), the connections it did not
        take become ``orphans``, its channel is closed and its count gone; ETRNs for it
        are held for its successor."""
        ch = self._channels.pop(index, None)
        if ch is not None:
            self._read(index, ch)
            self._hand_on(index, [c for c in ch.handed if c is not None],
                          "the worker stopped before it took them")
            ch.handed.clear()
            ch.sock.close()
            self._held.setdefault(index, [])

    def _hand_on(self, index: int, conns: list[socket.socket], why: str) -> None:
        if conns:
            self.orphans.extend(conns)
            self.handed_on.append((index, len(conns), why))

    def set_ready(self, index: int) -> None:
        ch = self._channels.get(index)
        if ch is not None and not ch.closed:  # a channel seen closed stays passed over
            ch.ready = True

    def any_ready(self) -> bool:
        return any(ch.ready for ch in self._channels.values())

    def sockets(self) -> list[socket.socket]:
        """The channels to wait on for reports."""
        return [ch.sock for ch in self._channels.values() if not ch.closed]

    def sessions(self) -> dict[int, int]:
        """Sessions each worker holds, as the master counts them."""
        return {i: ch.sessions for i, ch in sorted(self._channels.items())}

    def read_reports(self) -> int:
        """Take every report waiting: each names how many sessions ended.  Returns how
        many ended sessions were reported beyond those handed over (0 unless a worker
        miscounts; the master logs it)."""
        return sum(self._read(index, ch) for index, ch in list(self._channels.items()))

    def _read(self, index: int, ch: _Channel) -> int:
        """Take the reports waiting on one channel (``read_reports``)."""
        excess = 0
        reset = False
        while not ch.closed:
            try:
                msg = ch.sock.recv(_MAX_MESSAGE)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionResetError:
                # the worker died with messages unread in its end: the kernel says so
                # once, before what the worker sent last (which is still read)
                if reset:
                    msg = b""
                else:
                    reset = True
                    continue
            except OSError:
                msg = b""  # the worker is gone: the supervisor drops its channel
            if not msg:  # its end closed (it stops): it takes no more
                ch.closed, ch.ready = True, False
                break
            if msg.startswith(_ETRN):
                self._pass_on(index, msg)
            elif msg.startswith(_TAKEN):
                lost = []
                for flag in msg[1:len(ch.handed) + 1]:
                    copy = ch.handed.popleft()
                    if copy is None:
                        continue
                    if flag == _YES:
                        copy.close()
                    else:
                        lost.append(copy)
                self._hand_on(index, lost, "the worker got it without its descriptor")
            elif msg.isdigit():
                ch.sessions -= int(msg)
                if ch.sessions < 0:
                    excess, ch.sessions = excess - ch.sessions, 0
        return excess

    def _pass_on(self, sender: int, msg: bytes) -> None:
        """An ETRN from worker ``sender`` to every other worker.  One that is stopping or
        gone (a successor to come) has it held for its successor (``attach``); one whose
        channel is full is noted in ``unsent_etrn`` (its mail goes at its own time)."""
        for i in sorted({*self._channels, *self._held} - {sender}):
            ch = self._channels.get(i)
            if ch is None or ch.closed:
                held = self._held.setdefault(i, [])
                if msg not in held and len(held) < HELD_ETRN:
                    held.append(msg)
                elif msg not in held:
                    self.unsent_etrn.append((i, _domain(msg)))
                continue
            self._send_etrn(i, ch.sock, msg)

    def _send_etrn(self, index: int, sock: socket.socket, msg: bytes) -> None:
        try:
            sock.send(msg)
        except OSError:
            self.unsent_etrn.append((index, _domain(msg)))

    def dispatch(self, conn: socket.socket) -> bool:
        """Send ``conn`` to the ready worker holding the fewest sessions (the next in turn
        among equals; another if that one cannot take it).  The caller closes ``conn``
        either way: the worker has its own descriptor.  False if no worker took it."""
        ready = sorted(i for i, ch in self._channels.items() if ch.ready)
        if not ready:
            return False
        start = self._turn % len(ready)
        order = ready[start:] + ready[:start]
        order.sort(key=lambda i: self._channels[i].sessions)  # stable: the turn among equals
        try:
            copy: socket.socket | None = conn.dup()
        except OSError:  # out of descriptors: handed over without a copy to hand on
            copy = None
        for i in order:
            ch = self._channels[i]
            try:
                socket.send_fds(ch.sock, [_TAKE], [conn.fileno()])
            except OSError:  # full (BlockingIOError) or the worker is gone
                continue
            ch.sessions += 1
            ch.handed.append(copy)
            self._turn = ready.index(i) + 1
            return True
        if copy is not None:
            copy.close()
        return False

    def close(self) -> None:
        """Drop every channel and close the orphans (the relay stops)."""
        for index in list(self._channels):
            self.drop(index)
        while self.orphans:
            self.orphans.popleft().close()
        self.handed_on.clear()


class SessionInbox:
    """The worker's side: connections from the master become sessions
    (``loop.connect_accepted_socket`` with the receiver's protocol), and each session's
    end is reported (``ended``)."""

    #: how long a worker that got a message without its descriptor stops reading
    PAUSE = 1.0

    def __init__(self, sock: socket.socket, protocol: Callable[[], asyncio.Protocol],
                 on_error: Callable[[BaseException], None],
                 on_lost: Callable[[BaseException | None], None],
                 on_etrn: Callable[[str], None] | None = None) -> None:
        """``on_error``: a connection could not become a session (the others go on);
        ``on_lost``: the channel failed (its error) or the master closed it (None): no
        more connections will come, the worker should stop; ``on_etrn``: another worker
        asks this one to flush a domain (``send_etrn``)."""
        self._sock = sock
        self._sock.setblocking(False)
        self._protocol = protocol
        self._on_error = on_error
        self._on_lost = on_lost
        self._on_etrn = on_etrn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._paused: asyncio.TimerHandle | None = None
        self._unsent = 0  # ended sessions not yet reported (the channel was full)
        self._tasks: set[asyncio.Task[None]] = set()
        #: connections received and not yet said taken (the channel was full): they
        #: become sessions once the master has been told
        self._untold: list[socket.socket] = []
        #: what to tell the master of each connection message received, in order:
        #: ``_YES`` (one of ``_untold``) or ``_NO`` (it came without its descriptor)
        self._flags = bytearray()
        self._writing = False  # waiting for room in the channel to tell it
        self._retry: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._sock.fileno(), self._take)

    def _take(self, *, draining: bool = False) -> None:
        """Make a session of every connection the channel holds.  A message without its
        descriptor pauses reading (see ``PAUSE``), except while ``draining``: then the
        connections behind it are taken too, and the end of the channel is no loss."""
        loop = self._loop or asyncio.get_running_loop()
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self._sock, _MAX_MESSAGE, 4,
                                                 socket.MSG_CMSG_CLOEXEC)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if not draining:
                    self.close()
                    self._on_lost(e)
                return
            if not msg and not fds:  # the master closed its end (or the drain shut it)
                if not draining:
                    self.close()
                    self._on_lost(None)
                return
            if msg.startswith(_ETRN):
                for fd in fds:  # none is sent with it
                    os.close(fd)
                if not draining and self._on_etrn is not None:
                    self._on_etrn(msg[len(_ETRN):].decode("utf-8", "replace"))
                continue
            for fd in fds:
                conn = socket.socket(fileno=fd)
                conn.setblocking(False)
                self._untold.append(conn)
            missing = msg.count(_TAKE) - len(fds)
            self._flags += bytes([_YES]) * len(fds) + bytes([_NO]) * max(missing, 0)
            self._tell_taken(loop)
            if missing > 0:  # out of descriptors: the kernel dropped them
                for _ in range(missing):
                    self.ended()
                self._on_error(OSError(
                    f"{missing} connection(s) from the master came without a descriptor "
                    f"(out of file descriptors?): the master hands them to another worker"
                    + ("" if draining else f"; not reading the channel for {self.PAUSE:g} s")))
                if draining:
                    continue
                loop.remove_reader(self._sock.fileno())
                self._paused = loop.call_later(self.PAUSE, self._resume)
                return

    def _tell_taken(self, loop: asyncio.AbstractEventLoop) -> None:
        """Tell the master what became of the connections received (``_flags``), then
        make those taken sessions: none is answered before the master knows (else, were
        this worker to die, the master would hand an answered connection to another).
        A full channel defers both until it has room (``add_writer``), another failure
        to send until a moment later; a master that is gone (its copies with it) leaves
        them to this worker."""
        self._retry = None
        while self._flags:
            told = bytes(self._flags[:_FLAGS])
            try:
                self._sock.send(_TAKEN + told)
            except (BlockingIOError, InterruptedError):
                if not self._writing:
                    loop.add_writer(self._sock.fileno(), self._tell_taken, loop)
                    self._writing = True
                return
            except OSError as e:
                if e.errno not in _GONE:  # ENOBUFS, ENOMEM: try again a moment later
                    self._retry = loop.call_later(0.1, self._tell_taken, loop)
                    return
                told = bytes(self._flags)  # the master is gone: answer them all
            del self._flags[:len(told)]
            taken = told.count(_YES)
            conns, self._untold = self._untold[:taken], self._untold[taken:]
            for conn in conns:
                task = loop.create_task(self._serve(conn))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self._writing:
            self._writing = False
            with contextlib.suppress(Exception):
                loop.remove_writer(self._sock.fileno())

    def _resume(self) -> None:
        self._paused = None
        if self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._take)
            self._take()

    def drain(self) -> None:
        """Take every connection the channel holds (the worker stops: they become
        sessions that get its 421), then close it."""
        # no more: the master's next send fails (EPIPE) and goes to another worker, while
        # what the channel holds can still be read
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RD)
        self._take(draining=True)
        self.close()

    async def _serve(self, conn: socket.socket) -> None:
        try:
            await asyncio.get_running_loop().connect_accepted_socket(self._protocol,
                                                                     sock=conn)
        except Exception as e:  # no session was made: none will end
            conn.close()
            self.ended()
            self._on_error(e)

    def send_etrn(self, domain: str) -> bool:
        """Ask the master to have every other worker flush ``domain`` (their roots of the
        queue may hold its mail); False if the channel is full or gone."""
        try:
            self._sock.send(_ETRN + domain.encode("utf-8"))
        except OSError:
            return False
        return True

    def ended(self) -> None:
        """One session handed over by the master has ended: tell it (now, or with the next
        report when its channel is full)."""
        self._unsent += 1
        try:
            self._sock.send(str(self._unsent).encode())
        except (BlockingIOError, InterruptedError):
            return  # sent with the next one
        except OSError:
            return  # the master is gone
        self._unsent = 0

    def close(self) -> None:
        """Take no more connections (the sessions already made go on).  Those received
        and not yet said taken are closed unanswered: the master hands them on."""
        if self._paused is not None:
            self._paused.cancel()
            self._paused = None
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
            if self._writing:
                with contextlib.suppress(Exception):
                    self._loop.remove_writer(self._sock.fileno())
            self._loop = None
        self._writing = False
        for conn in self._untold:
            conn.close()
        self._untold = []
        self._flags.clear()
        self._sock.close()
