"""``python -m ddtree ...`` is ``ddtree ...``."""

from ddtree.cli import main

main()
