"""The backlog autoscaling policy (h3serve/deploy/common/autoscaling.py) on constructed inputs: a pure function of the
replicas'
reports and the replica count, then the same policy under Serve's own wrapper (its delays and bounds, real Serve
code on a constructed AutoscalingContext), and its configuration refused by `h3serve admit` naming the field."""

import copy
import math

import pytest
import yaml
from pydantic import ValidationError
from ray.serve._private.common import DeploymentID, TimeStampedValue
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext

from h3serve.deploy.common.args import DeployArgs
from h3serve.deploy.common.autoscaling import (
    NO_DEADLINE_S,
    POLICY_PATH,
    STAT_KEYS,
    BacklogPolicy,
    PolicyConfig,
    ReplicaLoad,
    desired_replicas,
    replica_stats,
)
from tests.harness import REPO, default_config, free_port, h3serve_inline, write_config

CONFIG = PolicyConfig(target_wait_s=60.0)  # downscale_below 0.5, deadline_boost_max 4
RATE = 100.0  # row-steps per second per replica: one replica drains 6000 row-steps in the target


def loads(*backlogs: float, rate: float = RATE, **fields) -> list[ReplicaLoad]:
    return [ReplicaLoad(backlog_row_steps=b, row_step_rate=rate, **fields) for b in backlogs]


def test_the_fewest_replicas_whose_projected_drain_stays_under_the_target():
    assert desired_replicas(loads(6000), 1, CONFIG).replicas == 1  # 60 s: exactly the target
    decision = desired_replicas(loads(6001), 1, CONFIG)
    assert decision.replicas == 2 and "projected drain 60.0 s at 1 > target 60 s" in decision.reason
    assert decision.drain_s == pytest.approx(6001 / 200)  # at the count it asks for: projected, not measured
    # the summed backlog of every replica, whichever holds it: 3 x 10,000 row-steps need 5 replicas at 100/s
    assert desired_replicas(loads(10_000, 10_000, 10_000), 3, CONFIG).replicas == 5


def test_the_work_not_the_request_count_decides():
    # one 14 s clip's worth on one replica against forty stills' on another: the same work, the same answer
    clip = ReplicaLoad(backlog_row_steps=12_000, row_step_rate=RATE)
    stills = ReplicaLoad(backlog_row_steps=40 * 300, row_step_rate=RATE)
    assert desired_replicas([clip], 1, CONFIG).replicas == desired_replicas([stills], 1, CONFIG).replicas == 2


def test_hysteresis_holds_the_count_inside_the_band_and_scales_down_below_it():
    # at 2 replicas: up above 12,000 row-steps, down only once 1 replica drains within 30 s (3000 row-steps)
    for backlog in (3001, 6000, 11_999, 12_000):
        assert desired_replicas(loads(backlog / 2, backlog / 2), 2, CONFIG).replicas == 2, backlog
    decision = desired_replicas(loads(1500, 1500), 2, CONFIG)
    assert decision.replicas == 1 and "drain within 0.5 x target" in decision.reason
    # nothing held: as far down as Serve's min_replicas lets it
    assert desired_replicas(loads(0, 0), 2, CONFIG).replicas == 0


def test_a_backlog_wobbling_around_the_target_does_not_flap_the_count():
    current, counts = 1, []
    for i in range(40):
        backlog = 6000 * (1.05 if i % 2 else 0.95)  # +-5% around one replica's target, for 40 ticks
        spread = loads(*[backlog / current] * current)
        current = max(1, desired_replicas(spread, current, CONFIG).replicas)  # min_replicas 1
        counts.append(current)
    assert counts[0] == 1 and set(counts[1:]) == {2}, counts  # up once, then held: no 1-2-1-2


def test_a_request_close_to_its_deadline_counts_extra():
    relaxed = desired_replicas(loads(5000), 1, CONFIG)
    assert relaxed.replicas == 1
    # 20 s of slack against a 60 s target: that replica's backlog counts 3x (its work drains before the deadline)
    urgent = desired_replicas(loads(5000, deadline_slack_s=20.0), 1, CONFIG)
    assert urgent.backlog_row_steps == pytest.approx(15_000) and urgent.replicas == 3
    # at most deadline_boost_max, however close (or past) the deadline
    assert desired_replicas(loads(5000, deadline_slack_s=0.5), 1, CONFIG).backlog_row_steps == pytest.approx(20_000)
    assert desired_replicas(loads(5000, deadline_slack_s=-3.0), 1, CONFIG).backlog_row_steps == pytest.approx(20_000)
    # a deadline farther than the target changes nothing; only the replica holding the close one counts extra
    assert desired_replicas(loads(5000, deadline_slack_s=600.0), 1, CONFIG).backlog_row_steps == 5000
    mixed = [ReplicaLoad(3000, RATE, deadline_slack_s=30.0), ReplicaLoad(3000, RATE, deadline_slack_s=NO_DEADLINE_S)]
    assert desired_replicas(mixed, 2, CONFIG).backlog_row_steps == pytest.approx(9000)


def test_the_rate_is_the_replicas_median_and_without_one_the_count_holds_until_a_wait_runs_long():
    # one replica measures 100/s, another 300/s, a new one nothing yet: projected at the median of those measured
    mixed = [ReplicaLoad(8000, 100.0), ReplicaLoad(8000, 300.0), ReplicaLoad(0, 0.0)]
    assert desired_replicas(mixed, 3, CONFIG).rate == 200.0
    assert desired_replicas(mixed, 1, CONFIG).replicas == math.ceil(16_000 / (200 * 60)) == 2
    unmeasured = loads(50_000, rate=0.0)
    assert desired_replicas(unmeasured, 1, CONFIG).replicas == 1
    late = desired_replicas(loads(50_000, rate=0.0, oldest_wait_s=61.0), 1, CONFIG)
    assert late.replicas == 2 and "waited longer than target_wait_s" in late.reason


def test_no_scale_down_while_a_request_has_waited_long_without_starting():
    small = loads(100, 100, oldest_wait_s=45.0)  # drains in 1 s, yet someone waited 45 s (> 0.5 x 60)
    decision = desired_replicas(small, 2, CONFIG)
    assert decision.replicas == 2 and "not scaling down" in decision.reason
    assert desired_replicas(loads(100, 100, oldest_wait_s=10.0), 2, CONFIG).replicas == 1


def test_with_no_replica_running_the_policy_leaves_the_start_to_serves_cold_start():
    assert desired_replicas([], 0, CONFIG).replicas == 0
    assert desired_replicas([], 0, CONFIG, target=1).replicas == 1  # the first one starting: not stopped


def test_a_replica_still_starting_is_held_while_the_backlog_stays_in_the_band():
    # one running, a second starting (Serve's target 2), added for a backlog since partly drained: 4,500 row-steps
    # drain in 45 s on one (under the 60 s target), but not within the band's 30 s: two hold
    held = desired_replicas(loads(4500), 1, CONFIG, target=2)
    assert held.replicas == 2 and held.reason == "within the band"
    assert desired_replicas(loads(4500), 1, CONFIG).replicas == 1  # with none starting, one holds as well
    # no rate yet, a request waiting long: one more than running is what is starting already, not a third
    unmeasured = loads(50_000, rate=0.0, oldest_wait_s=61.0)
    assert desired_replicas(unmeasured, 1, CONFIG, target=2).replicas == 2
    assert desired_replicas(loads(50_000, rate=0.0), 1, CONFIG, target=2).replicas == 2
    # below the band, the starting replica is not needed: down to one
    assert desired_replicas(loads(2000), 1, CONFIG, target=2).replicas == 1


def test_under_serves_wrapper_a_starting_replica_is_kept_within_the_band():
    # no downscale delay: Serve's wrapper applies at once what a delay would apply later (it reads the wall clock)
    args = DeployArgs.model_validate(
        {"autoscaling": {"max_replicas": 2, "target_wait_s": 60, "upscale_delay_s": 0, "downscale_delay_s": 0}}
    )
    config = AutoscalingConfig(**args.autoscaling.serve_config())
    policy = _apply_autoscaling_config(BacklogPolicy(**config.policy.policy_kwargs))
    # r1 runs with 45 s of work (inside the band at two replicas); r2 is starting, so it reports nothing
    reports = {"r1": {"backlog_row_steps": [(1.0, 4500.0)], "row_step_rate": [(1.0, RATE)]}}
    replicas, state = policy(context(1, 2, reports, config, now=1000.0))
    assert replicas == 2, state["h3serve"]  # an answer of 1 (the running count) is a scale-down: r2 stopped
    # the same backlog with nothing starting: one replica, as before
    assert policy(context(1, 1, reports, config, now=1001.0))[0] == 1


def test_policy_config_fails_closed_naming_the_field():
    for kwargs, field in (
        ({"target_wait_s": -1}, "target_wait_s"),
        ({"target_wait_s": 60, "downscale_below": 1.5}, "downscale_below"),
        ({"target_wait_s": 60, "deadline_boost_max": 0.5}, "deadline_boost_max"),
    ):
        with pytest.raises(ValueError, match=field):
            PolicyConfig(**kwargs)
    with pytest.raises(TypeError, match="unknown"):
        BacklogPolicy(target_wait_s=60, unknown=1)


def test_replica_stats_are_numbers_serve_takes_and_read_back_alike():
    stats = replica_stats(1234, 56.5, 7.0, None)
    assert set(stats) == set(STAT_KEYS) and all(isinstance(v, float) for v in stats.values())
    assert ReplicaLoad.from_stats(stats) == ReplicaLoad(1234, 56.5, 7.0, NO_DEADLINE_S)
    assert ReplicaLoad.from_stats(replica_stats(1, 1.0, 0.0, 12.5)).deadline_slack_s == 12.5


def context(current: int, target: int, reports: dict[str, dict[str, list[tuple[float, float]]]], config, now: float):
    """Serve's own AutoscalingContext with raw metrics as replicas push them: replica -> key -> [(time, value)]."""
    raw: dict[str, dict] = {}
    for replica, series in reports.items():
        for key, points in series.items():
            raw.setdefault(key, {})[replica] = [TimeStampedValue(t, v) for t, v in points]
    return AutoscalingContext(
        deployment_id=DeploymentID(name="H3Replica", app_name="h3serve"),
        deployment_name="H3Replica",
        app_name="h3serve",
        current_num_replicas=current,
        target_num_replicas=target,
        running_replicas=list(reports),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics={},
        raw_metrics=raw,
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def test_under_serves_wrapper_the_newest_report_decides_after_the_delay():
    args = DeployArgs.model_validate(
        {"autoscaling": {"max_replicas": 3, "target_wait_s": 60, "upscale_delay_s": 0, "downscale_delay_s": 0}}
    )
    config = AutoscalingConfig(**args.autoscaling.serve_config())
    assert config.policy.policy_function == POLICY_PATH
    policy = _apply_autoscaling_config(BacklogPolicy(**config.policy.policy_kwargs))
    # the look-back mean of this replica's backlog is 5,000 (one replica), its newest report 20,000 (four)
    reports = {"r1": {"backlog_row_steps": [(1.0, 0.0), (2.0, 0.0), (3.0, 20_000.0)], "row_step_rate": [(3.0, RATE)]}}
    replicas, state = policy(context(1, 1, reports, config, now=3.0))
    assert replicas == 4  # Serve's wrapper bounds it to max_replicas later (apply_bounds): here the raw ask
    assert state["h3serve"]["replicas"] == 4 and state["h3serve"]["rate"] == RATE
    # with Serve's downscale delay, a drained backlog keeps the count until the delay has passed
    args.autoscaling.downscale_delay_s = 30.0
    config = AutoscalingConfig(**args.autoscaling.serve_config())
    policy = _apply_autoscaling_config(BacklogPolicy(**config.policy.policy_kwargs))
    idle = {"r1": {"backlog_row_steps": [(1.0, 0.0)], "row_step_rate": [(1.0, RATE)]}, "r2": {}}
    first, state = policy(context(2, 2, idle, config, now=1000.0))
    assert first == 2  # asked for, not yet held for 30 s


# -- configuration: DeployArgs and `h3serve admit` ---------------------------------------------
def autoscaled_config(**autoscaling) -> dict:
    config = copy.deepcopy(default_config())
    app = config["applications"][0]
    app["args"].pop("ingress")  # follows autoscaling.max_replicas
    app["args"]["autoscaling"] = {"min_replicas": 0, "max_replicas": 2, "target_wait_s": 30, **autoscaling}
    app["deployments"] = [d for d in app["deployments"] if d["name"] != "H3Replica"]
    return config


def test_deploy_args_build_serves_autoscaling_config_with_the_backlog_policy():
    args = DeployArgs.model_validate(autoscaled_config()["applications"][0]["args"])
    assert args.ingress.h3_replicas == 2  # the ingress is sized for the most replicas the policy runs
    config = AutoscalingConfig(**args.autoscaling.serve_config())  # Serve's own model takes it
    assert (config.min_replicas, config.max_replicas) == (0, 2)
    assert config.policy.policy_kwargs == {"target_wait_s": 30.0, "downscale_below": 0.5, "deadline_boost_max": 4.0}
    from h3serve.deploy.model_server.h3_replica import H3Replica

    assert H3Replica.deployment_options(args)["autoscaling_config"] == args.autoscaling.serve_config()


@pytest.mark.parametrize(
    "autoscaling, named",
    [
        ({"target_wait_s": -5}, "autoscaling.target_wait_s"),
        ({"min_replicas": 3}, "min_replicas=3 exceeds max_replicas=2"),
        ({"target_wiat_s": 60}, "autoscaling.target_wiat_s"),
        ({"downscale_below": 1}, "autoscaling.downscale_below"),
        ({"cold_images": "queue"}, "autoscaling.cold_images"),
    ],
)
def test_admit_refuses_a_policy_misconfiguration_naming_the_field(tmp_path, autoscaling, named):
    path = write_config(tmp_path, autoscaled_config(**autoscaling), free_port())
    result = h3serve_inline("admit", str(path))
    assert result.returncode == 2, result
    assert named in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_admit_refuses_autoscaling_overridden_under_deployments_and_a_mis_sized_ingress(tmp_path):
    config = autoscaled_config()
    config["applications"][0]["deployments"].append({"name": "H3Replica", "num_replicas": 2})
    result = h3serve_inline("admit", str(write_config(tmp_path, config, free_port(), "override.yaml")))
    assert result.returncode == 2 and "H3Replica sets num_replicas under deployments:" in result.stderr, result
    config = autoscaled_config()
    config["applications"][0]["args"]["ingress"] = {"h3_replicas": 3}
    result = h3serve_inline("admit", str(write_config(tmp_path, config, free_port(), "sized.yaml")))
    assert result.returncode == 2 and "ingress.h3_replicas=3 but autoscaling.max_replicas=2" in result.stderr


def test_the_validation_error_lists_the_allowed_values():
    with pytest.raises(ValidationError) as error:
        DeployArgs.model_validate({"autoscaling": {"max_replicas": 1, "cold_images": "queue"}})
    assert "'refuse' or 'wait'" in str(error.value)


def test_the_gpu_configs_scale_on_the_backlog():
    for name in ("serve_config.gpu.yaml", "serve_config.h100.yaml"):
        config = yaml.safe_load((REPO / "h3serve" / "deploy" / name).read_text())
        (app,) = config["applications"]
        args = DeployArgs.model_validate(app["args"])
        assert args.autoscaling is not None and args.autoscaling.min_replicas >= 1, name
        assert not any(d["name"] == "H3Replica" for d in app["deployments"]), name
        args.check_deployments(app["deployments"])
