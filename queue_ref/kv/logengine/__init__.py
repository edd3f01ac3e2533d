"""The log-structured KV engine in Python (every disk call through ``queue_ref.io``).

Modules: ``format`` (file names, log record and manifest encodings), ``wal`` (the log),
``memtable``, ``table`` (sorted table files), ``merge`` (merging and compaction policy),
``groupcommit`` (the writer queue), ``engine`` (``LogEngine``: recovery, writes, reads).
"""

from queue_ref.kv.logengine.engine import LogEngine, RecoveryStats

__all__ = ["LogEngine", "RecoveryStats"]
