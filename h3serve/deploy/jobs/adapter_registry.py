"""The run-time LoRA adapters of one application, kept in its job store (``jobs.store``: what every ingress shares).

``POST /v1/adapters`` and ``DELETE /v1/adapters/{name}`` write it; every ingress reads it (cached ``ttl_s``) to check
requests and list ``/v1/models``; every H3Replica reconciles against it (at start, on a request naming an adapter it
lacks, and at each health check), so an autoscaled or restarted replica serves what the others serve.

The store has whole-file puts and an exclusive create (``MediaStore.put_new``), no compare-and-swap. So each change
is a new generation ``adapters.<generation>`` created exclusively (two admins changing it at once: one wins, the other
reads again and retries) and never rewritten; ``adapters.head`` is a hint of the latest generation (written after it:
a reader starts there and steps on while the next generation exists). Generations are small and rare: all are kept.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable

from h3serve.deploy.jobs.media_store import MediaStore
from h3serve.pipelines.h3.lora_spec import LoraSpec

HEAD = "adapters.head"
CHANGE_TRIES = 20  # exclusive creates lost to other writers before a change gives up


def generation_name(generation: int) -> str:
    return f"adapters.{generation:08d}"


@dataclasses.dataclass(frozen=True)
class Adapters:
    """One generation: the run-time adapters by name (0: none was ever added)."""

    generation: int
    loras: dict[str, LoraSpec]

    def payload(self) -> bytes:
        return json.dumps(
            {"generation": self.generation, "loras": {n: s.model_dump(mode="json") for n, s in self.loras.items()}},
            sort_keys=True,
        ).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Adapters:
        data = json.loads(raw)
        return cls(int(data["generation"]), {n: LoraSpec.model_validate(s) for n, s in data["loras"].items()})


class AdapterConflict(Exception):
    """Other writers kept changing the registry: this change was not made."""


class AdapterRegistry:
    def __init__(self, store: MediaStore, ttl_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.store, self.ttl_s, self.clock = store, ttl_s, clock
        self._latest = Adapters(0, {})
        self._read_at: float | None = None

    def read(self, fresh: bool = False) -> Adapters:
        """The latest generation (``fresh`` False: as read at most ``ttl_s`` ago). Blocking I/O: call off the loop."""
        now = self.clock()
        if fresh or self._read_at is None or now - self._read_at >= self.ttl_s:
            self._latest, self._read_at = self._newest(), now
        return self._latest

    def cached(self) -> Adapters | None:
        """The generation read less than ``ttl_s`` ago; None when it must be read again (``read``)."""
        if self._read_at is None or self.clock() - self._read_at >= self.ttl_s:
            return None
        return self._latest

    def _newest(self) -> Adapters:
        hint = self.store.get(HEAD)
        generation = max(self._latest.generation, int(hint) if hint is not None and hint.strip().isdigit() else 0)
        latest = self._latest if generation == self._latest.generation else None
        while True:  # the head is written after its generation, and may lag: step on while the next one exists
            raw = self.store.get(generation_name(generation + 1))
            if raw is None:
                break
            generation += 1
            latest = Adapters.parse(raw)
        if latest is None:
            raw = self.store.get(generation_name(generation))
            latest = Adapters(0, {}) if raw is None else Adapters.parse(raw)
        return latest

    def change(self, edit: Callable[[dict[str, LoraSpec]], dict[str, LoraSpec]]) -> Adapters:
        """Write the generation after the latest with ``edit(its adapters)``; retried when another writer created
        that generation first (``edit`` runs again on theirs, and may raise to refuse). AdapterConflict after
        ``CHANGE_TRIES`` lost races."""
        for _ in range(CHANGE_TRIES):
            current = self.read(fresh=True)
            changed = Adapters(current.generation + 1, edit(dict(current.loras)))
            if self.store.put_new(generation_name(changed.generation), changed.payload()):
                self.store.put(HEAD, str(changed.generation).encode())
                self._latest, self._read_at = changed, self.clock()
                return changed
        raise AdapterConflict(f"the adapter registry changed under {CHANGE_TRIES} tries in a row; try again")
