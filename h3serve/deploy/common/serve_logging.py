"""h3serve's log lines inside a Serve replica (model replica, stage or ingress): through Serve's own logger."""

from __future__ import annotations

import logging

H3SERVE_PACKAGES = ("h3serve",)  # every module logs under its own name, h3serve.<layer>.<module>


def log_through_serve(packages: tuple[str, ...] = H3SERVE_PACKAGES) -> None:
    """Send h3serve's own log lines through Ray Serve's replica logger: its level, its log file and format,
    with the replica tag and, inside a request, that request's id (X-Request-Id). Without it they would reach
    the Ray worker's stderr only, and INFO lines (a request queued, joined, done, handed back) not at all."""
    serve_logger = logging.getLogger("ray.serve")
    if not serve_logger.handlers:  # not inside a Serve replica: leave logging as it is
        return
    for name in packages:
        package = logging.getLogger(name)
        package.setLevel(serve_logger.getEffectiveLevel())
        for handler in serve_logger.handlers:
            if handler not in package.handlers:
                package.addHandler(handler)
        package.propagate = False  # once, through Serve's handlers


audit_logger = logging.getLogger("h3serve.audit")


def audit(tenant: str | None, job: str | None, action: str, outcome: str, request_id: str = "-") -> None:
    """One line per state change a tenant caused or saw (create, cancel, delete, a job's end), in the ingress's log:
    ``audit tenant=alpha job=video_... action=create outcome=queued request=...``. Never a key."""
    audit_logger.info(
        "audit tenant=%s job=%s action=%s outcome=%s request=%s", tenant or "-", job or "-", action, outcome, request_id
    )
