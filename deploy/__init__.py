"""The Ray Serve application, by the process each part runs in (imports flow down this list, never up):

- ``deploy.driver``: the driver (``h3serve`` CLI, ``serve run``, a RayService): config, pre-flight, the builder.
- ``deploy.ingress``: the HTTP ingress replicas (H3Ingress): routes, request bodies, OpenAPI, playground.
- ``deploy.jobs``: video jobs, run by the ingress replica that accepted them: record, store, runner, events.
- ``deploy.model_server``: the replicas that hold the model (H3Replica, the stage deployments).
- ``deploy.common``: what every process imports: the typed config, errors, metrics, logging, retry, the
  Serve-controller poller, the autoscaling policy (run by Serve's controller).
"""
