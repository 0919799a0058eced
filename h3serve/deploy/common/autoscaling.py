"""Autoscaling on the work: what each H3Replica reports to Serve's autoscaler, and the policy that reads it.

A request is anything from one still to a 14 s clip (40x the work), so a count of ongoing requests (Serve's default
policy) says little about how long a queue takes. Each replica reports its backlog in row-steps (rows x denoising
steps left, over every request it holds, waiting or running), the row-step rate it measured, the oldest wait of a
request it has not started and the tightest deadline slack of the requests it holds (``replica_stats``). The
policy (``desired_replicas``, a plain function of those and the replica counts) asks for the fewest replicas whose
projected drain time of the summed backlog stays under ``target_wait_s``:

    drain_s(n) = backlog / (n x rate)           rate: the median of the replicas' measured rates

The count it holds or moves is Serve's target (running replicas and those still starting), not the running ones:
Serve reads any answer below its target as a scale-down and, after ``downscale_delay_s``, stops a starting
replica first. (Holding at the running count does that whenever the backlog sits in the band while a replica
starts: the node layer test's add-and-remove flap on a loaded machine, docs/BENCHMARKS.md section 14.)

- **Up** as soon as drain_s(target) > target_wait_s: to ceil(backlog / (rate x target_wait_s)).
- **Down** only when one replica fewer would still drain within ``downscale_below x target_wait_s`` (a band, so a
  backlog near the target does not flap the count), to the fewest that do; to 0 (Serve's ``min_replicas`` bounds
  it) once nothing is held.
- **Waits**: no scale-down while a request has waited longer than ``downscale_below x target_wait_s`` without
  starting (the projection is behind what clients see). Before any rate is measured, a request that waited longer
  than ``target_wait_s`` asks for one more replica than are running. (Not after: a waiting request stays in its
  replica's queue, so replicas added for it would not shorten its wait, and asking again every tick would run up
  to the maximum.)
- **Deadlines**: a replica holding a request whose deadline is closer than ``target_wait_s`` counts its backlog
  ``target_wait_s / slack`` times (at most ``deadline_boost_max``), so its work drains before that request's
  deadline rather than within the target.

Serve applies the rest: ``upscale_delay_s`` / ``downscale_delay_s`` (a decision must hold that long),
``min_replicas`` / ``max_replicas`` and the cold start from zero (a request queued at a handle with no replica
running starts one, before any policy runs). Serve calls ``BacklogPolicy(**policy_kwargs)`` once and then the
instance at every control-loop tick; the controller unpickles this module by value, so it imports nothing of
h3serve's own.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping
from typing import Any

# the keys of ``record_autoscaling_stats`` (Serve's custom metrics), by field of ``ReplicaLoad``
BACKLOG, RATE, OLDEST_WAIT, DEADLINE_SLACK = "backlog_row_steps", "row_step_rate", "oldest_wait_s", "deadline_slack_s"
STAT_KEYS = (BACKLOG, RATE, OLDEST_WAIT, DEADLINE_SLACK)
# Serve takes numbers only: a replica holding no request with a deadline reports this slack (about 11.6 days)
NO_DEADLINE_S = 1e6
SLACK_FLOOR_S = 1.0  # a slack at or past zero weighs as this much: its request is failing now; the rest is not
POLICY_PATH = "h3serve.deploy.common.autoscaling:BacklogPolicy"


@dataclasses.dataclass(frozen=True)
class ReplicaLoad:
    """One replica's report (``replica_stats`` writes it, ``from_stats`` reads it back)."""

    backlog_row_steps: float
    row_step_rate: float  # measured row-steps per busy second; 0: not measured yet
    oldest_wait_s: float = 0.0
    deadline_slack_s: float = NO_DEADLINE_S

    @classmethod
    def from_stats(cls, stats: Mapping[str, float]) -> ReplicaLoad:
        return cls(
            backlog_row_steps=max(0.0, float(stats.get(BACKLOG, 0.0))),
            row_step_rate=max(0.0, float(stats.get(RATE, 0.0))),
            oldest_wait_s=max(0.0, float(stats.get(OLDEST_WAIT, 0.0))),
            deadline_slack_s=float(stats.get(DEADLINE_SLACK, NO_DEADLINE_S)),
        )


def replica_stats(backlog_row_steps: int, row_step_rate: float, oldest_wait_s: float, slack_s: float | None) -> dict:
    """What ``H3Replica.record_autoscaling_stats`` returns: Serve's custom metrics, numbers only."""
    return {
        BACKLOG: float(backlog_row_steps),
        RATE: float(row_step_rate),
        OLDEST_WAIT: float(oldest_wait_s),
        DEADLINE_SLACK: float(NO_DEADLINE_S if slack_s is None else min(slack_s, NO_DEADLINE_S)),
    }


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
    """The policy's own settings (``policy_kwargs``); ``h3serve.deploy.common.args.AutoscalingArgs`` validates them for
    operators."""

    target_wait_s: float
    downscale_below: float = 0.5
    deadline_boost_max: float = 4.0

    def __post_init__(self):
        # fail closed in the controller too, should kwargs reach it without the deploy args' validation
        if not (isinstance(self.target_wait_s, (int, float)) and self.target_wait_s > 0):
            raise ValueError(f"target_wait_s must be a number of seconds > 0, got {self.target_wait_s!r}")
        if not (isinstance(self.downscale_below, (int, float)) and 0 < self.downscale_below < 1):
            raise ValueError(f"downscale_below must be between 0 and 1 (exclusive), got {self.downscale_below!r}")
        if not (isinstance(self.deadline_boost_max, (int, float)) and self.deadline_boost_max >= 1):
            raise ValueError(f"deadline_boost_max must be a number >= 1, got {self.deadline_boost_max!r}")


@dataclasses.dataclass(frozen=True)
class Decision:
    replicas: int  # before Serve's bounds and delays
    reason: str
    backlog_row_steps: float  # summed, deadline weights applied
    rate: float  # the per-replica row-step rate projected with (0: none measured)
    drain_s: float | None  # projected drain time at ``replicas`` (None: no rate, or no replica)


def weighted_backlog(load: ReplicaLoad, config: PolicyConfig) -> float:
    """A replica's backlog, counted extra when it holds a request whose deadline is closer than the target."""
    slack = max(load.deadline_slack_s, SLACK_FLOOR_S)
    boost = min(config.deadline_boost_max, max(1.0, config.target_wait_s / slack))
    return load.backlog_row_steps * boost


def desired_replicas(
    loads: Iterable[ReplicaLoad], running: int, config: PolicyConfig, target: int | None = None
) -> Decision:
    """The replica count for ``loads`` (one per running replica that reported) with ``running`` replicas running and
    Serve's ``target`` (running and starting; default ``running``) the count that holds."""
    current = running if target is None else max(target, running)  # the count Serve holds: running and starting
    loads = list(loads)
    backlog = sum(weighted_backlog(load, config) for load in loads)
    rates = [load.row_step_rate for load in loads if load.row_step_rate > 0]
    rate = statistics.median(rates) if rates else 0.0
    oldest = max((load.oldest_wait_s for load in loads if load.backlog_row_steps > 0), default=0.0)
    late = oldest > config.target_wait_s

    def drain(n: int) -> float | None:
        return backlog / (n * rate) if n > 0 and rate > 0 else None

    if running <= 0:  # Serve's cold start runs before any policy: a request waiting at a handle starts one
        return Decision(current, "no replica running: the count holds", backlog, rate, None)
    if backlog <= 0:
        return Decision(0, "nothing held: down to min_replicas", 0.0, rate, None)
    if rate <= 0:
        n = max(current, running + 1) if late else current
        why = "no rate measured yet" + ("; a request waited longer than target_wait_s: one more" if late else "")
        return Decision(n, why, backlog, rate, None)
    up = math.ceil(backlog / (rate * config.target_wait_s))
    down = math.ceil(backlog / (rate * config.target_wait_s * config.downscale_below))
    if up > current:
        n, why = up, f"projected drain {drain(current):.1f} s at {current} > target {config.target_wait_s:g} s"
    elif down < current and oldest > config.downscale_below * config.target_wait_s:
        n, why = current, f"a request has waited {oldest:.1f} s without starting: not scaling down"
    elif down < current:
        n, why = down, f"{down} replica(s) drain within {config.downscale_below:g} x target"
    else:
        n, why = current, "within the band"
    return Decision(n, why, backlog, rate, drain(n))


def latest(series: Any) -> float | None:
    """The newest value of one of Serve's metric time series (a list of points with .timestamp and .value)."""
    if not series:
        return None
    point = max(series, key=lambda p: p.timestamp)
    return float(point.value)


class BacklogPolicy:
    """Serve's custom autoscaling policy (``autoscaling_config.policy``): constructed once with ``policy_kwargs``,
    called with an ``AutoscalingContext`` at every control-loop tick; returns (replicas, policy state)."""

    def __init__(self, **kwargs: Any):
        self.config = PolicyConfig(**kwargs)

    def loads(self, ctx: Any) -> list[ReplicaLoad]:
        """Each running replica's newest report (its raw series; the look-back mean lags a load step)."""
        raw = ctx.raw_metrics or {}
        reports: dict[Any, dict[str, float]] = {}
        for key in STAT_KEYS:
            for replica, series in (raw.get(key) or {}).items():
                value = latest(series)
                if value is not None:
                    reports.setdefault(replica, {})[key] = value
        return [ReplicaLoad.from_stats(stats) for stats in reports.values()]

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        decision = desired_replicas(self.loads(ctx), ctx.current_num_replicas, self.config, ctx.target_num_replicas)
        state = dict(ctx.policy_state or {})
        state["h3serve"] = dataclasses.asdict(decision)  # the last decision, for whoever reads the policy state
        return decision.replicas, state
