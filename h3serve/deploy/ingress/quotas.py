"""A tenant's quotas at admission: its priority cap (400), generation requests per minute, unfinished video jobs and
row-steps of unfinished work (each a 429 with Retry-After, naming the limit).

Jobs and row-steps are counted from the job store (every ingress's jobs) plus what this ingress is admitting now or
generating as images (``open``); the check and the count are one step per tenant (``asyncio.Lock``), so one
ingress never lets two concurrent requests past one free slot. Across ingress replicas two may, briefly (their
stores' listings race): a limit can be exceeded by one request per ingress replica at most. Requests per minute is a
token bucket per ingress replica (``TokenBuckets``). No Serve or FastAPI here."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.ingress.tenants import Tenant, TokenBuckets
from h3serve.replicas import MIN_PRIORITY

# a job's end is not known at admission (it takes minutes, its ETA is its own record's): ask again after this
QUOTA_RETRY_AFTER_S = 10


def too_many(tenant: Tenant, limit: str, message: str, retry_after_s: float) -> APIError:
    return APIError(
        429,
        f"tenant {tenant.name}: {message} ({limit})",
        limit,
        headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))},
    )


class Quotas:
    def __init__(self, rejected: Callable[[str, str], None] = lambda tenant, reason: None):
        """``rejected(tenant, reason)``: a refusal, counted (reason: the limit's name)."""
        self.rejected = rejected
        self.buckets = TokenBuckets()
        self.locks: dict[str, asyncio.Lock] = {}
        self.open_jobs: dict[str, int] = {}  # video jobs being admitted here, not yet in the store
        self.open_row_steps: dict[str, int] = {}  # theirs, and this ingress's running image requests'

    def _refuse(self, tenant: Tenant, error: APIError) -> APIError:
        self.rejected(tenant.name, error.param or "")
        return error

    def check_priority(self, tenant: Tenant | None, priority: int) -> None:
        """A 400 naming ``priority`` and the tenant's allowed range when it asks above its cap."""
        if tenant is None or tenant.max_priority is None or priority <= tenant.max_priority:
            return
        raise self._refuse(
            tenant,
            APIError(
                400,
                f"priority: tenant {tenant.name} may ask for {MIN_PRIORITY} to {tenant.max_priority}, got {priority}",
                "priority",
            ),
        )

    def check_rate(self, tenant: Tenant | None) -> None:
        """One generation request of the tenant's ``requests_per_minute``, or a 429 saying when the next one is."""
        if tenant is None or tenant.requests_per_minute is None:
            return
        wait_s = self.buckets.take(tenant.name, tenant.requests_per_minute)
        if wait_s > 0:
            rpm = f"{tenant.requests_per_minute:g}"
            raise self._refuse(
                tenant, too_many(tenant, "requests_per_minute", f"over {rpm} generation requests a minute", wait_s)
            )

    @contextlib.asynccontextmanager
    async def hold(
        self,
        tenant: Tenant | None,
        row_steps: int,
        usage: Callable[[], Awaitable[tuple[int, int]]],
        job: bool,
    ) -> AsyncIterator[None]:
        """Admit work of ``row_steps`` (a video ``job``, or an image request) within the tenant's limits, counted as
        open while the block runs: a video until its record is written (then the store counts it), an image until
        it is answered. ``usage()``: the tenant's (unfinished jobs, their row-steps) in the store."""
        if tenant is None or (tenant.max_jobs is None and tenant.max_row_steps is None):
            yield
            return
        name = tenant.name
        async with self.locks.setdefault(name, asyncio.Lock()):
            jobs, steps = await usage()
            jobs += self.open_jobs.get(name, 0)
            steps += self.open_row_steps.get(name, 0)
            if job and tenant.max_jobs is not None and jobs >= tenant.max_jobs:
                raise self._refuse(
                    tenant,
                    too_many(tenant, "max_jobs", f"{jobs} video jobs are unfinished, its limit", QUOTA_RETRY_AFTER_S),
                )
            limit = tenant.max_row_steps
            if limit is not None and row_steps > limit:  # never fits: waiting would not help
                raise self._refuse(
                    tenant,
                    APIError(
                        400,
                        f"tenant {tenant.name}: this request is {row_steps} row-steps (rows x num_inference_steps), "
                        f"over its limit of {limit} (max_row_steps): ask for fewer steps, a smaller size or seconds",
                        "max_row_steps",
                    ),
                )
            if limit is not None and steps + row_steps > limit:
                raise self._refuse(
                    tenant,
                    too_many(
                        tenant,
                        "max_row_steps",
                        f"{steps} row-steps are unfinished and this request adds {row_steps}, over its limit {limit}",
                        QUOTA_RETRY_AFTER_S,
                    ),
                )
            self.open_jobs[name] = self.open_jobs.get(name, 0) + job
            self.open_row_steps[name] = self.open_row_steps.get(name, 0) + row_steps
        try:
            yield
        finally:
            self.open_jobs[name] -= job
            self.open_row_steps[name] -= row_steps
