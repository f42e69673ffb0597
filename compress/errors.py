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



def validation_error(e, prefix: str = "", option: bool = False, root: str = "") -> ConfigError:
    """One-line :class:`ConfigError` from a pydantic ``ValidationError``: ``prefix: field: message``
    for the first error (pydantic's "Value error, " prefix dropped).

    Args:
        e: the ``ValidationError``.
        prefix: what was being validated, e.g. ``"recipe"`` or ``"merge config m.yaml"``.
        option: name the field as a command-line option (``--group-size``) instead of a dotted path.
        root: dotted path the field path continues, e.g. ``"steps[0].ecf8"``.
    """
    err = e.errors()[0]
    loc = [str(p) for p in err["loc"]]
    if option:
        where = "--" + loc[0].replace("_", "-") if loc else ""
    else:
        where = ".".join([root] * bool(root) + loc)
    msg = err["msg"].removeprefix("Value error, ")
    return ConfigError(": ".join(x for x in (prefix, where, msg) if x))
