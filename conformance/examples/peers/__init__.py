"""Re-creations of real mail queues' disk protocols, as Storage backends the suite rejects.

Each goes through the I/O seam (``Capability.IO_SEAM``), so crash exploration can see
every call it makes; ``docs/lessons.md`` walks through what the suite finds in each.

==========  =========================================================  ===============
module      protocol                                                   rejected for
==========  =========================================================  ===============
kannader    no fsync at all; one symlink per recipient as the commit   C2 (and C1)
maddy       metadata renamed in before the body is fsynced             C6
chasquid    temp, fsync, rename, but no directory fsync                C1 (and C3)
zonemta     KV queue whose every log write is unsynced                 C1
==========  =========================================================  ===============

Each module has ``factory(root, io=None)``.
"""
