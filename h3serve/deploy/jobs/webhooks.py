"""Webhooks: a finished video job's object POSTed to the URL its request named (or ``jobs.webhooks.url``), signed.

Signed as Standard Webhooks say (``h3serve.client.webhooks.sign``: HMAC-SHA256 over ``id.timestamp.body`` with the
secret from the env var ``jobs.webhooks.secret_env`` names; the secret is never logged). Sent by the ingress that
wrote the job's final status, whether it ran the job or not (a lapsed lease, a cancel of a job whose runner died:
the store's fencing picks one writer): it first creates ``<id>.webhook1`` in the job store (exclusive on a shared
directory; a check then a write on an object store) and only the ingress that created it delivers, beating in it
while it retries; it then records the outcome there. At least once across ingress deaths: an ingress's sweeper
delivers a final job's webhook that nobody claimed lease_s after the final write, or whose owner stopped beating for
lease_s, as the next owner (``<id>.webhook2``..., the same ``webhook-id``, up to ``MAX_DELIVERY_OWNERS``). A non-2xx
answer or none is retried with exponential backoff for ``retry_for_s``; each attempt is counted by outcome
(``h3serve_webhook_attempts``).

Not a way to make the server call anywhere: the target's host is resolved and every address must be public or in
``allow`` (no loopback, link-local (cloud metadata: 169.254.169.254), private, shared, reserved or multicast address
otherwise), https unless ``allow_http``; checked at submit (a 400 naming ``webhook``) and again before each attempt
(DNS may have changed). Each attempt connects to the address it checked (pinned: the URL's host kept in the Host
header and TLS's SNI and certificate check), so a host re-resolving between the check and the connection (DNS
rebinding) cannot send it elsewhere. Redirects are not followed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import urlsplit

import httpx

from h3serve.client.webhooks import sign
from h3serve.deploy.common.args import WebhookArgs
from h3serve.deploy.common.errors import APIError
from h3serve.deploy.common.metrics import WebhookMetrics
from h3serve.deploy.common.retry import Backoff, retry

logger = logging.getLogger(__name__)
MAX_URL = 2048


class WebhookRefused(ValueError):
    """The target is not one this server may call (scheme, host, or an address outside the allow-list)."""


class DeliveryFailed(RuntimeError):
    """One attempt got a non-2xx answer or none (retried)."""


def resolve_secret(config: WebhookArgs) -> str | None:
    """The signing secret, or None when webhooks are off; a configured but empty variable refuses to start."""
    if config.secret_env is None:
        return None
    secret = os.environ.get(config.secret_env, "")
    if not secret:
        raise RuntimeError(
            f"jobs.webhooks.secret_env is {config.secret_env!r} but that environment variable is empty or unset: set "
            "it, or set jobs.webhooks.secret_env: null to run without webhooks"
        )
    return secret


def public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether an address is on the public internet (``is_global``: not loopback, link-local, private, shared, reserved,
    documentation...), an IPv4-mapped IPv6 address judged as its IPv4 one."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_global and not address.is_multicast


Resolver = Callable[..., list]  # socket.getaddrinfo's signature: tests point the sender at their own


def check_target(url: str, config: WebhookArgs, resolve: Resolver = socket.getaddrinfo) -> str:
    """The address to connect to (the first one ``url``'s host resolves to): WebhookRefused unless ``url`` is http(s)
    (https only unless allow_http) and every address its host resolves to is public or inside ``config.allow``.
    Blocking (DNS): run it off the event loop."""
    if len(url) > MAX_URL:
        raise WebhookRefused(f"is over {MAX_URL} characters")
    parts = urlsplit(url)
    schemes = ("https", "http") if config.allow_http else ("https",)
    if parts.scheme not in schemes:
        raise WebhookRefused(f"must be an {' or '.join(schemes)} URL")
    if not parts.hostname or parts.username or parts.password:
        raise WebhookRefused("must name a host (and no user or password)")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        infos = resolve(parts.hostname, port, type=socket.SOCK_STREAM)
    except (OSError, ValueError) as e:
        raise WebhookRefused(f"host {parts.hostname!r} does not resolve ({e})") from None
    if not infos:
        raise WebhookRefused(f"host {parts.hostname!r} resolves to no address")
    allowed = [ipaddress.ip_network(n, strict=False) for n in config.allow]
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]  # no IPv6 scope id
    for address in addresses:
        if not public(address) and not any(address in network for network in allowed):
            raise WebhookRefused(
                f"host {parts.hostname!r} resolves to {address}, which is not a public address nor in "
                "jobs.webhooks.allow"
            )
    return str(addresses[0])


def pinned(url: str, address: str) -> tuple[httpx.URL, dict[str, str], dict[str, str]]:
    """``url`` aimed at ``address`` (the one ``check_target`` passed), with the Host header and, for https, the TLS
    server name (SNI, and the name the certificate is checked against) of ``url``'s own host: (url, headers,
    request extensions)."""
    original = httpx.URL(url)
    host = original.host  # IDNA-encoded, no brackets
    default = {"https": 443, "http": 80}[original.scheme]
    header = host if original.port in (None, default) else f"{host}:{original.port}"
    if ":" in host:
        header = f"[{host}]" if original.port in (None, default) else f"[{host}]:{original.port}"
    extensions = {"sni_hostname": host} if original.scheme == "https" else {}
    return original.copy_with(host=address), {"host": header}, extensions


async def checked_target(url: str, config: WebhookArgs) -> None:
    """``check_target`` at submit, as the API's 400 naming ``webhook``."""
    try:
        await asyncio.to_thread(check_target, url, config)
    except WebhookRefused as e:
        raise APIError(400, f"webhook: {url[:100]!r} {e}", "webhook") from None


async def job_webhook(asked: str | None, config: WebhookArgs, enabled: bool) -> str | None:
    """A new job's webhook: the request's (checked now: a 400 naming ``webhook``), else ``config.url`` (checked at
    each delivery), else None. A request's webhook on a deployment without a secret is a 400 too: never unsigned."""
    if asked is None:
        return config.url
    if not enabled:
        raise APIError(
            400, "webhook: this deployment sends no webhooks (its jobs.webhooks.secret_env is not set)", "webhook"
        )
    await checked_target(asked, config)
    return asked


@dataclasses.dataclass(frozen=True)
class Delivery:
    """One job's webhook, as one ingress delivers it: ``video`` POSTed to ``url`` if ``claim()`` (run on ``io``, a store
    write) gives this ingress the delivery's marker (``WebhookMarkers.claim``: its owner and webhook id);
    ``beat(marker)`` every ``beat_s`` while it retries (False: a successor took it over, this one stops);
    ``record(marker, outcome)`` keeps the outcome in the store."""

    url: str
    video: dict
    claim: Callable[[], dict | None]
    beat: Callable[[dict], bool]
    record: Callable[[dict, dict], None]
    io: Callable[..., Awaitable[Any]]
    beat_s: float


class WebhookSender:
    def __init__(
        self,
        config: WebhookArgs,
        secret: str,
        metrics: WebhookMetrics | None = None,
        resolve: Resolver = socket.getaddrinfo,
    ):
        self.config, self.secret, self.resolve = config, secret, resolve
        self.metrics = metrics or WebhookMetrics()
        self.backoff = Backoff(first_s=config.first_retry_s, max_s=config.max_retry_s, for_s=config.retry_for_s)
        self.tasks: set[asyncio.Task] = set()

    def start(self, delivery: Delivery) -> None:
        """Run ``delivery`` in the background (it goes on only if its claim gives this ingress the marker)."""
        task = asyncio.get_running_loop().create_task(self._deliver(delivery))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _deliver(self, delivery: Delivery) -> None:
        url, job_id = delivery.url, delivery.video["id"]
        try:
            marker = await delivery.io(delivery.claim)
            if marker is None:
                return  # another ingress delivers it (or did)
            webhook_id = marker["id"]
            body = json.dumps(delivery.video).encode()
            attempts = 0

            async def attempt() -> int:
                nonlocal attempts
                attempts += 1
                return await self._attempt(url, webhook_id, body)

            def again(error: Exception, attempt_no: int, wait_s: float) -> None:
                logger.info(
                    "webhook of video job %s: attempt %d failed (%s); again in %.1f s",
                    job_id,
                    attempt_no,
                    error,
                    wait_s,
                )

            sending = asyncio.ensure_future(
                retry(attempt, self.backoff, lambda e: isinstance(e, DeliveryFailed), again)
            )
            ended = asyncio.Event()
            beating = asyncio.ensure_future(self._beat(delivery, sending, ended, marker))
            outcome: dict[str, Any]
            try:
                status = await sending
                outcome = {"delivered": True, "status": status, "attempts": attempts}
                logger.info("webhook of video job %s delivered (HTTP %d, attempt %d)", job_id, status, attempts)
            except (DeliveryFailed, WebhookRefused) as e:
                outcome = {"delivered": False, "error": str(e), "attempts": attempts}
                logger.warning("webhook of video job %s not delivered after %d attempts: %s", job_id, attempts, e)
            except asyncio.CancelledError:
                if beating.done() and beating.result() is False:
                    logger.warning("webhook of video job %s: another ingress took its delivery over", job_id)
                    return
                raise
            finally:  # a beat in flight lands before the outcome, never over it
                ended.set()
                await asyncio.gather(beating, return_exceptions=True)
            await delivery.io(delivery.record, marker, {**outcome, "finished_at": time.time()})
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("webhook of video job %s failed", job_id)

    @staticmethod
    async def _beat(delivery: Delivery, sending: asyncio.Future, ended: asyncio.Event, marker: dict) -> bool:
        """Beat in the delivery's marker every ``beat_s`` until it has ``ended`` (True); cancel its ``sending``
        (False) when a successor took it over. Never cancelled mid-beat: a write finishing after the outcome's would
        hide it."""
        while True:
            try:
                await asyncio.wait_for(ended.wait(), delivery.beat_s)
                return True
            except asyncio.TimeoutError:
                pass
            try:
                mine = await delivery.io(delivery.beat, marker)
            except Exception:
                logger.exception("webhook of video job %s: beating failed; retrying", marker.get("id"))
                continue
            if not mine:
                sending.cancel()
                return False

    async def _attempt(self, url: str, webhook_id: str, body: bytes) -> int:
        """One POST, to the address the check passed (``pinned``); its HTTP status when 2xx, DeliveryFailed
        otherwise; WebhookRefused (not retried) when the target no longer passes the check."""
        try:
            address = await asyncio.to_thread(check_target, url, self.config, self.resolve)
        except WebhookRefused:
            self.metrics.attempt("refused")
            raise
        target, host, extensions = pinned(url, address)
        timestamp = int(time.time())
        headers = {
            **host,
            "content-type": "application/json",
            "webhook-id": webhook_id,
            "webhook-timestamp": str(timestamp),
            "webhook-signature": sign(self.secret, webhook_id, timestamp, body),
            "user-agent": "h3serve-webhooks",
        }
        try:
            async with httpx.AsyncClient(
                timeout=self.config.timeout_s, follow_redirects=False, trust_env=False
            ) as http:
                response = await http.post(target, content=body, headers=headers, extensions=extensions)
        except httpx.HTTPError as e:
            self.metrics.attempt("no_answer")
            raise DeliveryFailed(f"no answer: {type(e).__name__}") from None
        if not response.is_success:
            self.metrics.attempt("rejected")
            raise DeliveryFailed(f"HTTP {response.status_code}")
        self.metrics.attempt("delivered")
        return response.status_code

    async def close(self) -> None:
        """This ingress stops: its deliveries still retrying end here; another ingress's sweeper resumes them once
        their marker's beat is lease_s old (``WebhookMarkers.pending``)."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
