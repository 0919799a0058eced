"""``route``: how every route method of ``H3Ingress`` runs, in a module of its own so that routers beside
``h3serve.deploy.ingress.routes`` (``derived``) decorate their methods the same way without importing it."""

import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request


def route(name: str):
    """A route method run by ``H3Ingress._call`` (auth, error mapping, timing, counting), counted as ``name``."""

    def wrap(handler: Callable[..., Awaitable[Any]]):
        @functools.wraps(handler)  # Serve and FastAPI read the handler's name and parameters through this
        async def endpoint(self, request: Request, **params):
            return await self._call(name, request, lambda: handler(self, request, **params))

        return endpoint

    return wrap
