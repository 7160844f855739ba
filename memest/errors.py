"""Errors a user can act on. The CLI prints them as one line and exits with their code."""

EXIT_OK = 0
EXIT_DOES_NOT_FIT = 1
EXIT_USAGE = 2


class MemestError(Exception):
    """A problem the user can fix: bad flags, a model file that cannot be loaded or traced.

    The message names the thing and the fix; the CLI prints it on one line and exits with ``exit_code``.
    """

    exit_code = EXIT_USAGE


class ModelLoadError(MemestError):
    """The model file or config could not be loaded."""


class TraceError(MemestError):
    """The model was loaded but its training step could not run on fake tensors."""


class DoesNotFitError(MemestError):
    """A preflight check (memest.preflight, memest.integrations' callbacks) found that the step will not fit the
    device's budget, and was asked to raise (``on_fail="raise"``)."""

    exit_code = EXIT_DOES_NOT_FIT
