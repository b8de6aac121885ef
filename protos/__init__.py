"""Duet gRPC contract: `from protos import duet_pb2, duet_pb2_grpc` (see README.md)."""
