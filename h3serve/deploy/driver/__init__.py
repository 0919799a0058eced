"""The driver: where a deployment is decided before any replica runs (the CLI, the builder Serve's build task
calls, the pre-flight that admits the attention backend and the memory plan, the platform probe)."""
