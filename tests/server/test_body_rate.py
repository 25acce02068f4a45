"""The per-rollout body rate (`server.body_rate`) remembers the rollouts that sent bodies
lately, not every rollout a long-running proxy served."""

from __future__ import annotations

from capture_proxy.server.body_rate import BodyRate


def test_a_rollout_whose_bucket_filled_again_is_forgotten() -> None:
    # 1 TiB/s refills a 1 KiB body in a nanosecond: by the next rollout's body it is full
    # (at the default 16 MiB/s, in 60 us; a proxy's rollouts send a body every few seconds).
    rate = BodyRate(2**40, 2 * 2**20)
    for i in range(5_000):
        assert rate.take(f"rollout-{i}", 1024) is None
    assert len(rate._buckets) <= 2  # was 5,000 (up to 100,000, about 0.3 KB each)


def test_a_rollout_still_refilling_is_remembered_and_held_to_its_rate() -> None:
    rate = BodyRate(1.0, 1_000)
    assert rate.take("flood", 1_000) is None
    for i in range(100):
        assert rate.take(f"rollout-{i}", 10) is None
    assert "flood" in rate._buckets
    assert rate.take("flood", 500) == 500  # seconds until its bucket holds 500 bytes again
