"""How deeply a JSON text nests, without parsing it (parsers recurse, and a deep text overflows them).

NOTE: ``json.loads`` of ``[[[[...]]]]`` a few thousand levels deep raises
``RecursionError``, and a text just under that limit still overflows a chat
template's ``tojson`` later. Requests carry JSON inside strings (an earlier
tool call's ``arguments``): checked with this scan first, they get a 400.
"""

from __future__ import annotations

__all__ = ["MAX_JSON_DEPTH", "json_too_deep"]

MAX_JSON_DEPTH = 100
"""The deepest nesting of arrays and objects accepted in a JSON text carried by a request."""

_OPEN = frozenset("[{")
_CLOSE = frozenset("]}")


def json_too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``text`` nests arrays/objects deeper than ``limit`` (brackets inside strings do not count).

    Linear in the text, stops at the first level past ``limit``; a text with
    at most ``limit`` opening brackets in all is answered without a scan.
    """
    if text.count("[") + text.count("{") <= limit:
        return False
    depth = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif c in _CLOSE:
            depth -= 1
    return False
