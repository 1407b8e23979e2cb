"""The engine core a node runs: the scheduler, the engine that steps the model, the KV port, the
thread that drives them, and the process that holds them apart from the node's gRPC front."""
