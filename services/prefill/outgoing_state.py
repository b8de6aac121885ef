"""The lifecycle of one outgoing KV handoff on a prefill worker: the prompt is computed and
its pages written into a decode reservation, then the completion notice goes out behind the
last write, and the request's pages are released (into the prefix cache on success).

OutgoingTransfers (outgoing.py) is the only caller; the stream events come from its
PageWriteStream (or TpWriteStream) settling: DONE once nothing is in flight and the queued
notice went out, FAILED when a write or the notice failed.

    PREFILLING  computing the prompt; each finished page is written as it comes
    TAIL        the first token is sampled: the rest of the prompt's pages are written
    FINISHING   every page posted; the done notice waits behind the last writes
    DECLINING   the held prefix is not the prompt's: nothing written, a declined notice
                queued (decode recomputes; the first token still answers the RPC)
    CANCELLING  given up (the caller left, the engine ended the request before its first
                token, the write capability's lifetime passed, or the transfer's lease lapsed:
                its decode worker left the registry and took no write, or revoked the reservation
                because the gateway stopped renewing it): nothing more is written, an
                abort notice waits behind the writes in flight
    DONE        notice sent; the pages go into the prefix cache and the RPC gets its answer
    FAILED      a write or the notice failed; the pages are freed and the RPC fails
    CANCELLED   the abort notice went out (or could not); the pages are freed and the RPC fails

The failure rule each move serves and its tests: docs/ARCHITECTURE.md, "Failure rules and
the tests that prove them"."""
from __future__ import annotations

from enum import Enum, auto

from shared.state_table import Move, StateTable


class OutgoingState(Enum):
    PREFILLING = auto()
    TAIL = auto()
    FINISHING = auto()
    DECLINING = auto()
    CANCELLING = auto()
    DONE = auto()
    FAILED = auto()
    CANCELLED = auto()


class OutgoingEvent(Enum):
    FIRST_TOKEN = auto()  # the engine sampled the first token (the prompt is computed)
    FINISH = auto()  # every page posted: queue the done notice
    DECLINE = auto()  # held prefix mismatch: queue the declined notice, write nothing
    CANCEL = auto()  # the RPC gave up (stop_writing, cancel)
    ENDED = auto()  # the engine ended the request before its first token
    EXPIRE = auto()  # the reservation's write capability expired while pages were still to write
    LEASE_LAPSED = auto()  # its decode instance left the registry and no write landed for the lease,
    # or decode revoked the reservation (the gateway stopped renewing its lease there)
    STREAM_DONE = auto()  # nothing in flight and the queued notice went out
    STREAM_FAILED = auto()  # a write (or the notice) failed


S, E = OutgoingState, OutgoingEvent
WRITING = frozenset({S.PREFILLING, S.TAIL})  # states that post page writes
LEASED = frozenset({S.PREFILLING, S.TAIL, S.FINISHING, S.DECLINING})  # a lease on decode's liveness holds them


def _unit(test: str) -> str:
    return f"tests/disagg/test_outgoing_lifecycle.py::{test}"


HAPPY = _unit("test_a_handoff_writes_every_page_then_its_done_notice")
DECLINE = _unit("test_a_held_prefix_that_is_not_the_prompts_writes_nothing_and_declines")
CANCEL = _unit("test_a_cancel_in_any_state_sends_abort_once_nothing_is_in_flight")
WRITE_FAILS = _unit("test_a_failed_write_or_notice_fails_the_request_and_frees_its_pages")
ENDED = _unit("test_a_request_the_engine_ends_before_its_first_token_aborts")
DECODE_KILLED = "tests/disagg/test_failures_workers.py::test_decode_killed_while_prefill_writes"
HELD_PREFIX = ("tests/disagg/test_failures_workers.py::"
               "test_a_held_prefix_that_is_not_the_prompts_makes_decode_recompute")
DISCONNECT = ("tests/disagg/test_failures_pair.py::"
              "test_disconnect_during_prefill_stops_prefill_and_frees_the_reservation")
EARLY_ENDS = "tests/e2e/test_e2e_edge.py::test_every_early_end_frees_the_reservation_at_once"
GREEDY = "tests/e2e/test_e2e_duet_up.py::test_greedy_answers_equal_the_offline_engine"
EXPIRES = _unit("test_a_handoff_past_its_capabilitys_lifetime_stops_writing_and_aborts")
LEASE = _unit("test_a_handoff_whose_decode_left_and_went_silent_is_cancelled_when_its_lease_lapses")
PARTITIONED = "tests/disagg/test_leases.py::test_a_transfer_to_a_stopped_decode_worker_is_cancelled_on_both_sides"
REVOKED = _unit("test_a_revoke_from_decode_cancels_the_transfer_or_refuses_the_reservation")
GATEWAY_STOPPED = "tests/disagg/test_leases.py::test_a_stopped_gateway_strands_no_decode_pages"

M = Move
OUTGOING = StateTable("outgoing", S.PREFILLING, [
    M(S.PREFILLING, E.FIRST_TOKEN, S.TAIL, "decode-after-notice", (HAPPY, GREEDY)),
    M(S.PREFILLING, E.CANCEL, S.CANCELLING, "disconnect-cancels", (CANCEL, DISCONNECT, EARLY_ENDS)),
    M(S.PREFILLING, E.ENDED, S.CANCELLING, "aborts-free-all", (ENDED,)),
    M(S.PREFILLING, E.STREAM_FAILED, S.FAILED, "dead-decode-fails-writes", (WRITE_FAILS, DECODE_KILLED)),
    M(S.PREFILLING, E.EXPIRE, S.CANCELLING, "unclaimed-expires", (EXPIRES,)),
    M(S.PREFILLING, E.LEASE_LAPSED, S.CANCELLING, "lease-lapses-freed", (LEASE, REVOKED, PARTITIONED,
                                                                          GATEWAY_STOPPED)),

    M(S.TAIL, E.FINISH, S.FINISHING, "decode-after-notice", (HAPPY, GREEDY)),
    M(S.TAIL, E.DECLINE, S.DECLINING, "held-prefix-checked", (DECLINE, HELD_PREFIX)),
    M(S.TAIL, E.CANCEL, S.CANCELLING, "disconnect-cancels", (CANCEL,)),
    M(S.TAIL, E.STREAM_FAILED, S.FAILED, "dead-decode-fails-writes", (WRITE_FAILS,)),
    M(S.TAIL, E.EXPIRE, S.CANCELLING, "unclaimed-expires", (EXPIRES,)),
    M(S.TAIL, E.LEASE_LAPSED, S.CANCELLING, "lease-lapses-freed", (LEASE, PARTITIONED)),

    M(S.FINISHING, E.STREAM_DONE, S.DONE, "decode-after-notice", (HAPPY, GREEDY)),
    M(S.FINISHING, E.STREAM_FAILED, S.FAILED, "dead-decode-fails-writes", (WRITE_FAILS,)),
    M(S.FINISHING, E.CANCEL, S.CANCELLING, "disconnect-cancels", (CANCEL,)),
    M(S.FINISHING, E.LEASE_LAPSED, S.CANCELLING, "lease-lapses-freed", (LEASE, PARTITIONED)),

    M(S.DECLINING, E.STREAM_DONE, S.DONE, "held-prefix-checked", (DECLINE, HELD_PREFIX)),
    M(S.DECLINING, E.STREAM_FAILED, S.FAILED, "dead-decode-fails-writes", (WRITE_FAILS,)),
    M(S.DECLINING, E.CANCEL, S.CANCELLING, "disconnect-cancels", (CANCEL,)),
    M(S.DECLINING, E.LEASE_LAPSED, S.CANCELLING, "lease-lapses-freed", (LEASE,)),

    # stop_writing (any thread) then cancel (the loop): the second changes nothing
    M(S.CANCELLING, E.CANCEL, S.CANCELLING, "disconnect-cancels", (CANCEL,)),
    M(S.CANCELLING, E.STREAM_DONE, S.CANCELLED, "disconnect-cancels", (CANCEL, DISCONNECT)),
    # the abort notice could not be sent: decode frees the reservation by its own rules
    M(S.CANCELLING, E.STREAM_FAILED, S.CANCELLED, "no-reuse-while-writing", (CANCEL,)),
])
