"""What the command lines share: a count as an argparse type, refused as a usage error (exit 2) with the flag's
name where it is below its least, rather than failing later with a traceback or doing nothing."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(least: int) -> Callable[[str], int]:
    """An argparse `type`: a whole number of at least `least`."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return count
