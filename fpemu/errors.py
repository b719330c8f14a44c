"""Errors fpemu raises: bad input that the CLI reports with exit code 2, and a framework's refusal of a call
written against its older API."""


class FpemuInputError(ValueError):
    """Bad input from a file or the command line: the message names the file, key and expectation."""


class RefusedCall(Exception):
    """The framework refused a call an adapter makes as the framework's older API took it (Keras 3.12
    refuses ``LossScaleOptimizer(clipnorm=)`` with a ValueError): an api change, whatever the framework
    raised.  The adapter raises it from the framework's exception (its ``__cause__``), which the job's
    result line then names; a TypeError or AttributeError needs no wrapping."""
