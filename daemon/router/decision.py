"""Re-export: the routing-decision wire types live in ``dynamod.shared.protocol.routing`` so the
console decodes them typed without importing the daemon."""

from dynamod.shared.protocol.routing import (  # noqa: F401
    HEADER_MAX_CANDIDATES,
    HEADER_NAME,
    REASON_LOWEST_COST,
    REASON_ONLY_CANDIDATE,
    REASON_SAMPLED,
    REASON_TIE_RANDOM,
    REASON_TIE_SMALLEST_TREE,
    CandidateScore,
    DisaggInfo,
    RoutingDecision,
)
