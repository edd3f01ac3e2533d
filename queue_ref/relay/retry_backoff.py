"""When a deferred recipient is tried again, and when it has been in the queue too long.

Postfix's schedule by default: the delay doubles from ``minimal_backoff_time`` (300 s) up
to ``maximal_backoff_time`` (4000 s); mail older than ``maximal_queue_lifetime`` (5 days)
is bounced.  ``retry_delays`` replaces the doubling by a fixed list whose last delay
repeats (Mailismus: 15m, 30m, 2h, 4h, giving up after 72h).  Each delay is shortened by a
random fraction up to ``backoff_jitter`` so that mail deferred together spreads out.
"""

from __future__ import annotations

import random

from queue_ref.relay.relay_config import RelayConfig

__all__ = ["RetryPolicy"]


class RetryPolicy:
    def __init__(self, config: RelayConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self._rng = rng or random.Random()

    def base_delay(self, attempts: int) -> float:
        """The delay after the ``attempts``-th failed attempt (1 for the first), unjittered."""
        c = self.config
        n = max(1, attempts)
        if c.retry_delays:
            return c.retry_delays[min(n, len(c.retry_delays)) - 1]
        delay = c.minimal_backoff_time * (2 ** min(n - 1, 62))
        return float(min(delay, c.maximal_backoff_time))

    def next_try(self, now: float, attempts: int) -> int:
        """The time of the next attempt after the ``attempts``-th failure (epoch seconds)."""
        delay = self.base_delay(attempts)
        delay -= delay * self.config.backoff_jitter * self._rng.random()
        return int(now + max(1.0, delay))

    def lifetime(self, null_sender: bool) -> float:
        c = self.config
        return c.bounce_queue_lifetime if null_sender else c.maximal_queue_lifetime

    def expired(self, now: float, arrival: float, null_sender: bool) -> bool:
        return now - arrival >= self.lifetime(null_sender)
