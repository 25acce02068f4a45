"""Text from a store made safe for a terminal.

A store may come from someone else, and its strings (rollout ids in a crafted file, model
output, reasons) are printed to a person's terminal: an ANSI or OSC escape sequence in them
would move the cursor, rewrite earlier lines, set the window title or plant a hyperlink.
Everything ``inspect`` and ``export`` print goes through `escape_text` (text) or `escape_json`
(``--json``), which show every control character as a visible escape instead.
"""

from __future__ import annotations

import re

__all__ = ["escape_json", "escape_text"]

# C0 controls, DEL, C1 controls (U+0080 to U+009F: 8-bit CSI and OSC), and the bidirectional
# overrides and isolates, which reorder what follows them on the line.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# The same, but a line's own layout (newline, tab) is kept: for whole lines of output.
_UNSAFE_IN_LAYOUT = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
# What JSON leaves raw inside a string (it escapes C0 itself).
_UNSAFE_IN_JSON = re.compile("[\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    c = match.group()
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_text(text: str, *, keep_layout: bool = False) -> str:
    """`text` with each control character shown as ``\\xNN`` (``\\uNNNN`` for the bidi
    controls); printable text, any script, is kept as it is. ``keep_layout=True`` keeps
    newlines and tabs (for lines the program itself laid out)."""
    return (_UNSAFE_IN_LAYOUT if keep_layout else _UNSAFE).sub(_visible, text)


def escape_json(text: str) -> str:
    """JSON text with the control characters JSON allows raw in strings (DEL, C1, bidi) written
    as ``\\uNNNN`` escapes: the same JSON value, safe on a terminal."""
    return _UNSAFE_IN_JSON.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
