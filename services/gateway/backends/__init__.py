"""Where tokens come from: the GenerationBackend interface, the gRPC path to the router and
prefill/decode workers (--backend grpc), and an in-process engine (--backend local)."""
