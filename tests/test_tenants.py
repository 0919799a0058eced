"""Tenants without a server: the key file (shapes, refusals, hashing, re-reading on change, failing closed), the
token bucket, the quotas' admission, and the job store's ownership and usage (a real directory store)."""

import asyncio
import hashlib
import os
import time

import pytest
import yaml

from h3serve.deploy.common.errors import APIError
from h3serve.deploy.ingress.quotas import Quotas
from h3serve.deploy.ingress.tenants import ADMIN, Tenant, Tenants, TokenBuckets, read_keys
from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.store import JobPolicy, JobStore
from tests.test_jobs_store import video  # a queued video object, as the store records it

ALPHA = "alpha-0123456789abcdef"
BETA = "beta-0123456789abcdef0"
OPS = "ops-0123456789abcdef00"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def write_keys(path, entries: list[dict]) -> None:
    """Rewritten the way a Kubernetes Secret update does it: a new file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump({"keys": entries}))
    os.replace(tmp, path)


def entries() -> list[dict]:
    return [
        {"key": ALPHA, "tenant": "alpha", "role": "user", "max_priority": 1, "max_jobs": 4, "requests_per_minute": 60},
        {"key": BETA, "tenant": "beta"},
        {"key_sha256": hashlib.sha256(OPS.encode()).hexdigest(), "tenant": "ops", "role": "admin"},
    ]


def test_keys_in_the_issues_shape_map_to_their_tenants(tmp_path):
    path = tmp_path / "keys.yaml"
    write_keys(path, entries())
    tenants = Tenants(str(path), env_key="env-key-0123456789ab")
    alpha = tenants.authenticate(ALPHA)
    assert alpha == Tenant("alpha", "user", max_priority=1, max_jobs=4, requests_per_minute=60)
    assert not alpha.admin
    assert tenants.authenticate(BETA) == Tenant("beta")
    assert tenants.authenticate(OPS).admin  # given as its sha256 only
    assert tenants.authenticate("env-key-0123456789ab") == Tenant(ADMIN, "admin")  # api_key_env: one admin key
    for wrong in (None, "", ALPHA + "x", ALPHA[:-1], hashlib.sha256(OPS.encode()).hexdigest()):
        assert tenants.authenticate(wrong) is None, wrong
    assert tenants.names() == ["admin", "alpha", "beta", "ops"]
    # only digests are held: no key's text anywhere in the object
    held = repr(vars(tenants)) + repr(tenants.keys)
    assert ALPHA not in held and BETA not in held and OPS not in held


@pytest.mark.parametrize(
    "bad, words",
    [
        ([{"tenant": "a"}], "exactly one of key and key_sha256"),
        ([{"key": ALPHA, "key_sha256": "0" * 64, "tenant": "a"}], "exactly one of key and key_sha256"),
        ([{"key": "short", "tenant": "a"}], "keys.0.key"),
        ([{"key": ALPHA, "tenant": "Has Spaces"}], "keys.0.tenant"),
        ([{"key": ALPHA, "tenant": "a", "role": "root"}], "keys.0.role"),
        ([{"key": ALPHA, "tenant": "a", "max_priority": 99}], "keys.0.max_priority"),
        ([{"key": ALPHA, "tenant": "a", "max_jobs": 0}], "keys.0.max_jobs"),
        ([{"key": ALPHA, "tenant": "a", "surprise": 1}], "keys.0.surprise"),
        ([{"key": ALPHA, "tenant": "a"}, {"key": ALPHA, "tenant": "b"}], "listed twice"),
        ([{"key": ALPHA, "tenant": "a"}, {"key": BETA, "tenant": "a", "max_jobs": 2}], "same"),
        ([{"key": ALPHA, "tenant": "admin"}], "api_key_env"),
    ],
)
def test_a_bad_key_file_is_refused_naming_the_entry_never_echoing_a_key(tmp_path, bad, words):
    path = tmp_path / "keys.yaml"
    write_keys(path, bad)
    with pytest.raises(ValueError) as refused:
        Tenants(str(path), env_key=None)
    assert words in str(refused.value) and str(path) in str(refused.value)
    assert ALPHA not in str(refused.value) and BETA not in str(refused.value)


def test_an_unreadable_or_non_yaml_file_refuses_to_start(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        read_keys(str(tmp_path / "missing.yaml"))
    (tmp_path / "bad.yaml").write_text("keys: [unclosed")
    with pytest.raises(ValueError, match="not YAML"):
        read_keys(str(tmp_path / "bad.yaml"))
    (tmp_path / "list.yaml").write_text("- just a list")
    with pytest.raises(ValueError, match="auth.keys_file"):
        read_keys(str(tmp_path / "list.yaml"))


def test_a_rotated_key_works_and_a_revoked_one_stops_after_the_reload_interval(tmp_path):
    path, clock = tmp_path / "keys.yaml", Clock()
    write_keys(path, entries())
    tenants = Tenants(str(path), env_key=None, reload_s=5, clock=clock)
    rotated = "alpha-new-0123456789abcdef"
    changed = entries()
    changed[0] = {**changed[0], "key": rotated}  # alpha's key rotated
    del changed[1]  # beta revoked
    write_keys(path, changed)
    clock.now += 4  # within reload_s: not looked at yet
    assert tenants.authenticate(ALPHA) is not None and tenants.authenticate(rotated) is None
    clock.now += 1.5
    assert tenants.authenticate(rotated).name == "alpha"
    assert tenants.authenticate(ALPHA) is None and tenants.authenticate(BETA) is None
    assert tenants.authenticate(OPS).admin and tenants.reloads == 1
    clock.now += 10  # unchanged: not read again
    tenants.authenticate(OPS)
    assert tenants.reloads == 1


def test_a_file_that_turns_invalid_fails_closed_until_it_is_fixed(tmp_path):
    path, clock = tmp_path / "keys.yaml", Clock()
    write_keys(path, entries())
    tenants = Tenants(str(path), env_key="env-key-0123456789ab", reload_s=1, clock=clock)
    path.write_text("keys: [{key: x, tenant: alpha}]")  # key too short
    clock.now += 2
    assert tenants.authenticate(ALPHA) is None and tenants.authenticate(OPS) is None
    assert tenants.broken and "keys.0.key" in tenants.broken
    assert tenants.authenticate("env-key-0123456789ab").admin  # api_key_env's key is not the file's
    path.unlink()
    clock.now += 2
    assert tenants.authenticate(ALPHA) is None and "cannot be read" in tenants.broken
    write_keys(path, entries())
    clock.now += 2
    assert tenants.authenticate(ALPHA).name == "alpha" and tenants.broken is None


def test_the_token_bucket_allows_a_minutes_burst_then_its_rate():
    clock = Clock()
    buckets = TokenBuckets(clock)
    assert [buckets.take("a", 3) for _ in range(3)] == [0, 0, 0]
    assert buckets.take("a", 3) == pytest.approx(20.0)  # one token every 20 s
    assert buckets.take("b", 3) == 0  # per tenant
    clock.now += 10
    assert buckets.take("a", 3) == pytest.approx(10.0)
    clock.now += 10
    assert buckets.take("a", 3) == 0


def test_quotas_refuse_with_the_limit_named():
    rejected: list[tuple[str, str]] = []
    quotas = Quotas(lambda tenant, reason: rejected.append((tenant, reason)))
    capped = Tenant("alpha", max_priority=1, max_jobs=2, requests_per_minute=2, max_row_steps=100)
    quotas.check_priority(capped, 1)
    quotas.check_priority(None, 10)
    with pytest.raises(APIError) as e:
        quotas.check_priority(capped, 2)
    assert e.value.status == 400 and e.value.param == "priority" and "-10 to 1" in e.value.message
    quotas.check_rate(capped)
    quotas.check_rate(capped)
    with pytest.raises(APIError) as e:
        quotas.check_rate(capped)
    assert e.value.status == 429 and e.value.param == "requests_per_minute" and e.value.headers["Retry-After"] == "30"

    async def admit(usage: tuple[int, int], row_steps: int, job: bool = True):
        async def read() -> tuple[int, int]:
            return usage

        async with quotas.hold(capped, row_steps, read, job):
            pass

    asyncio.run(admit((1, 40), 60))  # exactly at the row-step limit
    for usage, row_steps, param, status in (((2, 0), 1, "max_jobs", 429), ((1, 50), 60, "max_row_steps", 429)):
        with pytest.raises(APIError) as e:
            asyncio.run(admit(usage, row_steps))
        assert (e.value.status, e.value.param) == (status, param)
        assert e.value.headers["Retry-After"] == "10" and capped.name in e.value.message
    with pytest.raises(APIError) as e:  # more than the limit on its own: it would never fit
        asyncio.run(admit((0, 0), 101))
    assert e.value.status == 400 and e.value.param == "max_row_steps"
    asyncio.run(admit((2, 0), 1, job=False))  # an image request is no job: max_jobs does not count it
    assert [reason for _, reason in rejected] == [
        "priority",
        "requests_per_minute",
        "max_jobs",
        "max_row_steps",
        "max_row_steps",
    ]


def test_concurrent_admissions_of_one_tenant_share_its_free_slot():
    """Two requests at once with one job free: the second sees the first's open job (the check and count are one
    step), not the store's count from before either was recorded."""
    quotas = Quotas()
    tenant = Tenant("alpha", max_jobs=1)
    outcomes: list[str] = []

    async def usage() -> tuple[int, int]:
        await asyncio.sleep(0.01)  # the store's listing, on a thread in the ingress
        return 0, 0

    async def one():
        try:
            async with quotas.hold(tenant, 1, usage, job=True):
                await asyncio.sleep(0.05)  # submitting
                outcomes.append("admitted")
        except APIError as e:
            outcomes.append(e.param or "")

    async def both():
        await asyncio.gather(one(), one())

    asyncio.run(both())
    assert sorted(outcomes) == ["admitted", "max_jobs"]


def test_the_store_keeps_each_jobs_tenant_and_shows_it_to_it_alone(tmp_path):
    store = JobStore(
        MediaStore(str(tmp_path / "videos")), JobPolicy(ttl_s=3600, max_bytes=10**9, lease_s=60, max_unfinished=9)
    )
    now = int(time.time())
    jobs = {}
    for i, tenant in enumerate(("alpha", "beta", "alpha")):
        v = video(now + i)
        jobs[v["id"]] = tenant
        runner = store.create(v, tenant=tenant, row_steps=100 * (i + 1))
        if i == 0:
            runner.complete(b"mp4")
    alpha = [v["id"] for v in store.list("alpha")]
    assert alpha == [i for i, t in reversed(jobs.items()) if t == "alpha"]  # newest first
    assert len(store.list()) == 3  # an admin: every job
    for job_id, owner in jobs.items():
        other = "beta" if owner == "alpha" else "alpha"
        assert store.get(job_id, owner)["id"] == job_id and store.get(job_id) is not None
        assert store.get(job_id, other) is None
        assert not store.delete(job_id, other) and store.get(job_id, owner) is not None
    assert store.usage("alpha") == (1, 300)  # the completed one no longer counts
    assert store.usage("beta") == (1, 200) and store.usage("nobody") == (0, 0)
    beta_job = next(i for i, t in jobs.items() if t == "beta")
    assert store.delete(beta_job, "beta") and store.usage("beta") == (0, 0)


def test_the_replicas_gpu_seconds_by_tenant_keep_a_bounded_set_of_series():
    """``EngineMetrics.on_tenant_forward_s`` exports each tenant's share times the replica's ranks; a tenant past
    MAX_TENANT_SERIES (the ingress names them from its key file, so only a bug gets there) is refused, never a new
    series (the engine's observer logs the error; the request goes on)."""
    from h3serve.deploy.common.metrics import MAX_TENANT_SERIES, EngineMetrics

    metrics = EngineMetrics(ranks=4)
    metrics.on_tenant_forward_s({f"t{i}": 0.25 for i in range(MAX_TENANT_SERIES)})
    metrics.on_tenant_forward_s({"t0": 0.5})  # a tenant seen before: counted again, no new series
    with pytest.raises(ValueError, match="past 1000 tenants"):
        metrics.on_tenant_forward_s({"one-too-many": 0.5})
    assert len(metrics.tenants_seen) == MAX_TENANT_SERIES and "one-too-many" not in metrics.tenants_seen
