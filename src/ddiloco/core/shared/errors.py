"""Errors that reach the user as one line, never as a traceback."""


class DdilocoError(Exception):
    """Base class: the CLI prints ``ddiloco: error: <message>`` and exits non-zero."""


class ConfigError(DdilocoError, ValueError):
    """A configuration value is invalid; the message names the key and the value."""


class ParameterError(DdilocoError, ValueError):
    """A model parameter does not fit the learner bound to it (replaced, reshaped, moved, cast,
    not contiguous, or none at all); the message names the parameter and what is wrong."""
