"""The spool's one exception (its own module so the low-level readers can raise it too)."""


class SpoolFormatError(ValueError):
    """A spool file (or a group about to be written) is invalid; the message says why."""
