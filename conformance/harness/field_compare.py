"""Field-by-field comparison of what a backend hands back with what was committed.

``==`` is not enough for a certifier: ``Schedule(1.0) == Schedule(1)``, a ``str``
subclass equals its text, and a mapping's ``==`` says nothing of its types.  Here a
schedule's time and count must be ints (not bools, not floats) of the same value and its
reason the same str, code point for code point (so the same octets of UTF-8: an NFC or
case change, a cut, a stripped CR all differ); a metadata's strings, ints and params
likewise.  Each function returns None when everything matches, else one line naming the
first field that differs, with both values.
"""

from __future__ import annotations

from collections.abc import Mapping

from queue_ref.storage import EntryMeta, Schedule

__all__ = ["meta_diff", "same_value", "schedule_diff"]


def same_value(got: object, want: object) -> bool:
    """Whether ``got`` is ``want`` byte for byte: the same type (str, bytes, int, bool...),
    the same value; mappings key by key, with keys and values compared so."""
    if isinstance(want, Mapping):
        if not isinstance(got, Mapping) or len(got) != len(want):
            return False
        return all(type(k) is str and k in want and same_value(v, want[k])
                   for k, v in got.items())
    if isinstance(want, Schedule):
        return schedule_diff(got, want) is None
    return type(got) is type(want) and got == want


def schedule_diff(got: object, want: Schedule) -> str | None:
    """None if ``got`` is a Schedule whose time, count and reason are ``want``'s exactly."""
    if not isinstance(got, Schedule):
        return f"a {type(got).__name__} {got!r}, not a Schedule"
    for name in ("at", "attempts", "reason"):
        g, w = getattr(got, name), getattr(want, name)
        if not (type(g) is type(w) and g == w):
            return f"schedule.{name} is {_shown(g)[:160]}, expected {_shown(w)[:160]}"
    return None


def _shown(v: object) -> str:
    """``v`` for a report: a str in ASCII escapes (composed and decomposed forms, which
    print alike, differ here), with its type when it is not a str."""
    return ascii(v) if type(v) is str else f"{v!r} ({type(v).__name__})"


def meta_diff(meta: object, want: Mapping[str, object]) -> str | None:
    """None if ``meta`` (an EntryMeta) has every field of ``want`` exactly; else the first
    that differs."""
    if not isinstance(meta, EntryMeta):
        return f"meta is a {type(meta).__name__}, not an EntryMeta"
    for name, value in want.items():
        got = getattr(meta, name)
        if isinstance(value, Schedule):
            d = schedule_diff(got, value)
            if d is not None:
                return f"meta.{d}"
        elif not same_value(got, value):
            return f"meta.{name} is {_shown(got)}, committed {_shown(value)}"[:600]
    return None
