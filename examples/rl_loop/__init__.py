"""The RL loop closed on capture-proxy: rollouts, grades, a checked training step, new weights.

Read docs/rl-loop.md; run ``python -m examples.rl_loop --help``. `loop.run_loop` is the
driver, `agent` the scripted agent, `batch.take_batch` the trainer's read step and `trainer.py`
the trainer (run with an interpreter that has torch and transformers).
"""
