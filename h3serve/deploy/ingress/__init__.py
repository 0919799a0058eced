"""The HTTP ingress (H3Ingress, a Serve deployment of its own): routes, request bodies and their parsing, the
OpenAPI document, the playground page, waking a deployment scaled to zero. Imports no model library."""
