"""The API's client side: ``http`` (the calls, sync and async), ``video_cli`` (the ``h3serve video`` commands),
``webhooks`` (checking a webhook's signature on the receiving side)."""

from h3serve.client.http import (
    FINISHED,
    AsyncH3Client,
    H3Client,
    JobFailed,
    parse_events,
)
from h3serve.client.webhooks import WebhookVerificationError, verify_webhook

__all__ = [
    "FINISHED",
    "AsyncH3Client",
    "H3Client",
    "JobFailed",
    "WebhookVerificationError",
    "parse_events",
    "verify_webhook",
]
