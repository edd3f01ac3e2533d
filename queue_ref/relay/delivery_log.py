"""The relay's log: one record per event, as a Postfix-style line or a JSON object.

Every record has ``ts`` (ISO 8601, UTC), ``event`` and ``queue_id`` (the message id the
250 reply named), and the process id that wrote it (``pid`` in JSON, ``relay[PID]`` in
text: the workers of ``--processes`` and their master write to one log).  The events
and their fields are documented in ``docs/relay.md``:

* ``received``  from, size, nrcpt, client, helo
* ``delivery``  to, relay, delay, attempts, dsn, status (sent | deferred | bounced |
  expired), reason, entry_id
* ``bounce``    the DSN message enqueued for failed recipients (bounce_id, to, nrcpt),
  or ``dropped`` when the failed message was itself a bounce
* ``delayed``   a delay warning enqueued (bounce_id, to)
* ``relay``     the process starting or stopping (what, and details)
* ``error``     a queue operation that failed (what, reason)
* ``warning``   a setting that is valid but likely wrong, at start (what)
* ``etrn``      an ETRN that reached the queue (domain, status, entries, client)
* ``reject``    a 4xx or 5xx reply to a client (client, helo, from, reply)
* ``timeout``   a client silent for ``smtpd_timeout`` (client, after, seconds)
* ``tls``       a TLS session: direction (in, out), client or server, version, cipher,
  bits
* ``operator``  an entry an operator command changed (action, entry_id, result, user),
  written by ``queue-ref/ACTION[pid]`` when the command was given the relay's config

The text line reads like Postfix's ``smtp[pid]: QUEUEID: to=<a@b>, relay=h[ip]:25,
delay=1.2, dsn=2.0.0, status=sent (250 2.0.0 Ok)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

__all__ = ["DeliveryLog", "LogStream"]


class LogStream(Protocol):
    """Where log lines go: any text stream."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...

_FIRST = ("queue_id", "to", "from", "relay", "delay", "attempts", "dsn", "status")


class DeliveryLog:
    """Writes records to a stream (standard error by default), line-buffered, thread-safe."""

    def __init__(self, json_lines: bool = False, path: str = "",
                 stream: LogStream | None = None, program: str = "queue-ref/relay") -> None:
        self.json_lines = json_lines
        self.program = program  # who writes: the text line's head, ``program`` in JSON
        self._own = False
        if stream is not None:
            self._stream = stream
        elif path:
            # a reply's bytes that are not UTF-8 reach records as surrogates: escaped
            self._file = open(path, "a", encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                              buffering=1)
            self._stream = self._file
            self._own = True
        else:
            self._stream = sys.stderr
        self._lock = threading.Lock()
        self._failing = False  # the last write to the log file failed (said once)
        self._pid = os.getpid()
        self._batches = threading.local()  # .lines: this thread's batch, if one is open

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Hold this thread's records until the block ends, then write them at once: a
        job's hundred outcome lines cost one write, not a hundred (Postfix's smtp logs
        each recipient, and each line is a syslog call).  The records are written when
        the block ends by an exception too; other threads' records are never held, and
        never land among a batch's.  Nested blocks join the outer one."""
        if getattr(self._batches, "lines", None) is not None:
            yield
            return
        lines: list[str] = []
        self._batches.lines = lines
        try:
            yield
        finally:
            self._batches.lines = None
            if lines:
                self._write("".join(lines))

    def emit(self, event: str, queue_id: str = "", **fields: Any) -> None:
        now = time.time()
        record: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z",
            "event": event, "queue_id": queue_id}
        record.update({k: v for k, v in fields.items() if v is not None})
        if self.json_lines:
            record["pid"] = self._pid  # the text line has it in its head
            if self.program != "queue-ref/relay":  # an operator command's record
                record["program"] = self.program
            # UTF-8 addresses as they are (``grep``), not as \u escapes
            line = json.dumps(record, sort_keys=False, ensure_ascii=False)
        else:
            line = self.text(record)
        held = getattr(self._batches, "lines", None)
        if held is not None:
            held.append(line + "\n")
        else:
            self._write(line + "\n")

    def _write(self, text: str) -> None:
        with self._lock:
            try:
                try:
                    self._stream.write(text)
                except UnicodeEncodeError:  # a stream that cannot take a reply's bytes:
                    # escaped, so that one record does not cost a batch its other lines
                    self._stream.write(text.encode("ascii", "backslashreplace").decode("ascii"))
                self._stream.flush()
                self._failing = False
            except (OSError, ValueError) as e:  # a broken log must not stop mail: said
                if self._own and not self._failing:  # once on standard error, each time
                    self._failing = True              # it breaks again
                    with contextlib.suppress(OSError, ValueError):
                        print(f"queue-ref: the log file {self._file.name} cannot be written "
                              f"to ({e}): its records are lost until it can",
                              file=sys.stderr, flush=True)

    def text(self, r: dict[str, Any]) -> str:
        """The Postfix-style line of a record."""
        head = f"{r['ts']} {self.program}[{self._pid}]: "
        if r["queue_id"]:
            head += f"{r['queue_id']}: "
        parts = []
        reason = r.get("reason")
        keys = [k for k in _FIRST if k in r and k != "queue_id"]
        keys += [k for k in r if k not in _FIRST and k not in ("ts", "event", "reason")]
        if r["event"] not in ("delivery",):
            parts.append(r["event"])
        for k in keys:
            v = r[k]
            if k in ("to", "from"):
                parts.append(f"{k}=<{v}>")
            elif k == "status":
                parts.append(f"status={v}" + (f" ({reason})" if reason else ""))
                reason = None
            elif isinstance(v, float):
                parts.append(f"{k}={v:.2f}")
            else:
                parts.append(f"{k}={v}")
        line = head + ", ".join(parts)
        if reason:
            line += f" ({reason})"
        return line

    def close(self) -> None:
        if self._own:
            with contextlib.suppress(OSError):  # what it held is lost, and was said
                self._file.close()
