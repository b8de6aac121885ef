"""gRPC connection settings the processes share (what both ends of a connection must agree on)."""
