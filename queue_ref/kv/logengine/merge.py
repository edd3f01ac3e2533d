"""Merging sorted sources, and the compaction policy.

Tables are kept oldest first.  A flush writes the memtable merged with the newest tables
``tables[i:]`` into one new table, where ``i`` is the smallest index whose table holds
at most twice as many entries as everything newer than it (memtable included).  So every
remaining table holds more than twice the entries of all newer ones together: entry
counts fall geometrically, there are O(log(entries / memtable)) tables, and each entry
is rewritten O(log) times.  Tombstones count as entries, so a run of deletes soon pulls
the tables holding the deleted values into a merge.  A merge that includes the oldest
table drops tombstones (nothing older can be hidden), and every merge keeps only the
newest entry of each key.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator

from queue_ref.kv.logengine.format import Op


def _tag(source: Iterator[Op], rank: int) -> Iterator[tuple[bytes, int, bytes | None]]:
    for key, value in source:
        yield key, rank, value


def merge_newest(sources: list[Iterator[Op]]) -> Iterator[Op]:
    """Each key once, with its entry from the first (newest) source that has it.

    ``sources`` are ascending by key and ordered newest first; tombstones pass through.
    """
    if len(sources) == 1:
        yield from sources[0]
        return
    last: bytes | None = None
    for key, _rank, value in heapq.merge(*(_tag(s, r) for r, s in enumerate(sources))):
        if key != last:
            last = key
            yield key, value


def drop_tombstones(entries: Iterator[Op]) -> Iterator[Op]:
    for key, value in entries:
        if value is not None:
            yield key, value


def merge_start(table_entries: list[int], memtable_entries: int) -> int:
    """Index of the oldest table to merge with the memtable (``len`` for none)."""
    newer = [0] * len(table_entries)
    acc = memtable_entries
    for i in range(len(table_entries) - 1, -1, -1):
        newer[i] = acc
        acc += table_entries[i]
    for i, count in enumerate(table_entries):
        if 2 * newer[i] >= count:
            return i
    return len(table_entries)
