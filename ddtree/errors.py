"""The one exception type users catch: every user mistake becomes a DDTreeError with a one-line message."""


class DDTreeError(ValueError):
    """Bad input (model directories, drafter/target mismatch, sampling values, prompt length)."""


class RequestFailed(Exception):
    """One request failed inside an engine step (the engine traced the failure to it; every other request
    went on). Not a DDTreeError: its input passed every check, so the fault is the server's."""
