"""The playground page at ``/``: ``h3serve/deploy/ingress/playground/`` (plain HTML, CSS and JS, package data), served
as one
document with its stylesheet, script and this deployment's few facts inline, so it works under any route prefix
and fetches nothing from elsewhere. It holds no data: everything it shows comes from the API, with the key the
person types in (a server with ``api_key_env``) sent as a bearer token."""

from __future__ import annotations

import functools
from importlib import resources

from h3serve.deploy.ingress.openapi import html_json


@functools.cache
def _asset(name: str) -> str:
    return resources.files("h3serve.deploy.ingress").joinpath("playground", name).read_text(encoding="utf-8")


def playground_page(auth: bool, model: str) -> str:
    """The page, for a server that does (``auth``) or does not need a bearer token."""
    config = html_json({"auth": auth, "model": model})
    # the script must not end its own <script> element
    script = _asset("playground.js").replace("</", "<\\/")
    return (
        _asset("index.html")
        .replace("/*__PLAYGROUND_CSS__*/", _asset("playground.css"))
        .replace("/*__PLAYGROUND_CONFIG__*/", config)
        .replace("/*__PLAYGROUND_JS__*/", script)
    )
