"""The Ray Serve application, by the process each part runs in (imports flow down this list, never up):

- ``h3serve.deploy.driver``: the driver (``h3serve`` CLI, ``serve run``, a RayService): config, pre-flight, the builder.
- ``h3serve.deploy.ingress``: the HTTP ingress replicas (H3Ingress): routes, request bodies, OpenAPI, playground.
- ``h3serve.deploy.jobs``: video jobs, run by the ingress replica that accepted them: record, store, runner, events.
- ``h3serve.deploy.model_server``: the replicas that hold the model (H3Replica, the stage deployments).
- ``h3serve.deploy.common``: what every process imports: the typed config, errors, metrics, logging, retry, the
  Serve-controller poller, the autoscaling policy (run by Serve's controller).
"""
