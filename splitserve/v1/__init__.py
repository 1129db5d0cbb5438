"""Generated protobuf / gRPC modules for splitserve.v1 (scripts/gen_protos.py)."""
