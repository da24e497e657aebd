"""The one error a ``graphkeeper`` subcommand raises to stop with a message.

A module of its own so that the commands (``client.py``) and the entry point that prints it
(``cli.py``) both import it and neither imports the other: under ``python -m graphkeeper.cli``
the entry point is ``__main__``, and a class defined there would not be the one the commands raise.
"""

from __future__ import annotations


class CommandError(Exception):
    """What a command prints as ``error: ...`` before it exits with status 2 (``cli.main`` does both)."""
