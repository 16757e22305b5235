"""Errors in what the user gave us (config, files, command line): reported as one line, exit 2."""


class InputError(ValueError):
    """Bad user input; the message says what is wrong and what to change."""
