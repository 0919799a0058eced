"""Tenants: who a bearer key belongs to, what it may do, and how much of the deployment it may hold.

Keys come from ``auth.keys_file`` (YAML, the shape below; on Kubernetes a Secret mounted as a file) and from
``api_key_env`` (one key, tenant ``admin``, role admin). The file is read when the ingress starts (a bad one refuses to
start) and again whenever its (mtime, size, inode) changes, looked at no more often than ``auth.reload_s``: a key
added or rotated works, and a removed one stops, within seconds, without a restart; running jobs are untouched (a
job belongs to its tenant's name, not to a key). A file that turns unreadable or invalid while serving fails closed:
no key of it is accepted until it is fixed (``api_key_env``'s still is), and every poll logs why.

    keys:
      - {key: "alpha-0123456789abcdef", tenant: alpha, role: user, max_priority: 1, max_jobs: 4,
         requests_per_minute: 60, max_row_steps: 200000}
      - {key_sha256: "9f86d0...", tenant: ops, role: admin}

Only SHA-256 digests of keys are held in memory, compared with ``hmac.compare_digest`` against every entry (no early
exit: the time taken does not depend on which entry matched). Keys are never logged; tenant names are, and label
metrics (a bounded set: the file's). No Serve or FastAPI here: the routes ask ``Tenants.authenticate`` and the quotas.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from h3serve.replicas import MAX_PRIORITY, MIN_PRIORITY

logger = logging.getLogger(__name__)
ADMIN = "admin"  # the tenant api_key_env's key belongs to
TENANT_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"  # a metric label and a log word: short, plain
MIN_KEY_CHARS = 16  # a shorter key is guessable; refused in the file


class KeyEntry(BaseModel):
    """One key of the file: the key or its SHA-256 (hex), its tenant, role and the tenant's limits (None: none)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str | None = Field(default=None, min_length=MIN_KEY_CHARS, repr=False)
    key_sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")
    tenant: str = Field(pattern=TENANT_NAME)
    role: Literal["user", "admin"] = "user"
    max_priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY)
    max_jobs: int | None = Field(default=None, ge=1, description="unfinished video jobs at once")
    requests_per_minute: float | None = Field(default=None, gt=0, description="generation requests, token bucket")
    max_row_steps: int | None = Field(default=None, ge=1, description="row-steps of unfinished work at once")

    @model_validator(mode="after")
    def _one_key(self) -> KeyEntry:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"tenant {self.tenant!r}: give exactly one of key and key_sha256")
        return self

    @property
    def digest(self) -> bytes:
        if self.key is not None:
            return hashlib.sha256(self.key.encode()).digest()
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)


@dataclasses.dataclass(frozen=True)
class Tenant:
    """Who a request comes from, and its limits (None: unlimited)."""

    name: str
    role: Literal["user", "admin"] = "user"
    max_priority: int | None = None
    max_jobs: int | None = None
    requests_per_minute: float | None = None
    max_row_steps: int | None = None

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def public(self) -> dict:
        """What ``GET /v1/me`` shows: the tenant, its role and its limits."""
        return {"object": "tenant", **dataclasses.asdict(self)}


class KeyFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: list[KeyEntry]

    @model_validator(mode="after")
    def _consistent(self) -> KeyFile:
        """Several keys of one tenant (a rotation holds the old and the new) must agree on its role and limits; a
        key given twice would be ambiguous."""
        tenants: dict[str, Tenant] = {}
        digests: set[bytes] = set()
        for i, entry in enumerate(self.keys):
            if entry.digest in digests:
                raise ValueError(f"keys[{i}] (tenant {entry.tenant!r}): the same key is listed twice")
            digests.add(entry.digest)
            tenant = tenant_of(entry)
            if tenant.name == ADMIN and not tenant.admin:
                raise ValueError(f"keys[{i}]: tenant {ADMIN!r} is api_key_env's, an admin; give this one another name")
            known = tenants.setdefault(tenant.name, tenant)
            if known != tenant:
                raise ValueError(
                    f"keys[{i}]: tenant {tenant.name!r} is listed with other role or limits before; every key of "
                    "one tenant carries the same"
                )
        return self


def tenant_of(entry: KeyEntry) -> Tenant:
    return Tenant(
        name=entry.tenant,
        role=entry.role,
        max_priority=entry.max_priority,
        max_jobs=entry.max_jobs,
        requests_per_minute=entry.requests_per_minute,
        max_row_steps=entry.max_row_steps,
    )


def read_keys(path: str) -> list[tuple[bytes, Tenant]]:
    """(sha256 digest, tenant) of every key in the file; ValueError saying what is wrong (never a key's text)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"auth.keys_file {path}: cannot be read ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"auth.keys_file {path}: not YAML{where}") from None
    try:
        parsed = KeyFile.model_validate(raw)
    except ValidationError as e:
        first = e.errors(include_input=False)[0]  # never echo the input: it may be a key
        where = ".".join(map(str, first["loc"]))
        raise ValueError(f"auth.keys_file {path}: {where}: {first['msg']}") from None
    return [(entry.digest, tenant_of(entry)) for entry in parsed.keys]


def file_signature(path: str) -> tuple[int, int, int] | None:
    """What tells a changed file (a Secret update swaps a symlink: the inode changes, maybe not the mtime)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


class Tenants:
    """The keys a server accepts and the tenant each one belongs to; None from ``authenticate``: refused."""

    def __init__(
        self,
        keys_file: str | None,
        env_key: str | None,
        reload_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.keys_file, self.reload_s, self.clock = keys_file, reload_s, clock
        self.env_digest = None if env_key is None else hashlib.sha256(env_key.encode()).digest()
        self.keys: list[tuple[bytes, Tenant]] = []
        self.signature: tuple[int, int, int] | None = None
        self.checked_at = -math.inf
        self.reloads = 0  # successful reads after the first (tests and /v1/stats wait on it)
        self.broken: str | None = None  # why the file is refused now (no key of it accepted meanwhile)
        self._lock = threading.Lock()
        if keys_file is not None:  # at start a bad file refuses to start
            self.signature = file_signature(keys_file)
            self.keys = read_keys(keys_file)
            self.checked_at = clock()
            logger.info("auth: %d keys of tenants %s from %s", len(self.keys), ", ".join(self.names()), keys_file)

    @property
    def enabled(self) -> bool:
        """Whether requests need a key (else open mode: no tenant, everyone sees everything)."""
        return self.env_digest is not None or self.keys_file is not None

    def names(self) -> list[str]:
        """The tenants a metric may be labelled with (the file's, and api_key_env's)."""
        names = {tenant.name for _, tenant in self.keys}
        if self.env_digest is not None:
            names.add(ADMIN)
        return sorted(names)

    def poll(self) -> None:
        """Re-read the file when it changed (looked at once every ``reload_s`` at most)."""
        if self.keys_file is None or self.clock() - self.checked_at < self.reload_s:
            return
        with self._lock:
            if self.clock() - self.checked_at < self.reload_s:
                return
            self.checked_at = self.clock()
            signature = file_signature(self.keys_file)
            if signature == self.signature and self.broken is None:
                return
            try:
                keys = read_keys(self.keys_file)
            except ValueError as e:
                if self.broken is None:
                    logger.error("auth: %s; refusing every key of it until it is fixed", e)
                self.broken, self.keys, self.signature = str(e), [], signature
                return
            before = {t.name for _, t in self.keys}
            self.keys, self.signature, self.broken = keys, signature, None
            self.reloads += 1
            after = {t.name for _, t in keys}
            logger.info(
                "auth: %s re-read: %d keys; tenants %s (added %s, removed %s)",
                self.keys_file,
                len(keys),
                ", ".join(sorted(after)) or "none",
                ", ".join(sorted(after - before)) or "none",
                ", ".join(sorted(before - after)) or "none",
            )

    def authenticate(self, token: str | None) -> Tenant | None:
        """The tenant of ``token``; None when no key matches (or none was sent)."""
        self.poll()
        if token is None:
            return None
        digest = hashlib.sha256(token.encode()).digest()
        found: Tenant | None = None
        if self.env_digest is not None and hmac.compare_digest(digest, self.env_digest):
            found = Tenant(ADMIN, "admin")
        for known, tenant in self.keys:  # every entry compared: the time does not say which one matched
            if hmac.compare_digest(digest, known) and found is None:
                found = tenant
        return found


class TokenBuckets:
    """``requests_per_minute`` per tenant: a bucket of that many tokens, refilled continuously. Per ingress replica:
    with N ingress replicas a tenant gets up to N times its rate (their load balancer spreads requests evenly)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.buckets: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, when)

    def take(self, tenant: str, per_minute: float) -> float:
        """0 and one token taken, or the seconds until one is there (nothing taken)."""
        now, capacity, rate = self.clock(), per_minute, per_minute / 60.0
        tokens, when = self.buckets.get(tenant, (capacity, now))
        tokens = min(capacity, tokens + (now - when) * rate)
        if tokens >= 1.0:
            self.buckets[tenant] = (tokens - 1.0, now)
            return 0.0
        self.buckets[tenant] = (tokens, now)
        return (1.0 - tokens) / rate
