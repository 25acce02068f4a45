"""Test doubles shipped with the package: the fake vLLM."""
