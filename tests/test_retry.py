"""h3serve.deploy.common.retry: the one retry-with-backoff loop (stage calls, handed-back images, video jobs), without
Ray."""

import asyncio

import pytest

from h3serve.deploy.common import retry as retry_module
from h3serve.deploy.common.retry import Backoff, retry


class Flaky:
    """Fails with ``errors`` in turn, then returns "ok"; records each call."""

    def __init__(self, *errors: Exception):
        self.errors, self.calls = list(errors), 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)
        return "ok"


@pytest.fixture
def waits(monkeypatch):
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    monkeypatch.setattr(retry_module.asyncio, "sleep", sleep)
    return slept


def test_waits_double_up_to_the_cap_and_a_success_ends_it(waits):
    call, seen = Flaky(*[OSError(i) for i in range(4)]), []
    result = asyncio.run(retry(call, Backoff(1.0, 5.0), lambda e: True, lambda e, n, w: seen.append((n, w))))
    assert result == "ok" and call.calls == 5
    assert waits == [1.0, 2.0, 4.0, 5.0] and seen == [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0)]


def test_attempts_bound_the_calls_and_the_last_failure_is_raised(waits):
    call = Flaky(*[OSError(i) for i in range(5)])
    with pytest.raises(OSError, match="2"):
        asyncio.run(retry(call, Backoff(1.0, 5.0, attempts=3), lambda e: True))
    assert call.calls == 3 and waits == [1.0, 2.0]


def test_a_failure_not_retryable_is_raised_at_once(waits):
    call = Flaky(KeyError("no"))
    with pytest.raises(KeyError):
        asyncio.run(retry(call, Backoff(1.0, 5.0), lambda e: isinstance(e, OSError)))
    assert call.calls == 1 and waits == []


def test_no_wait_ends_past_for_s(waits, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(retry_module.time, "monotonic", lambda: now[0])
    call = Flaky(*[OSError(i) for i in range(5)])
    with pytest.raises(OSError, match="2"):  # 1 s, then 2 s fit within 3.5 s; the third wait (4 s) would not
        asyncio.run(retry(call, Backoff(1.0, 8.0, for_s=3.5), lambda e: True))
    assert call.calls == 3 and waits == [1.0, 2.0]
