"""What token-in did for one call, reported once so metrics can count what it avoided.

The token-in flow calls `Pipeline.report_token_in` once per token-in call it stages, with a
`TokenInReport`; the proxy's metrics subscribe (`Pipeline.on_token_in`) and count calls by
result, and the calls whose plain rendering would have diverged from the tokens sent.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EXTENDED", "NEW_SEGMENT", "TokenInReport"]

#: The call's prompt extended the previous call's prompt + completion.
EXTENDED = "extended"
#: The call started a new segment (the plain rendering was sent; `TokenInReport.reason` says why).
NEW_SEGMENT = "new_segment"


@dataclass(frozen=True, slots=True)
class TokenInReport:
    """One token-in call: its `result` (`EXTENDED` or `NEW_SEGMENT`), the segment break's
    `reason` for a new segment ("" otherwise), `plain_divergence`: the first prompt position
    where the plain rendering would have differed from the tokens sent (None: it would not have,
    or it was not measured), and `beside`: "" when generate waited for the request's own
    render, ``passed`` when it was sent beside it and kept, else why it was aborted (a reason
    of `BESIDE_MISMATCHES`), and `placed`: for an extended call, how its appended tokens were
    placed (``rendering``: the request's own render alone; ``dummies``: the bridge's dummy
    renders)."""

    rollout_id: str
    call_id: str
    result: str
    reason: str = ""
    plain_divergence: int | None = None
    beside: str = ""
    placed: str = ""
