"""How a stream of a Decode.GenerateStreams call ends, both ways: the status its Generate would
have ended its own call with, as the stream's last piece (`StreamPiece.end`, `status_code`,
`status_details`), and back as the `AioRpcError` that call would have raised."""
from __future__ import annotations

import grpc

from protos import duet_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}


def end_piece(stream_id: int, code: grpc.StatusCode = grpc.StatusCode.OK, details: str = "") -> duet_pb2.StreamPiece:
    return duet_pb2.StreamPiece(stream_id=stream_id, end=True, status_code=code.value[0], status_details=details)


def end_error(piece: duet_pb2.StreamPiece) -> grpc.aio.AioRpcError | None:
    """The error an end piece carries (None: the stream ended OK)."""
    if not piece.status_code:
        return None
    return rpc_error(_CODES.get(piece.status_code, grpc.StatusCode.UNKNOWN), piece.status_details)


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """An AioRpcError as a call ending with this status raises it."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
