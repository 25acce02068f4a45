"""``capture-proxy inspect``: views of a store built as data, drawn as tables or JSON."""
