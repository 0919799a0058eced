"""The API's client side: ``http`` (the calls, sync and async), ``video_cli`` (the ``h3serve video`` commands)."""

from h3serve.client.http import (
    FINISHED,
    AsyncH3Client,
    H3Client,
    JobFailed,
    parse_events,
)

__all__ = ["FINISHED", "AsyncH3Client", "H3Client", "JobFailed", "parse_events"]
