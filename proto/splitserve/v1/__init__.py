"""Generated protobuf and gRPC modules of the splitserve.v1 package (scripts/gen_proto.sh)."""
