"""Video jobs, shared by every ingress replica: a small named actor holding status and MP4s."""

from __future__ import annotations

import collections
import time

import ray

FINISHED = ("completed", "failed")


@ray.remote(num_cpus=0, max_concurrency=64)
class JobStore:
    def __init__(self, max_jobs: int):
        self.max_jobs = max_jobs
        self.jobs: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self.content: dict[str, bytes] = {}

    def create(self, job: dict) -> bool:
        """False when the store is full of unfinished jobs (the caller answers 503)."""
        while len(self.jobs) >= self.max_jobs:
            oldest = next((k for k, j in self.jobs.items() if j["status"] in FINISHED), None)
            if oldest is None:
                return False
            self._drop(oldest)
        self.jobs[job["id"]] = dict(job)
        return True

    def update(self, job_id: str, fields: dict, content: bytes | None = None) -> bool:
        """False when the job was deleted meanwhile (its runner should stop)."""
        if job_id not in self.jobs:
            return False
        self.jobs[job_id].update(fields)
        if content is not None:
            self.content[job_id] = content
        return True

    def get(self, job_id: str) -> dict | None:
        return self.jobs.get(job_id)

    def get_content(self, job_id: str) -> bytes | None:
        return self.content.get(job_id)

    def delete(self, job_id: str) -> bool:
        return self._drop(job_id)

    def _drop(self, job_id: str) -> bool:
        self.content.pop(job_id, None)
        return self.jobs.pop(job_id, None) is not None


def job_store(app_name: str, max_jobs: int):
    return JobStore.options(name=f"h3serve-jobs-{app_name}", namespace="h3serve", lifetime="detached",
                            get_if_exists=True).remote(max_jobs)


def epoch_seconds() -> int:
    return int(time.time())
