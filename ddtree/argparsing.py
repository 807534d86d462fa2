"""argparse as every ``ddtree`` command uses it: one-line errors and defaults shown in ``--help``.

Kept apart from ``ddtree.cli`` because ``ddtree.bench`` and ``ddtree.training`` build their parsers with it
and ``ddtree.cli`` imports them.
"""

from __future__ import annotations

import argparse

from ddtree.errors import DDTreeError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (as vLLM and HF tools do), except the uninformative None, False
    and []; descriptions and epilogs keep their line breaks, so examples read as typed."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``ddtree: error: ...``, exit 2, no usage dump) like ours."""

    def __init__(self, *args, formatter_class: type = HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        raise DDTreeError(message)


def add_draft_topk(p: argparse.ArgumentParser) -> None:
    """``--draft-topk``: named apart from the sampling ``--top-k``; ``--topk`` still works (hidden)."""
    help_ = (
        "ddtree: cap on tree candidates per depth (SGLang's --speculative-eagle-topk; default: the budget)"
    )
    p.add_argument("--draft-topk", dest="topk", type=int, default=None, metavar="K", help=help_)
    p.add_argument("--topk", dest="topk", type=int, default=None, help=argparse.SUPPRESS)
