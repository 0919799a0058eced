"""What a video job record is: its id rule, its states, its shape, who may see it, the error codes the jobs write in it.

Below both the store (``store``: records, leases, retention) and the webhook deliveries' markers
(``webhook_markers``), which read the same records: the one place either takes these names from.
"""

from __future__ import annotations

import re

FINISHED = ("completed", "failed", "cancelled")
JOB_ID = re.compile(r"video_[0-9a-f]{32}")
RUNNER_LOST = "runner_lost"
REPLICA_LOST = "replica_lost"  # the job's replica was lost under it on every one of its attempts


def is_record(record) -> bool:
    """Whether parsed JSON has the shape the store writes (a stray or hand-edited file may not)."""
    if not isinstance(record, dict) or not isinstance(record.get("video"), dict):
        return False
    video = record["video"]
    return (
        isinstance(record.get("updated_at"), (int, float))
        and isinstance(record.get("lease_s"), (int, float))
        and isinstance(record.get("bytes"), int)
        and isinstance(video.get("id"), str)
        and video.get("status") in ("queued", "in_progress", *FINISHED)
        and isinstance(video.get("created_at"), (int, float))
    )


def owned(record: dict, tenant: str | None) -> bool:
    """Whether ``tenant`` may see the job (None: any caller may: an admin, or a server without tenants)."""
    return tenant is None or record.get("tenant") == tenant


def job_id_of(name: str, suffix: str) -> str | None:
    """The job id of a store name like ``video_<32 hex>.json``; None for anything else in the store."""
    if not name.endswith(suffix):
        return None
    job_id = name.removesuffix(suffix)
    return job_id if JOB_ID.fullmatch(job_id) else None
