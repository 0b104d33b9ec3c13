"""Exceptions that carry the process exit code the CLI should end with.

Exit codes used across parity:

====  ==========================================================================
code  meaning
====  ==========================================================================
0     every comparison ran and passed
1     a parity failure: bits differ, a golden does not match, or a comparison
      turned out to be vacuous (nothing was actually compared)
2     the input is unusable: bad command line or config, a golden or snapshot
      that is missing, corrupt, malformed or recorded on another platform
3     the run itself failed (a rank crashed, a collective timed out, ...)
====  ==========================================================================

Every message is meant to be one line that tells the user what is wrong and,
where there is one, what to do about it. The CLI prints ``str(error)`` and
exits with ``error.exit_code``; it never needs to print a traceback for these.
"""

from __future__ import annotations

__all__ = [
    "ParityError",
    "UsageError",
    "ConfigError",
    "GoldenError",
    "GoldenExistsError",
    "GoldenMissing",
    "GoldenStale",
    "GoldenFormatError",
    "SnapshotError",
    "RuntimeFailure",
    "MismatchError",
    "VacuousComparisonError",
]


class ParityError(Exception):
    """Base class of every error parity raises on purpose.

    Attributes:
        exit_code: the exit status a command-line entry point should use.
    """

    exit_code: int = 1

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code

    @property
    def message(self) -> str:
        """The one-line message (``str(self)``)."""
        return str(self)


class UsageError(ParityError):
    """The caller asked for something inconsistent (bad flags or arguments)."""

    exit_code = 2


class ConfigError(ParityError):
    """A scenario or config file is invalid."""

    exit_code = 2


class GoldenError(ParityError):
    """A golden record is missing, corrupt, malformed or from another platform."""

    exit_code = 2


class GoldenExistsError(GoldenError):
    """Writing a golden would replace an existing one and overwrite was not allowed."""


class GoldenMissing(GoldenError):
    """No golden for this scenario (or this configuration of it) on this platform.

    ``parity run`` reports it as golden "missing" (a pass unless ``--golden require``); commands
    that need the golden exit 2. ``others`` lists the platform ids that do have one.
    """

    def __init__(self, message: str, *, platform_id: str = "", others: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.platform_id = platform_id
        self.others = tuple(others)


class GoldenStale(GoldenError):
    """The golden was recorded for another configuration of the scenario: regenerate it."""


class GoldenFormatError(GoldenError):
    """The golden was written in a format this parity does not read: regenerate it (or upgrade)."""


class SnapshotError(ParityError):
    """A snapshot file is missing, truncated, corrupt or cannot be written."""

    exit_code = 2


class RuntimeFailure(ParityError):
    """The run under test failed (crash, timeout, collective error)."""

    exit_code = 3


class MismatchError(ParityError):
    """A comparison found differences (bits, digests, missing keys)."""

    exit_code = 1


class VacuousComparisonError(ParityError):
    """A comparison would have compared nothing, so a pass would prove nothing."""

    exit_code = 1
