"""Errors that name the argument as data.

Every check on a user's input raises an ``ArgumentError``: its message reads
``<argument>: expected ..., got ...`` and ``err.arg`` holds the argument's name, so a front-end
can say it in its own words (the CLI as ``--S``, the vLLM plugin as
``additional_config["sere"]["S"]``) without parsing the message. ``argument_error`` builds one
that is also the usual built-in kind (``ValueError``, ``TypeError``, ``FileNotFoundError``), so
``except ValueError`` keeps working.
"""

from __future__ import annotations


class ArgumentError(Exception):
    """A bad argument. ``arg``: its name (``S``, ``sim``, ``max_tokens``); ``str(err)`` starts with
    it, possibly followed by a ``[layer]`` suffix (``S[3]: expected ...``)."""

    def __init__(self, arg: str, message: str):
        if not message.startswith(arg):
            raise AssertionError(f"an ArgumentError's message starts with its argument {arg!r}: {message!r}")
        self.arg = arg
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self.args[0])

    def said_as(self, name: str) -> str:
        """The message with its argument spelled ``name`` (``--S[3]: expected ...``)."""
        return name + self.message[len(self.arg):]

    def renamed(self, arg: str, *, suffix: str = "", words: dict[str, str] | None = None) -> "ArgumentError":
        """The same error (same built-in kind) for argument ``arg`` (``suffix`` after it, e.g. ``[3]``);
        ``words`` replaces other names in the text (a config field said as its keyword)."""
        rest = self.message[len(self.arg):]
        for old, new in (words or {}).items():
            rest = rest.replace(old, new)
        return argument_error(arg, f"{arg}{suffix}{rest}", self._kind())

    def _kind(self) -> type:
        return next((kind for kind in _KINDS if isinstance(self, kind)), ValueError)

    def __reduce__(self):  # picklable across processes (engine workers): (arg, message), not args
        return type(self), (self.arg, self.message)


class ArgumentValueError(ArgumentError, ValueError):
    pass


class ArgumentTypeError(ArgumentError, TypeError):
    pass


class ArgumentFileNotFoundError(ArgumentError, FileNotFoundError):
    pass


_KINDS = {FileNotFoundError: ArgumentFileNotFoundError, TypeError: ArgumentTypeError, ValueError: ArgumentValueError}


def argument_error(arg: str, message: str, kind: type = ValueError) -> ArgumentError:
    """An ``ArgumentError`` that is also a ``kind`` (``ValueError``, ``TypeError``, ``FileNotFoundError``)."""
    if kind not in _KINDS:
        raise AssertionError(f"argument_error: kind must be one of {list(_KINDS)}, got {kind!r}")
    return _KINDS[kind](arg, message)
