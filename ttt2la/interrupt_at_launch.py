"""Ctrl-C while the ``ttt2la`` command is still importing torch: one line, exit status 2.

The command's own handler (``cli.main``) answers an interruption with one line, but the package
is imported first, which takes seconds (torch), and an interruption then would print a raw
``KeyboardInterrupt`` traceback. When the process was launched as the command (``python -m
ttt2la`` or the ``ttt2la`` script), Ctrl-C before ``main`` starts exits at once: nothing has
been written yet. ``main`` restores Python's own handler, so later interruptions clean up.
"""
from __future__ import annotations

import os
import signal
import sys

#: The exit status of an interruption (``cli.EXIT_BAD_INPUT``).
EXIT_INTERRUPTED = 2


def launched_as_command() -> bool:
    """Whether this process runs the ``ttt2la`` command rather than a program importing it."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv[:-1] and argv[argv.index("-m") + 1] == "ttt2la":
        return True
    return os.path.basename(sys.argv[0] if sys.argv else "") == "ttt2la"


def _exit_quietly(signum, frame) -> None:
    os.write(2, b"ttt2la: interrupted; nothing was written\n")
    os._exit(EXIT_INTERRUPTED)


def quiet_until_main() -> None:
    """Answer Ctrl-C with one line until ``restore`` is called, if launched as the command and
    Python's own handler is in place (a program that set its own keeps it)."""
    if launched_as_command() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_quietly)


def restore() -> None:
    """Python's own Ctrl-C handler again, if ``quiet_until_main`` replaced it."""
    if signal.getsignal(signal.SIGINT) is _exit_quietly:
        signal.signal(signal.SIGINT, signal.default_int_handler)


__all__ = ["launched_as_command", "quiet_until_main", "restore"]
