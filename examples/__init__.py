"""Examples of capture-proxy in use, runnable from the repository root (``python -m examples.X``).

Each is a package whose modules a test runs, so what the examples show is what CI checks.
"""
