"""Which role may call which gRPC method: a server interceptor that reads the caller's
verified certificate (mutual TLS) and refuses, with PERMISSION_DENIED naming the method and
the caller's role, every call its role does not need.

The gateway is the only caller of the serving methods; the planner is the only caller of a
worker's SetRole (a role switch, services/planner/); the router calls the workers' health
check to prove a registry entry is the worker it names (shared/registry/entry_trust.py), and
any certified caller may ask for health. Nothing else calls a Duet gRPC server: a worker's
certificate cannot route, reserve, prefill or generate (docs/ARCHITECTURE.md §2, the RPC table).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import grpc

from shared.security.identity import ROLES, Identity, identity_in

ANY_ROLE = frozenset(ROLES)
# method -> roles allowed to call it; a method not listed is refused to everyone
METHOD_ROLES: Mapping[str, frozenset[str]] = {
    "/duet.v1.Router/Route": frozenset({"gateway"}),
    "/duet.v1.Router/Release": frozenset({"gateway"}),
    "/duet.v1.Decode/Reserve": frozenset({"gateway"}),
    "/duet.v1.Decode/Cancel": frozenset({"gateway"}),
    "/duet.v1.Decode/RenewLease": frozenset({"gateway"}),  # the gateway holds the reservations' leases
    "/duet.v1.Decode/Generate": frozenset({"gateway"}),
    "/duet.v1.Decode/GenerateStreams": frozenset({"gateway"}),
    "/duet.v1.Prefill/Prefill": frozenset({"gateway"}),
    "/duet.v1.Adapters/LoadLoraAdapter": frozenset({"gateway"}),
    "/duet.v1.Adapters/UnloadLoraAdapter": frozenset({"gateway"}),
    "/duet.v1.WorkerAdmin/SetRole": frozenset({"planner"}),
    "/grpc.health.v1.Health/Check": ANY_ROLE,
    "/grpc.health.v1.Health/Watch": ANY_ROLE,
}


def caller_of(context: grpc.aio.ServicerContext) -> Identity | None:
    """The identity in the caller's verified certificate (None: no certificate, or one that
    names no single Duet role)."""
    return identity_in(context.auth_context().get("x509_subject_alternative_name", ()))


def refusal(method: str, caller: Identity | None, policy: Mapping[str, frozenset[str]] = METHOD_ROLES) -> str | None:
    """Why `caller` may not call `method`; None when it may."""
    allowed = policy.get(method, frozenset())
    if caller is None:
        return f"{method} refused: the caller's certificate names no Duet role"
    if caller.role in allowed:
        return None
    who = ", ".join(sorted(allowed)) or "no one"
    return f"{method} refused to role {caller.role} ({caller}): only {who} may call it"


class CallerGuard(grpc.aio.ServerInterceptor):
    """Wraps every handler so that its first act is the role check (the caller's certificate is
    only visible to the handler's context, not to the interceptor itself)."""

    def __init__(self, policy: Mapping[str, frozenset[str]] = METHOD_ROLES):
        self.policy = policy

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        return _guarded(handler, details.method, self.policy)


def _guarded(handler: grpc.RpcMethodHandler, method: str, policy) -> grpc.RpcMethodHandler:
    async def check(context) -> None:
        why = refusal(method, caller_of(context), policy)
        if why is not None:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, why)

    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def answer(request, context):
            await check(context)
            return await inner(request, context)
    else:
        inner = handler.unary_stream or handler.stream_stream

        async def answer(request, context):
            await check(context)
            result = inner(request, context)
            if inspect.isasyncgen(result):
                async for item in result:
                    yield item
            else:  # a handler that writes with context.write() and returns nothing
                await result

    make = {"unary_unary": grpc.unary_unary_rpc_method_handler, "stream_unary": grpc.stream_unary_rpc_method_handler,
            "unary_stream": grpc.unary_stream_rpc_method_handler,
            "stream_stream": grpc.stream_stream_rpc_method_handler}
    kind = next(k for k in make if getattr(handler, k))
    return make[kind](answer, request_deserializer=handler.request_deserializer,
                      response_serializer=handler.response_serializer)
