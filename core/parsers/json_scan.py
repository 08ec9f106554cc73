"""A strict, resumable JSON scanner for streaming parsers: where values start and end, and where a prefix can be closed.

JSON tool-call formats (hermes, llama3_json, forced calls without a parser) stream their
arguments as the model writes them. ``JsonScanner`` reads one JSON value a character at a time
(RFC 8259, no NaN, no trailing commas, no comments), reports where keys and values begin and
end, and knows at every point whether the text so far is a *safe prefix*: one that becomes
valid JSON by appending only closing quotes and brackets (``closers``). A parser emits argument
text up to the last safe point, so a reply cut off by ``max_tokens`` or broken by a syntax error
still ends with a well-formed arguments object.

Between two safe points the container stack does not change (every push or pop lands in a safe
state), so the closers of the last safe point are the current stack's plus, when that point
was inside a string, a quote.
"""
from __future__ import annotations

import enum

_WHITESPACE = frozenset(" \t\n\r")
_DIGITS = frozenset("0123456789")
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = {"t": "true", "f": "false", "n": "null"}


class _S(enum.Enum):
    VALUE = "value"  # a value must come
    ARRAY_FIRST = "array_first"  # after '[': a value or ']'
    OBJECT_FIRST = "object_first"  # after '{': a key or '}'
    KEY = "key"  # after ',' in an object: a key
    COLON = "colon"  # after a key
    AFTER = "after"  # after a value in a container: ',' or the closer
    STRING = "string"
    ESCAPE = "escape"  # after a backslash
    UNICODE = "unicode"  # inside \uXXXX
    NUMBER = "number"
    LITERAL = "literal"  # inside true / false / null
    DONE = "done"  # the top-level value is complete
    ERROR = "error"


class _N(enum.Enum):
    """Where a number is: the states marked complete may end it."""

    SIGN = "sign"
    ZERO = "zero"  # complete
    INT = "int"  # complete
    DOT = "dot"
    FRAC = "frac"  # complete
    E = "e"
    E_SIGN = "e_sign"
    EXP = "exp"  # complete


_NUMBER_COMPLETE = frozenset({_N.ZERO, _N.INT, _N.FRAC, _N.EXP})
_SAFE = frozenset({_S.ARRAY_FIRST, _S.OBJECT_FIRST, _S.AFTER, _S.DONE})

# what ``step`` reports in ``events``: (kind, container depth of the value or key, end is exclusive)
KEY_START = "key_start"  # a key string starts at this character
KEY_END = "key_end"  # a key string ended at this character
VALUE_START = "value_start"  # a value starts at this character
VALUE_END = "value_end"  # a value ended: at this character, or just before it when ``exclusive``


class JsonScanner:
    """One JSON value, fed character by character with ``step``.

    ``events`` holds what the last ``step`` saw: ``(kind, depth, exclusive)`` tuples, where depth is
    the number of containers around the key or value (0: the top-level value).
    """

    def __init__(self) -> None:
        self._state = _S.VALUE
        self._stack: list[str] = []  # "{" or "["
        self._in_key = False
        self._hex_left = 0
        self._number = _N.SIGN
        self._literal = ""  # the rest of true / false / null still to come
        self.events: list[tuple[str, int, bool]] = []
        self.safe_in_string = False  # the last safe point was inside a value string

    @property
    def done(self) -> bool:
        return self._state is _S.DONE

    @property
    def failed(self) -> bool:
        return self._state is _S.ERROR

    @property
    def depth(self) -> int:
        return len(self._stack)

    @property
    def safe(self) -> bool:
        """Whether the text so far becomes valid JSON by appending ``closers(0)``."""
        state = self._state
        if state in _SAFE:
            return True
        if state is _S.STRING:
            return not self._in_key
        return state is _S.NUMBER and self._number in _NUMBER_COMPLETE

    def closers(self, base_depth: int) -> str:
        """What closes the value that starts inside ``base_depth`` containers, from the last safe point."""
        quote = '"' if self.safe_in_string else ""
        return quote + "".join("}" if c == "{" else "]" for c in reversed(self._stack[base_depth:]))

    def step(self, char: str) -> bool:
        """Consume one character; False (and ``failed``) when it breaks JSON."""
        self.events.clear()
        ok = self._step(char)
        if not ok:
            self._state = _S.ERROR
        elif self.safe:
            self.safe_in_string = self._state is _S.STRING
        return ok

    # -- the automaton ---------------------------------------------------------------------------

    def _step(self, c: str) -> bool:
        state = self._state
        if state is _S.STRING:
            return self._string(c)
        if state is _S.NUMBER:
            if self._number_step(c):
                return True
            if self._number not in _NUMBER_COMPLETE:
                return False
            self._end_value(exclusive=True)  # the character after a number belongs to what follows
            return self._step(c)
        if state is _S.LITERAL:
            if c != self._literal[0]:
                return False
            self._literal = self._literal[1:]
            if not self._literal:
                self._end_value(exclusive=False)
            return True
        if state is _S.ESCAPE:
            if c not in _ESCAPES:
                return False
            if c == "u":
                self._state, self._hex_left = _S.UNICODE, 4
            else:
                self._state = _S.STRING
            return True
        if state is _S.UNICODE:
            if c not in _HEX:
                return False
            self._hex_left -= 1
            if not self._hex_left:
                self._state = _S.STRING
            return True
        if state is _S.ERROR:
            return False
        if c in _WHITESPACE:
            return True
        if state is _S.DONE:
            return False
        if state in (_S.VALUE, _S.ARRAY_FIRST):
            if state is _S.ARRAY_FIRST and c == "]":
                return self._close("[")
            return self._begin_value(c)
        if state in (_S.OBJECT_FIRST, _S.KEY):
            if state is _S.OBJECT_FIRST and c == "}":
                return self._close("{")
            if c != '"':
                return False
            self.events.append((KEY_START, len(self._stack), False))
            self._state, self._in_key = _S.STRING, True
            return True
        if state is _S.COLON:
            if c != ":":
                return False
            self._state = _S.VALUE
            return True
        # AFTER
        if c == ",":
            self._state = _S.KEY if self._stack[-1] == "{" else _S.VALUE
            return True
        if c in "]}":
            return self._close("[" if c == "]" else "{")
        return False

    def _begin_value(self, c: str) -> bool:
        depth = len(self._stack)
        if c == '"':
            self.events.append((VALUE_START, depth, False))
            self._state, self._in_key = _S.STRING, False
        elif c in "{[":
            self.events.append((VALUE_START, depth, False))
            self._stack.append(c)
            self._state = _S.OBJECT_FIRST if c == "{" else _S.ARRAY_FIRST
        elif c == "-" or c in _DIGITS:
            self.events.append((VALUE_START, depth, False))
            self._state = _S.NUMBER
            self._number = _N.SIGN if c == "-" else (_N.ZERO if c == "0" else _N.INT)
        elif c in _LITERALS:
            self.events.append((VALUE_START, depth, False))
            self._state, self._literal = _S.LITERAL, _LITERALS[c][1:]
        else:
            return False
        return True

    def _string(self, c: str) -> bool:
        if c == '"':
            if self._in_key:
                self.events.append((KEY_END, len(self._stack), False))
                self._state, self._in_key = _S.COLON, False
            else:
                self._end_value(exclusive=False)
            return True
        if c == "\\":
            self._state = _S.ESCAPE
            return True
        return c >= " "  # control characters must be escaped

    def _number_step(self, c: str) -> bool:
        """Advance inside a number; False when ``c`` cannot continue it (the number may still be complete)."""
        n = self._number
        if c in _DIGITS:
            if n is _N.ZERO:
                return False
            self._number = {_N.SIGN: _N.ZERO if c == "0" else _N.INT, _N.DOT: _N.FRAC,
                            _N.E: _N.EXP, _N.E_SIGN: _N.EXP}.get(n, n)
            return True
        if c == "." and n in (_N.ZERO, _N.INT):
            self._number = _N.DOT
            return True
        if c in "eE" and n in (_N.ZERO, _N.INT, _N.FRAC):
            self._number = _N.E
            return True
        if c in "+-" and n is _N.E:
            self._number = _N.E_SIGN
            return True
        return False

    def _close(self, opener: str) -> bool:
        if not self._stack or self._stack[-1] != opener:
            return False
        self._stack.pop()
        self._end_value(exclusive=False)
        return True

    def _end_value(self, exclusive: bool) -> None:
        self.events.append((VALUE_END, len(self._stack), exclusive))
        self._state = _S.AFTER if self._stack else _S.DONE
