"""Worked examples of backends put through the suite.

* ``sqlite_backend``: a Storage on the standard library's sqlite3, as an outsider
  would write one.
* ``peers``: re-creations of real queues' on-disk protocols, which the suite rejects.
"""
