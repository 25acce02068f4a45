"""`serve` runs the cyclic collector rarely and never over what start-up built (in a child
process: the test process keeps its own collector settings)."""

from __future__ import annotations

import subprocess
import sys

from capture_proxy.server.collector import THRESHOLDS

PROBE = """
import gc
from capture_proxy.server.collector import tune_for_serving
assert gc.get_freeze_count() == 0
tune_for_serving()
print(gc.get_threshold(), gc.get_freeze_count() > 1000, gc.isenabled())
cycle = []
cycle.append(cycle)
del cycle
print(gc.collect() >= 1)  # cycles are still collected
"""


def test_serving_freezes_start_up_objects_and_raises_the_young_threshold() -> None:
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    assert out[0] == f"{THRESHOLDS} True True"
    assert out[1] == "True"
