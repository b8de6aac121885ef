"""What the worker roles (services/prefill, services/decode) share: the engine loop thread,
the context passed to their gRPC services, the compile-ahead grammar check, the KV transfer agents and the peer resolver. Imports nothing from
services/worker, services/prefill or services/decode: the host and the roles import this."""
