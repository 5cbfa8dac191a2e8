"""Python literals for generated source: a value a caller supplied, written so it stays a value."""

from __future__ import annotations


def python_string(value: str) -> str:
    """``value`` as a double-quoted Python string literal.

    Built on ``repr``, so every control or non-printable character (a newline, ``\\x1c``,
    U+2028) is an escape, never a raw character that could end a line or the literal.
    """
    body = repr(value)
    if body[0] == '"':  # repr chose double quotes: the value holds ' and no "
        return body
    # Single-quoted by repr: inside, ' is escaped and " is bare; swap the roles.
    inner = body[1:-1].replace("\\'", "'").replace('"', '\\"')
    return f'"{inner}"'
