"""Text from a store made safe for a terminal.

A store may come from someone else, and its strings (rollout ids in a crafted file, model
output, reasons) are printed to a person's terminal: an ANSI or OSC escape sequence in them
would move the cursor, rewrite earlier lines, set the window title or plant a hyperlink.
`escape_text` shows every control character as a visible escape instead.
"""

from __future__ import annotations

import re

__all__ = ["escape_text"]

# C0 controls (tab and newline included: one value is one line), DEL, C1 controls (U+0080 to
# U+009F: 8-bit CSI and OSC), and the bidirectional overrides and isolates, which reorder what
# follows them on the line.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def _visible(match: re.Match[str]) -> str:
    c = match.group()
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def escape_text(text: str) -> str:
    """`text` with each control character shown as ``\\xNN`` (``\\uNNNN`` for the bidi
    controls); printable text, any script, is kept as it is."""
    return _UNSAFE.sub(_visible, text)
