"""Webhooks as h3serve signs them, and checking one on the receiving side: the Standard Webhooks scheme
(https://www.standardwebhooks.com): headers ``webhook-id``, ``webhook-timestamp`` (Unix seconds) and
``webhook-signature`` = ``v1,`` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")), several space-separated when
the secret rotates. The key is a ``whsec_``-prefixed secret's base64 payload, or any other secret's UTF-8 bytes. The
server (``h3serve.deploy.jobs.webhooks``) signs with ``sign``; a receiver calls ``verify_webhook``::

    job = verify_webhook(os.environ["H3SERVE_WEBHOOK_SECRET"], request.headers, await request.body())
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from collections.abc import Mapping

SECRET_PREFIX = "whsec_"


class WebhookVerificationError(ValueError):
    """The webhook's headers are missing, its timestamp too far from now, or no signature matches."""


def signing_key(secret: str) -> bytes:
    return base64.b64decode(secret.removeprefix(SECRET_PREFIX)) if secret.startswith(SECRET_PREFIX) else secret.encode()


def sign(secret: str, webhook_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` header's value for ``body`` sent as ``webhook_id`` at ``timestamp``."""
    signed = f"{webhook_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(signing_key(secret), signed, hashlib.sha256).digest()).decode()


def verify_webhook(secret: str, headers: Mapping[str, str], body: bytes, tolerance_s: float = 300) -> dict:
    """The webhook's job object, once its signature checks out for ``secret`` and its timestamp is within
    ``tolerance_s`` of now (an old delivery replayed is refused); WebhookVerificationError otherwise. ``headers``:
    any mapping (its keys in any case), ``body``: the raw bytes as received (not re-serialised JSON)."""
    lower = {k.lower(): v for k, v in headers.items()}
    try:
        webhook_id, timestamp, signatures = (
            lower["webhook-id"],
            lower["webhook-timestamp"],
            lower["webhook-signature"],
        )
        sent_at = int(timestamp)
    except (KeyError, ValueError) as e:
        raise WebhookVerificationError(f"not a signed h3serve webhook: {e!r}") from None
    if abs(time.time() - sent_at) > tolerance_s:
        raise WebhookVerificationError(f"webhook-timestamp {sent_at} is over {tolerance_s:g} s from now")
    expected = sign(secret, webhook_id, sent_at, body)
    if not any(hmac.compare_digest(expected, given) for given in signatures.split()):
        raise WebhookVerificationError("no webhook-signature matches the body for this secret")
    return json.loads(body)
