"""Runners for the long reliability checks and the end-to-end environments (not shipped).

A package run from the repository root (``python -m scripts.soak``) so that it can import the
test support (``tests.support``) without editing ``sys.path``; see tests/__init__.py.
"""
