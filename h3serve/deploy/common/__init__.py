"""Shared by the driver, the ingress and the model servers: what travels between them (the typed config,
errors), what each of them records (metrics, logging) and small helpers (retry, the Serve-controller poller)."""
