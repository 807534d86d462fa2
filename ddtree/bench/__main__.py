"""``python -m ddtree.bench ...`` = ``ddtree bench ...``."""

from ddtree.bench.cli import main

main()
