"""The agreement rule of a fleet of replicas: which facts every replica must serve, and what a
replica that does not is called. No I/O: `ReplicaSet` feeds it each probe round's answers.

A replica takes calls only when it serves the fleet's model name, vLLM version, tokenizer
fingerprint and engine weight version. Each of these facts is, in that order, the configured
one when there is one (``--served-model`` for the model; the weight version this proxy last
pushed to the engines), else the one a strict majority of the replicas still in the running
give. A replica that differs is out, with the state that says which fact it differs in; when a
fact has no majority (two replicas that disagree, or a three-way split), every replica still in
the running is ``held``: the proxy does not guess which one is right. The rule runs again on
every probe round, so a fleet re-forms as replicas come and go.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["Facts", "FleetFacts", "ReplicaState", "Verdict", "judge"]

ReplicaState = Literal[
    "starting",
    "healthy",
    "unreachable",
    "down",
    "missing_route",
    "wrong_model",
    "quarantined",
    "stale_weights",
    "held",
]

#: The fact names, in the order they are decided, and the state of a replica that differs.
_ORDER: tuple[tuple[str, ReplicaState], ...] = (
    ("model", "wrong_model"),
    ("version", "quarantined"),
    ("fingerprint", "quarantined"),
    ("weights", "stale_weights"),
)
_WORDS = {
    "model": "model name",
    "version": "vLLM version",
    "fingerprint": "tokenizer fingerprint",
    "weights": "engine weight version",
}


@dataclass(frozen=True, slots=True)
class Facts:
    """What one replica's probe said. `weights` is its engine's weight version
    (``/weight_info``), None when the route is not served (vLLM without dev mode)."""

    model: str
    version: str
    fingerprint: str
    weights: str | None

    def get(self, fact: str) -> str | None:
        value: str | None = getattr(self, fact)
        return value


@dataclass(frozen=True, slots=True)
class FleetFacts:
    """The facts the fleet agreed on (None: not decided) and, when it could not agree, why."""

    model: str | None = None
    version: str | None = None
    fingerprint: str | None = None
    weights: str | None = None
    #: "" when every fact was decided, else the sentence naming the fact without a majority.
    problem: str = ""

    def to_dict(self) -> dict[str, object]:
        return {
            "model": self.model,
            "version": self.version,
            "fingerprint": self.fingerprint,
            "engine_weight_version": self.weights,
            "agreed": not self.problem,
            "problem": self.problem,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    state: ReplicaState
    problem: str


def _shown(value: str | None) -> str:
    if value is None:
        return "not reported"
    return value if len(value) <= 24 else value[:19] + "…"


def judge(
    answered: Sequence[tuple[str, Facts]],
    *,
    model: str = "",
    weights: str | None = None,
) -> tuple[FleetFacts, dict[str, Verdict]]:
    """The fleet's facts and a verdict for each replica of `answered` (``(name, facts)`` of
    the replicas whose probe answered). `model` and `weights` are the configured model name
    and engine weight version ("" / None: decided by majority)."""
    configured: dict[str, str | None] = {"model": model or None, "weights": weights}
    running = list(answered)
    decided: dict[str, str | None] = {}
    verdicts: dict[str, Verdict] = {}
    problem = ""
    for fact, state in _ORDER:
        if not running:
            break
        want = configured.get(fact)
        if want is None:
            counts = Counter(f.get(fact) for _, f in running)
            value, n = counts.most_common(1)[0]
            if fact == "weights" and value is None and n == len(running):
                decided[fact] = None  # no replica reports its weights: nothing to compare
                continue
            if 2 * n <= len(running):
                listed = "; ".join(f"{name}: {_shown(f.get(fact))}" for name, f in running)
                problem = (
                    f"no majority of the replicas agrees on the {_WORDS[fact]} ({listed}): "
                    "every replica is held until they agree"
                )
                for name, _ in running:
                    verdicts[name] = Verdict("held", problem)
                running = []
                break
            want = value
        decided[fact] = want
        source = "configured" if configured.get(fact) is not None else "the other replicas'"
        kept = []
        for name, f in running:
            if f.get(fact) == want:
                kept.append((name, f))
            else:
                verdicts[name] = Verdict(
                    state,
                    f"{_WORDS[fact]} {_shown(f.get(fact))} where the fleet's ({source}) is "
                    f"{_shown(want)}",
                )
        running = kept
    for name, _ in running:
        verdicts[name] = Verdict("healthy", "")
    fleet = FleetFacts(
        decided.get("model"),
        decided.get("version"),
        decided.get("fingerprint"),
        decided.get("weights"),
        problem,
    )
    return fleet, verdicts
