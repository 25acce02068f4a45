"""The upstream vLLM behind one client: its HTTP calls and the facts fetched about it."""
