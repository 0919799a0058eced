"""Retry with backoff: one loop for the three places that make a call again after a failure that may pass
(a stage replica that died under a call, an image handed back by a draining replica, a video job that no replica
can take yet). Each says which failures are retried, how long or how many times, and what it logs and counts."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Backoff:
    """Waits from ``first_s``, doubling up to ``max_s``; a retry stops at ``attempts`` calls in all, or where its
    wait would end more than ``for_s`` after the first call began (None: no such bound)."""

    first_s: float
    max_s: float
    attempts: int | None = None
    for_s: float | None = None


async def retry(
    call: Callable[[], Awaitable[T]],
    backoff: Backoff,
    retryable: Callable[[Exception], bool],
    on_retry: Callable[[Exception, int, float], None] | None = None,
) -> T:
    """``call()``'s result; a failure ``retryable`` accepts is called again after the next wait, while ``backoff``
    allows. The last failure (or one not retryable) is raised as it is. ``on_retry(error, attempt, wait_s)`` runs
    before each wait (``attempt``: the calls made so far). A cancellation is never retried."""
    give_up = None if backoff.for_s is None else time.monotonic() + backoff.for_s
    attempt, wait_s = 0, backoff.first_s
    while True:
        attempt += 1
        try:
            return await call()
        except Exception as e:
            if (
                not retryable(e)
                or (backoff.attempts is not None and attempt >= backoff.attempts)
                or (give_up is not None and time.monotonic() + wait_s > give_up)
            ):
                raise
            if on_retry is not None:
                on_retry(e, attempt, wait_s)
            await asyncio.sleep(wait_s)
            wait_s = min(2 * wait_s, backoff.max_s)
