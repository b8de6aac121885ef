"""A decode reservation as it travels (Decode.Reserve's answer, handed by the gateway to
Prefill and back to Decode.Generate) <-> duet_pb2.Reservation. Decode sends it; prefill
decodes it to know where to write; the gateway relays the message untouched and cancels it
by (reservation_id, generation). Its write capability (shared/kv_transfer/capability.py)
travels with it: the signature covers the reservation's fields as decoded here, so prefill
verifies exactly what it will write."""
from __future__ import annotations

from dataclasses import dataclass, field

from protos import duet_pb2
from shared.kv_transfer.write_capability import WriteCapability


@dataclass
class RankPages:
    """Destination pages on one TP rank of the decode worker."""
    rank: int
    agent_name: str  # NIXL agent of that rank (its metadata is in the registry)
    page_ids: list[int]  # pool page indices, in prompt order, past the held pages


@dataclass
class KvReservation:
    reservation_id: int
    generation: int  # bumps on reuse so late writes and notices are recognised
    decode_worker_id: str  # registry id, never an address
    decode_instance_nonce: str
    page_size: int  # tokens per page
    num_layers: int
    kv_dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    compat_hash: str  # model + KV layout + dtype + heads: both sides check
    ranks: list[RankPages] = field(default_factory=list)
    held_pages: int = 0  # leading prompt pages decode already holds: the writer skips them
    held_page_hashes: list[int] = field(default_factory=list)  # their chained hashes, checked by the writer
    capability: WriteCapability | None = None  # what lets its writer write these pages (None: nothing may)
    lease_ttl_ms: int = 0  # its holder renews it within this (Decode.RenewLease); 0: no lease


def reservation_to_proto(res: KvReservation) -> duet_pb2.Reservation:
    msg = duet_pb2.Reservation(
        reservation_id=res.reservation_id, generation=res.generation, decode_worker_id=res.decode_worker_id,
        decode_instance_nonce=res.decode_instance_nonce, page_size=res.page_size, num_layers=res.num_layers,
        kv_dtype=res.kv_dtype, compat_hash=res.compat_hash, held_pages=res.held_pages,
        held_page_hashes=res.held_page_hashes, lease_ttl_ms=res.lease_ttl_ms)
    for r in res.ranks:
        msg.ranks.add(rank=r.rank, agent_name=r.agent_name, page_ids=r.page_ids)
    cap = res.capability
    if cap is not None:
        msg.capability.CopyFrom(duet_pb2.WriteCapability(writer_id=cap.writer_id, lifetime_ms=cap.lifetime_ms,
                                                         secret=cap.secret, signature=cap.signature))
    return msg


def reservation_from_proto(msg: duet_pb2.Reservation) -> KvReservation:
    return KvReservation(
        reservation_id=msg.reservation_id, generation=msg.generation, decode_worker_id=msg.decode_worker_id,
        decode_instance_nonce=msg.decode_instance_nonce, page_size=msg.page_size, num_layers=msg.num_layers,
        kv_dtype=msg.kv_dtype, compat_hash=msg.compat_hash,
        ranks=[RankPages(r.rank, r.agent_name, list(r.page_ids)) for r in msg.ranks],
        held_pages=msg.held_pages, held_page_hashes=list(msg.held_page_hashes),
        capability=WriteCapability(msg.capability.writer_id, msg.capability.lifetime_ms, msg.capability.secret,
                                   msg.capability.signature) if msg.HasField("capability") else None,
        lease_ttl_ms=msg.lease_ttl_ms)
