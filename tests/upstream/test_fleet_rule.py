"""The agreement rule alone (`capture_proxy.upstream.fleet.judge`): which facts a fleet keeps and
what each replica that differs is called; the proxy's use of it is in test_fleet_agreement.py."""

from __future__ import annotations

from capture_proxy.upstream.fleet import Facts, judge

GOOD = Facts("policy", "0.32.0", "sha256:aa", "9")


def _states(answered: list[tuple[str, Facts]], **configured: str) -> dict[str, str]:
    _, verdicts = judge(answered, **configured)
    return {name: v.state for name, v in verdicts.items()}


def test_a_replica_of_another_model_does_not_vote_on_the_weights() -> None:
    answered = [
        ("a", GOOD),
        ("b", Facts("policy", "0.32.0", "sha256:aa", "8")),
        ("c", Facts("other", "0.32.0", "sha256:aa", "8")),
    ]
    # Weights 8 would win 2:1 if c voted; without it, 9 and 8 tie: no majority.
    fleet, verdicts = judge(answered)
    assert {n: v.state for n, v in verdicts.items()} == {
        "a": "held",
        "b": "held",
        "c": "wrong_model",
    }
    assert fleet.model == "policy"
    assert fleet.weights is None
    assert fleet.problem.startswith("no majority of the replicas agrees on the engine weight")


def test_configured_facts_win_over_the_majority() -> None:
    stale = Facts("policy", "0.32.0", "sha256:aa", "default")
    answered = [("a", stale), ("b", stale), ("c", GOOD)]
    assert _states(answered) == {"a": "healthy", "b": "healthy", "c": "stale_weights"}
    assert _states(answered, weights="9") == {
        "a": "stale_weights",
        "b": "stale_weights",
        "c": "healthy",
    }


def test_weights_are_not_compared_when_no_replica_reports_them() -> None:
    plain = Facts("policy", "0.32.0", "sha256:aa", None)
    fleet, verdicts = judge([("a", plain), ("b", plain)])
    assert {v.state for v in verdicts.values()} == {"healthy"}
    assert fleet.weights is None
    assert fleet.problem == ""


def test_a_lone_replica_is_its_own_majority_and_a_tie_holds_both() -> None:
    assert _states([("a", GOOD)]) == {"a": "healthy"}
    odd = Facts("policy", "0.31.0", "sha256:aa", "9")
    assert _states([("a", GOOD), ("b", odd)]) == {"a": "held", "b": "held"}
    assert _states([("a", GOOD), ("b", odd), ("c", GOOD)])["b"] == "quarantined"
