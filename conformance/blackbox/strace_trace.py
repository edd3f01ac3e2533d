"""Read the output of ``strace -f -y -tt -xx`` into system calls with exact arguments.

The tracer is run as ``strace -f -y -tt -xx -s N -o FILE -e trace=...`` (see
``STRACE_OPTIONS`` and ``TRACED_CALLS``):

* ``-f``: every line starts with the pid of the thread that made the call;
* ``-y``: a file descriptor is printed with the path it refers to, ``3</dir/file>``
  (``(deleted)`` follows when the file was unlinked meanwhile);
* ``-tt``: the wall-clock time, to the microsecond, follows the pid;
* ``-xx``: every byte of every string (paths in ``<...>`` included) is printed as
  ``\\xHH``, so data and names are exact whatever bytes they hold, and no quote or
  bracket inside a string can confuse the reader;
* ``-s N``: strings up to N bytes are printed whole; a longer one ends in ``...`` after
  its closing quote, which ``Syscall`` keeps as ``truncated`` so the caller can refuse a
  trace that lost written bytes;
* ``-e raw=read,pread64``: reads are printed without their data (only the byte count
  matters: it moves the file position).

A call that another thread interrupted is printed in two lines, ``name(args <unfinished
...>`` and later ``<... name resumed>rest``; they are joined per pid and the call is
placed where it completed.  Signals (``--- SIG... ---``) and exits (``+++ ... +++``) are
skipped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

#: The calls recorded: everything that changes files or directories under the root,
#: what makes them durable, what moves file positions, what aliases descriptors, and
#: ``mmap`` (a shared writable mapping of a file is reported: strace cannot see what is
#: written through it).
TRACED_CALLS = (
    "open", "openat", "openat2", "creat", "close", "dup", "dup2", "dup3",
    "read", "pread64", "lseek", "write", "pwrite64", "writev", "pwritev", "pwritev2",
    "truncate", "ftruncate", "fallocate", "rename", "renameat", "renameat2", "link",
    "linkat", "symlink", "symlinkat", "unlink", "unlinkat", "mkdir", "mkdirat", "rmdir",
    "fsync", "fdatasync", "syncfs", "sync", "sync_file_range", "msync", "mmap",
    "io_uring_setup", "copy_file_range", "sendfile", "splice",
)

#: Strings longer than this are cut by strace (a trace whose writes were cut is refused).
STRING_LIMIT = 16 * 1024 * 1024

STRACE_OPTIONS = ("-f", "-y", "-tt", "-xx", "-s", str(STRING_LIMIT),
                  "-e", "trace=" + ",".join(TRACED_CALLS), "-e", "raw=read,pread64")


class TraceFormatError(ValueError):
    """A line of the trace cannot be read."""


@dataclass(frozen=True)
class Fd:
    """A descriptor as ``-y`` prints it: its number and the path it refers to."""

    num: int
    path: str | None  # None for AT_FDCWD without a path, or a descriptor strace left bare
    deleted: bool = False


@dataclass(frozen=True)
class Text:
    """A quoted string: its exact bytes, and whether strace cut it (``...`` after it)."""

    data: bytes
    truncated: bool = False


Arg = Fd | Text | int | str | list[object] | dict[str, object]


@dataclass(frozen=True)
class Syscall:
    """One completed call: ``result`` is the return value (None for ``?``, the call did
    not return); ``errno`` names the error of a failed call; ``result_fd`` the path of a
    descriptor returned (``open``)."""

    pid: int
    time: str
    name: str
    args: tuple[Arg, ...]
    result: int | None
    errno: str | None
    result_path: str | None
    line: int

    @property
    def ok(self) -> bool:
        return self.errno is None and self.result is not None and self.result >= 0

    def fd(self, pos: int) -> Fd:
        a = self.args[pos]
        if not isinstance(a, Fd):
            raise TraceFormatError(f"line {self.line}: {self.name} argument {pos} is not a "
                                   f"descriptor: {a!r}")
        return a

    def text(self, pos: int) -> Text:
        a = self.args[pos]
        if not isinstance(a, Text):
            raise TraceFormatError(f"line {self.line}: {self.name} argument {pos} is not a "
                                   f"string: {a!r}")
        return a

    def path(self, pos: int) -> str:
        return self.text(pos).data.decode("utf-8", "surrogateescape")

    def number(self, pos: int) -> int:
        a = self.args[pos]
        if isinstance(a, int):
            return a
        raise TraceFormatError(f"line {self.line}: {self.name} argument {pos} is not a "
                               f"number: {a!r}")

    def flags(self, pos: int) -> set[str]:
        a = self.args[pos]
        if isinstance(a, int):
            return set() if a == 0 else {str(a)}
        if isinstance(a, str):
            return set(a.split("|"))
        raise TraceFormatError(f"line {self.line}: {self.name} argument {pos} is not a "
                               f"flag set: {a!r}")


_HEAD = re.compile(r"^(?:(?:\[pid\s+)?(\d+)\]?\s+)?(\d\d:\d\d:\d\d\.\d+)\s+(.*)$")
_CALL = re.compile(r"^([a-z_0-9]+)\((.*)$", re.S)
_RESUMED = re.compile(r"^<\.\.\. ([a-z_0-9]+) resumed>(.*)$", re.S)
_UNFINISHED = " <unfinished ...>"
_RESULT = re.compile(
    r"^(.*)\)\s+=\s+(\?|0x[0-9a-f]+|-?\d+)(?:<([^>]*)>)?(?:\(deleted\))?(.*)$", re.S)
_ERRNO = re.compile(r"^\s+([A-Z][A-Z0-9_]+)\b")
_ESCAPE = re.compile(rb"\\(x[0-9a-fA-F]{2}|[0-7]{1,3}|.)", re.S)
_SIMPLE = {b"n": b"\n", b"t": b"\t", b"r": b"\r", b"v": b"\v", b"f": b"\f", b"\\": b"\\",
           b'"': b'"', b"'": b"'", b"a": b"\a", b"b": b"\b"}


def unescape(text: str) -> bytes:
    """The bytes of a string as strace prints it (``\\xHH``, octal, C escapes)."""
    raw = text.encode("latin-1", "surrogateescape")

    def sub(m: re.Match[bytes]) -> bytes:
        esc = m.group(1)
        if esc[:1] == b"x" and len(esc) == 3:
            return bytes([int(esc[1:], 16)])
        if esc[:1].isdigit():
            return bytes([int(esc, 8) & 0xFF])
        return _SIMPLE.get(esc, esc)

    return _ESCAPE.sub(sub, raw)


class _Reader:
    """A small recursive-descent reader of strace's argument syntax."""

    def __init__(self, text: str, line: int) -> None:
        self.s = text
        self.i = 0
        self.line = line

    def fail(self, why: str) -> TraceFormatError:
        return TraceFormatError(f"line {self.line}: {why} at {self.s[self.i:self.i + 40]!r}")

    def skip_space(self) -> None:
        while self.i < len(self.s) and self.s[self.i] == " ":
            self.i += 1

    def args(self, end: str) -> list[Arg]:
        out: list[Arg] = []
        self.skip_space()
        if self.s.startswith(end, self.i):
            self.i += len(end)
            return out
        while True:
            out.append(self.value())
            self.skip_space()
            if self.s.startswith(",", self.i):
                self.i += 1
                self.skip_space()
                continue
            if self.s.startswith(end, self.i):
                self.i += len(end)
                return out
            raise self.fail(f"expected ',' or {end!r}")

    def quoted(self) -> Text:
        assert self.s[self.i] == '"'
        j = self.i + 1
        while True:
            j = self.s.find('"', j)
            if j < 0:
                raise self.fail("unterminated string")
            backslashes = 0
            k = j - 1
            while self.s[k] == "\\":
                backslashes += 1
                k -= 1
            if backslashes % 2 == 0:
                break
            j += 1
        data = unescape(self.s[self.i + 1:j])
        self.i = j + 1
        truncated = self.s.startswith("...", self.i)
        if truncated:
            self.i += 3
        return Text(data, truncated)

    def value(self) -> Arg:
        self.skip_space()
        if self.i >= len(self.s):
            raise self.fail("missing value")
        c = self.s[self.i]
        if c == '"':
            return self.quoted()
        if c == "[":
            self.i += 1
            return list(self.args("]"))
        if c == "{":
            self.i += 1
            items = self.args("}")
            out: dict[str, object] = {}
            for n, item in enumerate(items):
                if isinstance(item, dict):
                    out.update(item)
                else:
                    out[str(n)] = item
            return out
        # a bare token: up to ',' ')' ']' '}' at this depth, '<...>' kept whole
        j = self.i
        while j < len(self.s) and self.s[j] not in ",)]}":
            if self.s[j] == "<":
                close = self.s.find(">", j)
                if close < 0:
                    raise self.fail("unterminated '<'")
                j = close + 1
                continue
            if self.s[j] == "=" and j > self.i:  # name=value inside a struct
                key = self.s[self.i:j]
                self.i = j + 1
                return {key: self.value()}
            if self.s[j] == "(":  # makedev(...) and the like: keep whole
                close = self.s.find(")", j)
                j = close + 1 if close >= 0 else len(self.s)
                continue
            j += 1
        token = self.s[self.i:j].strip()
        self.i = j
        return _token(token)


_FD = re.compile(r"^(-?\d+|AT_FDCWD)<(.*)>(\(deleted\))?$", re.S)


def _token(token: str) -> Arg:
    m = _FD.match(token)
    if m is not None:
        num = -100 if m.group(1) == "AT_FDCWD" else int(m.group(1))
        return Fd(num, unescape(m.group(2)).decode("utf-8", "surrogateescape"),
                  m.group(3) is not None)
    if token == "AT_FDCWD":
        return Fd(-100, None)
    if re.fullmatch(r"0[0-7]+", token):
        return int(token, 8)
    try:
        return int(token, 0)
    except ValueError:
        return token


def _parse_call(pid: int, time: str, body: str, line: int) -> Syscall | None:
    m = _CALL.match(body)
    if m is None:
        raise TraceFormatError(f"line {line}: not a system call: {body[:80]!r}")
    name, rest = m.groups()
    r = _RESULT.match(rest)
    if r is None:
        raise TraceFormatError(f"line {line}: no result in {body[:80]!r}")
    arg_text, result, result_path, tail = r.groups()
    e = _ERRNO.match(tail)
    errno = e.group(1) if e is not None else None
    reader = _Reader(arg_text + ")", line)
    args = reader.args(")")
    value: int | None = None if result == "?" else int(result, 0)
    if errno is not None and value is not None and value >= 0:
        errno = None  # e.g. "= 0 (Timeout)" or flags printed after the value
    path = (unescape(result_path).decode("utf-8", "surrogateescape")
            if result_path is not None else None)
    return Syscall(pid, time, name, tuple(args), value, errno, path, line)


def parse_lines(lines: Iterable[str]) -> Iterator[Syscall]:
    """The completed calls of a trace, in the order they completed."""
    pending: dict[int, tuple[str, str, int]] = {}  # pid -> (time, text so far, line)
    for n, raw in enumerate(lines, 1):
        text = raw.rstrip("\n")
        if not text.strip():
            continue
        m = _HEAD.match(text)
        if m is None:
            raise TraceFormatError(f"line {n}: cannot read {text[:80]!r}")
        pid, time, body = int(m.group(1) or 0), m.group(2), m.group(3)
        if body.startswith(("---", "+++")) or body.startswith("strace:"):
            continue
        resumed = _RESUMED.match(body)
        if resumed is not None:
            if pid not in pending:
                raise TraceFormatError(f"line {n}: {resumed.group(1)} resumed but never began")
            t0, start, first = pending.pop(pid)
            body = start + resumed.group(2)
            del t0, first
        if body.endswith(_UNFINISHED):
            pending[pid] = (time, body[:-len(_UNFINISHED)], n)
            continue
        if body.endswith("<detached ...>"):
            continue
        call = _parse_call(pid, time, body, n)
        if call is not None:
            yield call


def parse_file(path: str) -> list[Syscall]:
    """Every completed call recorded in the trace file ``path``."""
    with open(path, encoding="latin-1") as f:
        return list(parse_lines(f))
