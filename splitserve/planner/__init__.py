"""The planner: reads the router's pressure signals, decides how many prefill and decode nodes
the cluster wants (``policy.decide``, a pure function) and acts through an actuator (the local
launcher, docker/podman compose, Kubernetes). Torch-free: it never loads a model."""
