"""A lost node (issue 54): a node holding the H3Replica and one of two H3Ingress replicas goes away (every one of its
processes killed with SIGKILL at once: raylet, object store, the replica, the ingress), a replacement joins; every
job accepted on either ingress replica completes, none fails, every event stream (read through the proxy, resumed
with Last-Event-ID) ends with its record's status. The jobs of the lost ingress are taken over by the other one, those
of the surviving ingress re-queued on the new replica.

It runs ``python -m benchmarks.chaos_node --runs 1`` as a user does (a two-node cluster of ``ray start`` processes
on this machine, ``h3serve serve`` on it; the benchmark's docstring says how) and judges its JSON. 77 s on 2 cores
(a cluster of two nodes, a server, a node lost and Ray's 12-15 s to declare it dead, the jobs run again), in CI
(a lost node is an ordinary operation an accepted job must survive) and in `make test-nodes`; its runs are in
docs/BENCHMARKS.md §17.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.ray,
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.own_cluster,  # its own nodes: the session's cluster is stopped before it, leaving it the CPUs
]

REPO = Path(__file__).resolve().parents[1]
RECOVERED_S = 300  # the node's loss to every job's end: Ray declaring it dead, a replica loading, three clips run again


def test_a_lost_node_with_a_replica_and_an_ingress_loses_no_job(tmp_path):
    out = tmp_path / "chaos_node.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.chaos_node", "--runs", "1", "--json", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print(done.stdout[-3000:])
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-5000:])
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    assert [v["status"] for v in run["videos"]] == ["completed"] * run["created"], run["videos"]
    assert run["on_lost_ingress"] >= 1 and run["taken_over"] == run["on_lost_ingress"], run  # each one taken over
    # the surviving ingress's jobs: the one stepping on the lost replica and those waiting, queued again
    assert run["requeued"] == run["created"] - run["on_lost_ingress"] >= 1, run
    assert all(2 <= attempts <= 3 for attempts in run["attempts"]), run  # lost under it, then run again (bounded)
    assert run["streams"][0] == run["streams"][1] == run["created"], run
    assert run["dead_s"] is not None and run["recover_s"] < RECOVERED_S, run
