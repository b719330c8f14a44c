"""Errors fpemu raises for bad input that the CLI reports with exit code 2."""


class FpemuInputError(ValueError):
    """Bad input from a file or the command line: the message names the file, key and expectation."""
