"""A holder's reservation leases <-> Decode.RenewLease's messages: the (reservation_id,
generation) keys it renews on one decode worker, and the ones decode says it no longer holds
(services/decode/reservations.py, `ReservationBook.renew`)."""
from __future__ import annotations

from collections.abc import Iterable

from protos import duet_pb2

ReservationKey = tuple[int, int]  # (reservation_id, generation)


def _keys_to_proto(keys: Iterable[ReservationKey]) -> list[duet_pb2.ReservationKey]:
    return [duet_pb2.ReservationKey(reservation_id=rid, generation=gen) for rid, gen in keys]


def _keys_from_proto(keys) -> list[ReservationKey]:
    return [(k.reservation_id, k.generation) for k in keys]


def renew_request_to_proto(keys: Iterable[ReservationKey]) -> duet_pb2.RenewLeaseRequest:
    return duet_pb2.RenewLeaseRequest(reservations=_keys_to_proto(keys))


def renew_request_from_proto(msg: duet_pb2.RenewLeaseRequest) -> list[ReservationKey]:
    return _keys_from_proto(msg.reservations)


def renew_reply_to_proto(lost: Iterable[ReservationKey]) -> duet_pb2.RenewLeaseReply:
    return duet_pb2.RenewLeaseReply(lost=_keys_to_proto(lost))


def renew_reply_from_proto(msg: duet_pb2.RenewLeaseReply) -> list[ReservationKey]:
    return _keys_from_proto(msg.lost)
