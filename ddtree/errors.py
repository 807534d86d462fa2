"""The one exception type users catch: every user mistake becomes a DDTreeError with a one-line message."""


class DDTreeError(ValueError):
    """Bad input (model directories, drafter/target mismatch, sampling values, prompt length)."""
