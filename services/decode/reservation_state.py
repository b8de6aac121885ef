"""The lifecycle of a decode reservation: pages set aside for a prompt a prefill worker
writes, until they join a running request (CONSUMED) or go back to the pool (FREED).

ReservationBook (reservations.py) is the only caller: it turns RPCs, completion notices,
the registry's view of the writer and its own deadlines into the events below, and frees
the pages on the one move into FREED. The received pages have no lifecycle of their own:
once CONSUMED they are a running request's (Engine.add_prefilled).

    RESERVED     a write may land; nobody waits for it yet (its capability's deadline)
    CLAIMED      a Generate waits for the notice (the writer may still be writing)
    WRITTEN      every rank's done notice arrived; nobody claims it yet (claim deadline)
    DECLINED     the writer wrote nothing but answered (its held-prefix check failed): the
                 claimer recomputes; nobody claims it yet (claim deadline)
    ORPHANED     its writer left the registry before any notice: no write can land; nobody
                 claims it (claim deadline)
    NOTICED      claimed with the notice in hand: the Generate joins (done) or recomputes
    QUARANTINED  cancelled, or unclaimed past its capability's lifetime or its lease (its holder
                 stopped renewing it), while a write may still land: freed by a notice, the writer's leave, an unsent cancel or the
                 quarantine deadline
    CONSUMED     the pages belong to a running request
    FREED        the pages are back in the pool

Each move names its failure rule (docs/ARCHITECTURE.md, "Failure rules and the tests that
prove them") and the tests that hold it."""
from __future__ import annotations

from enum import Enum

from shared.state_table import Move, StateTable


class ReservationState(Enum):
    RESERVED = "reserved"
    CLAIMED = "claimed"
    WRITTEN = "written"
    DECLINED = "declined"
    ORPHANED = "orphaned"
    NOTICED = "noticed"
    QUARANTINED = "quarantined"
    CONSUMED = "consumed"
    FREED = "freed"


class ReservationEvent(Enum):
    CLAIM = "claim"  # a Generate arms its waiter
    NOTICE_DONE = "notice_done"  # every rank's notice arrived: all written
    NOTICE_DECLINED = "notice_declined"  # ... nothing written, the answer stands: recompute
    NOTICE_ABORT = "notice_abort"  # ... the writer gave up
    WRITER_GONE = "writer_gone"  # the writer left the registry
    WRITER_BACK = "writer_back"  # ... and is in it again
    CANCEL = "cancel"  # its caller gives up; a write may be in flight
    CANCEL_UNSENT = "cancel_unsent"  # its caller gives up and never gave it to a writer
    DEADLINE = "deadline"  # the state's deadline passed (Reservation.deadline)
    LEASE_LAPSED = "lease_lapsed"  # unclaimed, and its holder stopped renewing it (Reservation.lease_until)
    CONSUME = "consume"  # the Generate joins the running batch in these pages


S, E = ReservationState, ReservationEvent
CLAIMED_STATES = frozenset({S.CLAIMED, S.NOTICED})  # a Generate holds it
NOTICE_EVENTS = {"done": E.NOTICE_DONE, "declined": E.NOTICE_DECLINED, "abort": E.NOTICE_ABORT}
# the states that watch their writer in the registry, and the move its liveness makes there
WRITER_WATCH = {(S.RESERVED, False): E.WRITER_GONE, (S.ORPHANED, True): E.WRITER_BACK,
                (S.QUARANTINED, False): E.WRITER_GONE}
WATCHED = frozenset(state for state, _ in WRITER_WATCH)
# unclaimed states: their holder (the gateway) renews a lease on them until a Generate claims
# them; one it stops renewing is handled like an expired capability
LEASED = frozenset({S.RESERVED, S.WRITTEN, S.DECLINED, S.ORPHANED})

UNIT = "tests/disagg/test_reservation_lifecycle.py::"
EVERY_MOVE = UNIT + "test_every_move_leads_where_the_table_says"
WORKERS = "tests/disagg/test_failures_workers.py::"
MISSING_NOTICE = WORKERS + "test_missing_notice_makes_decode_recompute_the_prefill"
UNCLAIMED = WORKERS + "test_unclaimed_reservation_is_freed_after_the_claim_timeout"
HELD_PREFIX = WORKERS + "test_a_held_prefix_that_is_not_the_prompts_makes_decode_recompute"
PREFILL_KILLED = WORKERS + "test_prefill_killed_after_reservation"
EXPIRES = UNIT + "test_an_unclaimed_reservation_is_quarantined_at_its_capabilitys_deadline"
EXPIRES_E2E = ("tests/disagg/test_reservation_capability.py::"
               "test_an_unclaimed_reservation_is_freed_by_its_deadline_whatever_the_caller_asked")
LEASE_UNIT = UNIT + "test_a_lapsed_lease_quarantines_or_frees_like_an_expired_capability"
LEASES = "tests/disagg/test_leases.py::"
LEASE_RAW = LEASES + "test_a_reservation_nobody_renews_comes_back_within_its_lease_and_its_writer_refuses_it"
LEASE_GATEWAY = LEASES + "test_a_stopped_gateway_strands_no_decode_pages"
LEASE_WRITTEN = LEASES + "test_a_written_reservation_nobody_claims_is_freed_when_its_lease_lapses"
EARLY_ENDS = "tests/e2e/test_e2e_edge.py::test_every_early_end_frees_the_reservation_at_once"
GATEWAY_KILLED = "tests/disagg/test_failures_pair.py::test_gateway_killed_mid_request_leaves_no_work_on_the_pods"
GREEDY = "tests/e2e/test_e2e_duet_up.py::test_greedy_answers_equal_the_offline_engine"
FIRST_TOKEN_ENDS = "tests/e2e/test_e2e_duet_up.py::test_early_endings_free_every_page"


def _moves(src: S, rule: str, tests: tuple[str, ...], **dst_by_event: S) -> list[Move]:
    return [Move(src, E[event.upper()], dst, rule, (EVERY_MOVE,) + tests) for event, dst in dst_by_event.items()]


RESERVATION = StateTable("reservation", S.RESERVED, [
    # a Generate waits for the notice with a deadline, then joins or recomputes
    *_moves(S.RESERVED, "recompute-on-missing-notice", (MISSING_NOTICE,), claim=S.CLAIMED),
    *_moves(S.RESERVED, "unclaimed-freed", (UNCLAIMED,), notice_done=S.WRITTEN),
    *_moves(S.RESERVED, "held-prefix-checked", (HELD_PREFIX,), notice_declined=S.DECLINED),
    # the writer gave up (its RPC failed): no Generate will come
    *_moves(S.RESERVED, "unclaimed-freed", (GATEWAY_KILLED,), notice_abort=S.FREED),
    *_moves(S.RESERVED, "unclaimed-freed", (), writer_gone=S.ORPHANED),
    *_moves(S.RESERVED, "no-reuse-while-writing", (PREFILL_KILLED,), cancel=S.QUARANTINED),
    *_moves(S.RESERVED, "unsent-freed-at-once", (EARLY_ENDS,), cancel_unsent=S.FREED),
    # nobody claimed it within its capability's lifetime: its writer stops then too
    *_moves(S.RESERVED, "unclaimed-expires", (EXPIRES, EXPIRES_E2E), deadline=S.QUARANTINED),
    # its holder stopped renewing it (a gateway that died or stopped): the same, sooner
    *_moves(S.RESERVED, "lease-lapses-freed", (LEASE_UNIT, LEASE_RAW, LEASE_GATEWAY), lease_lapsed=S.QUARANTINED),

    *_moves(S.CLAIMED, "decode-after-notice", (), notice_done=S.NOTICED),
    *_moves(S.CLAIMED, "recompute-on-missing-notice", (), notice_declined=S.NOTICED, notice_abort=S.NOTICED),
    *_moves(S.CLAIMED, "no-reuse-while-writing", (MISSING_NOTICE,), cancel=S.QUARANTINED),
    *_moves(S.CLAIMED, "unsent-freed-at-once", (), cancel_unsent=S.FREED),

    *_moves(S.WRITTEN, "decode-after-notice", (GREEDY,), claim=S.NOTICED),
    *_moves(S.WRITTEN, "first-token-ends", (FIRST_TOKEN_ENDS,), cancel=S.FREED),
    *_moves(S.WRITTEN, "unsent-freed-at-once", (), cancel_unsent=S.FREED),
    *_moves(S.WRITTEN, "unclaimed-freed", (UNCLAIMED,), deadline=S.FREED),
    # its holder stopped renewing it and no write can land any more: freed at once
    *_moves(S.WRITTEN, "lease-lapses-freed", (LEASE_UNIT, LEASE_WRITTEN), lease_lapsed=S.FREED),

    *_moves(S.DECLINED, "held-prefix-checked", (HELD_PREFIX,), claim=S.NOTICED),
    *_moves(S.DECLINED, "unclaimed-freed", (), cancel=S.FREED, cancel_unsent=S.FREED, deadline=S.FREED),
    *_moves(S.DECLINED, "lease-lapses-freed", (LEASE_UNIT,), lease_lapsed=S.FREED),

    *_moves(S.ORPHANED, "recompute-on-missing-notice", (), claim=S.CLAIMED),
    *_moves(S.ORPHANED, "no-reuse-while-writing", (), writer_back=S.RESERVED, notice_done=S.WRITTEN,
            notice_declined=S.DECLINED),
    *_moves(S.ORPHANED, "unclaimed-freed", (), notice_abort=S.FREED, cancel=S.FREED, cancel_unsent=S.FREED,
            deadline=S.FREED),
    *_moves(S.ORPHANED, "lease-lapses-freed", (LEASE_UNIT,), lease_lapsed=S.FREED),

    *_moves(S.NOTICED, "decode-after-notice", (GREEDY,), consume=S.CONSUMED),
    # a notice that is not a usable done (aborted, declined, another first token): recompute
    *_moves(S.NOTICED, "recompute-on-missing-notice", (HELD_PREFIX,), cancel=S.FREED),
    *_moves(S.NOTICED, "unsent-freed-at-once", (), cancel_unsent=S.FREED),

    # the first cancel starts the quarantine; later ones change nothing
    *_moves(S.QUARANTINED, "no-reuse-while-writing", (PREFILL_KILLED,), cancel=S.QUARANTINED,
            writer_gone=S.FREED),
    *_moves(S.QUARANTINED, "no-reuse-while-writing", (MISSING_NOTICE,), deadline=S.FREED),
    *_moves(S.QUARANTINED, "no-reuse-while-writing", (), notice_done=S.FREED, notice_declined=S.FREED,
            notice_abort=S.FREED),
    *_moves(S.QUARANTINED, "unsent-freed-at-once", (), cancel_unsent=S.FREED),
])
