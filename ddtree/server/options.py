"""``ddtree serve``'s flags, generated from ``ServerConfig``'s fields (and its ``Limits``'), in a module that
imports nothing heavy: building the command line (``ddtree --help``) loads no web framework and no model
code."""

from __future__ import annotations

import argparse

from ddtree.config import add_field_flags, field_flags
from ddtree.server.config import Limits, ServerConfig


def add_server_options(p: argparse.ArgumentParser) -> None:
    """Every ServerConfig flag, with the fields' defaults (``dest`` is the field); the limits' flags follow
    the access flags, as ``limits`` follows them in the config."""
    for name in field_flags(ServerConfig):
        add_field_flags(p, ServerConfig, [name])
        if name == "allowed_origins":
            add_field_flags(p, Limits, field_flags(Limits))
