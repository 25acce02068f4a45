"""The aiohttp server: the chat route, pass-through routes, control API, metrics, settings."""
