"""Error hierarchy of compress.

Every error a user can cause is a :class:`CompressError`; the CLI maps each class to one exit
code (STYLE.md): 1 runtime failure, 2 usage or config error, 3 verification failed. Messages are
one line: what was expected, what was found, and the fix.
"""

from __future__ import annotations


class CompressError(Exception):
    """Base class of every error compress raises on purpose. Exit code 1."""

    exit_code = 1


class ConfigError(CompressError):
    """Bad options, recipe fields or paths given by the user. Exit code 2."""

    exit_code = 2


class FormatError(CompressError):
    """A file on disk does not follow its format (truncated, hostile header, stale index). Exit code 1."""

    exit_code = 1


class UnsupportedError(CompressError):
    """A valid input that this version cannot handle (dtype, architecture). Exit code 2."""

    exit_code = 2


class VerificationError(CompressError):
    """A decoded tensor or index does not equal the original. Exit code 3."""

    exit_code = 3
