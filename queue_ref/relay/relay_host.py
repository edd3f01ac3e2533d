"""What the relay's extra services (the ODMR listener, the on-demand probes) see of the
relay that runs them, and the error a relay's start reports: apart from
``relay_server``, which starts those services, so that they need not import it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

__all__ = ["RelayHost", "RelayStartError"]


class RelayStartError(RuntimeError):
    """The relay could not start (queue, port, another relay); the message says why."""


class RelayHost(Protocol):
    """``relay_server.Relay`` as a service uses it (its parts typed loosely: their own
    modules import this one's users)."""

    config: Any  # RelayConfig
    executor: Any  # the storage threads
    log: Any  # DeliveryLog
    receiver: Any  # SmtpReceiver
    scheduler: Any  # DeliveryScheduler
    worker: int | None

    @property
    def store(self) -> Any: ...  # Storage

    def add_service(self, start: Callable[[Any], Awaitable[None]],
                    stop: Callable[[Any], Awaitable[None]]) -> None: ...

    def wake(self) -> None: ...
