"""The error a bad sampling or structured-output parameter raises, and how an error message quotes a client's
value (`shown`, which the server's messages use too)."""
from __future__ import annotations

import reprlib

# the characters of a client's value an error message quotes at most: it names the value, and a 30 MB name
# or list is not sent back (nor built) whole
MAX_SHOWN_CHARS = 40
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = MAX_SHOWN_CHARS
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxdict = 4


def shown(value) -> str:
    """`value` as an error message quotes it: a string cut to `MAX_SHOWN_CHARS` (with its length where cut),
    a container to its first few items, each cut the same way."""
    if isinstance(value, str):
        return repr(value) if len(value) <= MAX_SHOWN_CHARS else \
            f"{value[:MAX_SHOWN_CHARS]!r}... ({len(value):,} characters)"
    return _SHORT_REPR.repr(value)


class SamplingParamError(ValueError):
    """A sampling parameter out of its range; `param` names it (the OpenAI error's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param

    def __reduce__(self):       # it crosses to the frontend process
        return type(self), (self.param, str(self))
