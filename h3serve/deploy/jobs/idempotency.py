"""``Idempotency-Key`` on ``POST /v1/videos`` and ``POST /v1/images/generations`` (Stripe's semantics).

A client that retries a POST after a timeout sends the same key: within ``window_s`` it gets the answer of the
first request with that key (for a video, the same job, as it reads now) instead of a second job holding the GPUs
for minutes. The same key with another body is a 422. Only an answered request is kept: one refused (4xx, 503) leaves
the key free to be used again, as Stripe does for requests that never began executing.

Each key is a file in the job store beside the records, ``idem_<sha256 of route and key>.key``, so every ingress
replica sees it: ``{"fingerprint", "created_at", "state": "pending" | "done", "response"}``. A request takes a key by
creating its file (``MediaStore.put_new``: exclusive on a local directory; on an object store a check then a write, so
two requests with one key at the same instant on two replicas may both run); a second request while the first is
pending is a 409 with Retry-After. A pending key left by an ingress that died is taken over after ``PENDING_S``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pydantic import BaseModel

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.jobs.media_store import MediaStore

logger = logging.getLogger(__name__)
HEADER = "Idempotency-Key"
KEY = re.compile(r"[\x21-\x7e]{1,255}")  # visible ASCII, as Stripe's keys (up to 255 characters)
PENDING_S = 600.0  # a key still pending this long lost its request (its ingress died): the next one takes it
PREFIX, SUFFIX = "idem_", ".key"


def key_of(headers: Any) -> str | None:
    """The request's Idempotency-Key, None without one, a 400 naming the header when malformed."""
    key = headers.get(HEADER.lower())
    if key is None:
        return None
    if not KEY.fullmatch(key):
        raise APIError(400, f"{HEADER} must be 1 to 255 visible ASCII characters, got {key[:40]!r}", HEADER)
    return key


def _digest(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):  # uploads: their content, not their form's boundary or filename
        return "sha256:" + hashlib.sha256(value).hexdigest()
    raise TypeError(f"{type(value).__name__} in a request body")


def fingerprint(route: str, body: BaseModel) -> str:
    """The validated body's identity: the same parameters (and upload bytes) however the client encoded them."""
    canonical = json.dumps([route, body.model_dump()], sort_keys=True, default=_digest, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def name_of(route: str, key: str) -> str:
    return PREFIX + hashlib.sha256(f"{route}\n{key}".encode()).hexdigest() + SUFFIX


@dataclasses.dataclass
class Use:
    """One request's use of a key: ``replay`` is the first request's answer when there was one; else the route
    sets ``response`` to its own answer, which is kept for the retries."""

    replay: dict | None = None
    response: dict | None = None


class Idempotency:
    def __init__(self, store: MediaStore, window_s: float, clock: Callable[[], float] = time.time):
        self.store, self.window_s, self.clock = store, window_s, clock

    def _entry(self, name: str) -> dict | None:
        raw = self.store.get(name)
        if raw is None:
            return None
        try:
            entry = json.loads(raw)
        except ValueError:
            return None
        return entry if isinstance(entry, dict) and isinstance(entry.get("created_at"), (int, float)) else None

    def begin(self, route: str, key: str, fingerprint: str) -> dict | None:
        """Take the key (None) or return the first request's answer; 422 for another body, 409 while it runs."""
        name = name_of(route, key)
        pending = json.dumps({"fingerprint": fingerprint, "created_at": self.clock(), "state": "pending"}).encode()
        if self.store.put_new(name, pending):
            return None
        entry = self._entry(name)
        now = self.clock()
        stale = entry is None or now - entry["created_at"] > (
            self.window_s if entry.get("state") == "done" else PENDING_S
        )
        if stale:  # expired, or its request died pending: this one takes the key
            self.store.put(name, pending)
            return None
        assert entry is not None
        if entry.get("fingerprint") != fingerprint:
            raise APIError(
                422,
                f"this {HEADER} was used with another request body within {self.window_s:g} s; use a new key for a "
                "new request",
                HEADER,
            )
        if entry.get("state") != "done":
            raise APIError(
                409,
                f"a request with this {HEADER} is still being processed; retry it shortly",
                HEADER,
                headers={"Retry-After": "1"},
            )
        return entry["response"]

    def finish(self, route: str, key: str, fingerprint: str, response: dict) -> None:
        entry = {"fingerprint": fingerprint, "created_at": self.clock(), "state": "done", "response": response}
        self.store.put(name_of(route, key), json.dumps(entry).encode())

    def release(self, route: str, key: str) -> None:
        """The request was refused or failed before it was answered: the key may be used again."""
        self.store.delete(name_of(route, key))

    def sweep(self) -> None:
        """Keys past their window go (a pending one past PENDING_S too)."""
        now = self.clock()
        for name in self.store.names():
            if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
                continue
            entry = self._entry(name)
            if entry is None or now - entry["created_at"] > max(self.window_s, PENDING_S):
                self.store.delete(name)

    @contextlib.asynccontextmanager
    async def use(self, io, headers: Any, route: str, body: BaseModel) -> AsyncIterator[Use]:
        """Around a POST's work: ``io`` runs the store calls off the event loop. Without the header it does nothing;
        with it, the yielded Use holds the replay, or takes the route's response and keeps it for the retries."""
        key = key_of(headers)
        use = Use()
        if key is None:
            yield use
            return
        digest = fingerprint(route, body)
        use.replay = await io(self.begin, route, key, digest)
        if use.replay is not None:
            logger.info("%s %s: answered again for a retried request", HEADER, key[:40])
            yield use
            return
        try:
            yield use
        except BaseException:
            await io(self.release, route, key)
            raise
        if use.response is None:
            await io(self.release, route, key)
        else:
            await io(self.finish, route, key, digest, use.response)
