"""The server runtime every splitserve process shares: gRPC serving with health and reflection,
per-process configs, Prometheus metrics, protobuf <-> core conversions, GPU claims."""
