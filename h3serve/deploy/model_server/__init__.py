"""The Serve side of the replicas that hold the model: H3Replica (one SP worker group and its engine,
``replicas.Engine``) and the conditioner/decoder stage deployments it may call."""
