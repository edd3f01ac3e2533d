"""Operating a queue: what Postfix's ``postqueue``, ``postsuper``, ``qshape`` and ``postcat``
do, on any Storage backend.

``queue_actions`` holds the library (listing with envelopes, selection by id or domain,
hold, release, delete, requeue, flush, the qshape table), used by the commands of
``operate_commands`` and by the relay's ETRN.  Every change goes through the Storage
transitions, so it is atomic, durable and safe beside a relay working on the same queue
(a filesystem queue is shared between processes; see ``open_for_operator`` for KV queues).
"""
