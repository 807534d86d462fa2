"""Text held back while it may be completing something: stop strings (``output``) and the server's tool-call
and reasoning markers (``server.tool_parsers``, ``server.reasoning``). No third-party import: ``ddtree
serve --help`` reads the parsers' names without loading torch."""


def overlap(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``: the characters that
    must wait for more text before they can be handed out."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
