"""The argument parser of the console scripts: errors are one line on stderr, exit status 2."""

from __future__ import annotations

import argparse
from typing import NoReturn

__all__ = ["OneLineErrorParser"]


class OneLineErrorParser(argparse.ArgumentParser):
    """``argparse`` without the usage block on errors: ``PROG: error: MESSAGE`` and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")
