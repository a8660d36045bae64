"""What the console scripts share: errors are one line on stderr (exit status 2), a closed
pipe (``fsdp-plan ... | head``) ends quietly, and Ctrl-C ends with one line (exit status 130)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable
from typing import NoReturn, ParamSpec

__all__ = ["OneLineErrorParser", "console_script"]

P = ParamSpec("P")


class OneLineErrorParser(argparse.ArgumentParser):
    """``argparse`` without the usage block on errors: ``PROG: error: MESSAGE`` and exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def console_script(prog: str) -> Callable[[Callable[P, int]], Callable[P, int]]:
    """Wrap a console script's ``main``: when the reader of its output goes away (``| head``)
    it stops without a traceback (exit status 1, as Python's own recipe has it); on Ctrl-C it
    prints ``PROG: interrupted`` and exits 130."""

    def wrap(main: Callable[P, int]) -> Callable[P, int]:
        @functools.wraps(main)
        def run(*args: P.args, **kwargs: P.kwargs) -> int:
            try:
                status = main(*args, **kwargs)
                sys.stdout.flush()
            except BrokenPipeError:
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, sys.stdout.fileno())
                return 1
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130
            return status

        return run

    return wrap
