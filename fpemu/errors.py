"""Errors fpemu raises: bad input that the CLI reports with exit code 2, and a framework's refusal of a call
written against its older API."""


class FpemuInputError(ValueError):
    """Bad input from a file or the command line: the message names the file, key and expectation."""


class RefusedCall(Exception):
    """The framework refused a call an adapter makes as the framework's older API took it (Keras 3.12
    refuses ``LossScaleOptimizer(clipnorm=)`` with a ValueError): an api change, whatever the framework
    raised.  The adapter raises it from the framework's exception (its ``__cause__``), which the job's
    result line then names; a TypeError or AttributeError needs no wrapping."""


def raised(error: BaseException) -> str:
    """``TypeName: message`` (``TypeName`` without a message) of an exception a user's code raised, for an error
    line; its message is read guardedly (a user's exception whose ``__str__`` raises must not turn a named error
    into a crash)."""
    try:
        message = str(error)
    except Exception:  # the user's __str__: whatever it raises
        message = "(no message: its __str__ raised)"
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def shown(value) -> str:
    """``repr(value)`` of a user's value, guarded as :func:`raised` is."""
    try:
        return repr(value)
    except Exception:  # the user's __repr__
        return f"a {type(value).__name__} (its __repr__ raised)"
