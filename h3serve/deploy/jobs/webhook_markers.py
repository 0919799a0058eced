"""A finished video job's webhook delivery, kept as markers beside its record in the job store.

A delivery is owned by whoever creates ``<id>.webhook<n>`` (exclusive): owner 1 is the ingress that wrote the final
record; an owner that stops beating for lease_s (its ingress died mid-retries) is succeeded by the next n, up to
``MAX_DELIVERY_OWNERS`` (then it is given up). The owner beats in its marker while it retries and writes the outcome
there. The sender (``webhooks.WebhookSender``) and its caller (``video_jobs``) drive these; the store
(``store.JobStore``) lists the records they read and removes the markers with their job.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Callable

from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.deploy.jobs.records import FINISHED, JOB_ID

logger = logging.getLogger(__name__)
MAX_DELIVERY_OWNERS = 4
WEBHOOK_FILES = tuple(f".webhook{n}" for n in range(1, MAX_DELIVERY_OWNERS + 1))
DELIVERY_FILES = (".webhook", *WEBHOOK_FILES)  # every marker a job may have: an older version kept one, no n


class WebhookMarkers:
    def __init__(
        self,
        store: MediaStore,
        live_records: Callable[[list[str]], dict[str, dict]],
        clock: Callable[[], float],
        runner: dict | None,
    ):
        """``live_records``: the store's records of jobs not deleted, by id, from a listing of its names (a lapsed one
        expired as any read does: ``JobStore``); ``runner``: who this ingress replica is, written in its markers."""
        self.store, self.live_records, self.clock, self.runner = store, live_records, clock, runner
        self._delivered: set[str] = set()  # jobs whose webhook delivery has its outcome: not read again
        self._given_up: set[str] = set()  # logged once each

    def claim(self, job_id: str, owner: int = 1, webhook_id: str | None = None) -> dict | None:
        """The delivery of the job's webhook for the one caller that creates ``<id>.webhook<owner>`` (exclusive): its
        marker (``owner``, the ``id`` every attempt sends: a successor keeps its predecessor's, so a receiver dedupes
        on it, and ``beat_at``), or None (another ingress delivers it). Owner 1 is the ingress that wrote the final
        record; a later one took over a delivery whose owner stopped beating (``pending``)."""
        marker = {
            "owner": owner,
            "id": webhook_id or f"msg_{uuid.uuid4().hex}",
            "beat_at": self.clock(),
            "runner": self.runner,
        }
        if not JOB_ID.fullmatch(job_id) or not 1 <= owner <= MAX_DELIVERY_OWNERS:
            return None
        return marker if self.store.put_new(f"{job_id}.webhook{owner}", json.dumps(marker).encode()) else None

    def beat(self, job_id: str, marker: dict) -> bool:
        """The delivery's owner is alive (every lease_s / 4 while it retries); False when a successor took it over
        (this owner was thought dead: it stops, the successor delivers) or the job is gone."""
        if self.store.exists(f"{job_id}.webhook{marker['owner'] + 1}") or not self.store.exists(f"{job_id}.json"):
            return False
        self.store.put(f"{job_id}.webhook{marker['owner']}", json.dumps({**marker, "beat_at": self.clock()}).encode())
        return True

    def record(self, job_id: str, marker: dict, outcome: dict) -> None:
        """The webhook's outcome (delivered or not, attempts) in the owner's ``<id>.webhook<n>``, while the job is
        still there."""
        if self.store.exists(f"{job_id}.json"):
            self.store.put(f"{job_id}.webhook{marker['owner']}", json.dumps({**marker, **outcome}).encode())

    def get(self, job_id: str) -> dict | None:
        """The job's webhook delivery as its last owner wrote it: claimed (``beat_at``), then its outcome
        (``delivered``); None before any."""
        if not JOB_ID.fullmatch(job_id):
            return None
        for suffix in reversed(WEBHOOK_FILES):
            raw = self.store.get(f"{job_id}{suffix}")
            if raw is not None:
                return json.loads(raw)
        return None

    def pending(self) -> list[tuple[dict, int, str | None]]:
        """(record, next owner, webhook id) of the finished jobs whose webhook no live ingress delivers: none claimed
        it lease_s after the final record (its writer died first), or its owner stopped beating for lease_s (died
        mid-retries). Claimed by ``claim`` with that owner: at least once across ingress deaths."""
        names = self.store.names()
        present, now = set(names), self.clock()
        records = self.live_records(names)
        self._delivered &= set(records)  # a job gone is not asked about again
        self._given_up &= set(records)
        pending: list[tuple[dict, int, str | None]] = []
        for job_id, record in records.items():
            if record["video"]["status"] not in FINISHED or not record.get("webhook") or job_id in self._delivered:
                continue
            if f"{job_id}.webhook" in present:  # delivered by a version that kept one marker: done
                continue
            owners = [n for n, suffix in enumerate(WEBHOOK_FILES, 1) if f"{job_id}{suffix}" in present]
            if not owners:
                if now - record["updated_at"] > record["lease_s"]:
                    pending.append((record, 1, None))
                continue
            raw = self.store.get(f"{job_id}.webhook{owners[-1]}")
            try:
                marker = json.loads(raw) if raw is not None else None
            except ValueError:
                marker = None
            if not isinstance(marker, dict) or "delivered" in marker:
                self._delivered.add(job_id)
                continue
            if now - float(marker.get("beat_at", 0)) > record["lease_s"]:
                if owners[-1] < MAX_DELIVERY_OWNERS:
                    pending.append((record, owners[-1] + 1, marker.get("id")))
                elif job_id not in self._given_up:
                    self._given_up.add(job_id)
                    logger.error(
                        "%s.webhook%d in the video job store %s: every owner of its delivery died; given up",
                        job_id,
                        owners[-1],
                        self.store.url,
                    )
        return pending
