"""``python -m coinrag.flows.cli``: the ``coinrag`` command."""

from coinrag.flows.cli import main

main()
