"""SIGINT and SIGTERM stop a command the same way: cleanup runs, then one line and exit 128+signal.

Schedulers and ``kill`` send SIGTERM; a terminal sends SIGINT. Both raise :class:`Stopped` (a
KeyboardInterrupt, so ``except KeyboardInterrupt`` cleanup, such as ending the MLflow run
KILLED, handles both) in the main thread, wherever it waits. A second signal during that
cleanup is noted and otherwise ignored, so the cleanup finishes (SIGKILL still ends it).

Native code that waits with the GIL released (Ray's ``ray.get``, which the driver is in while
the workers set up) runs the handler from its own signal check and turns whatever it raised into
a plain ``KeyboardInterrupt`` of its own: the signal that stopped the command is therefore noted
where it is received, not read from the exception.
"""

from __future__ import annotations

import contextlib
import signal
import sys
from collections.abc import Iterator


class Stopped(KeyboardInterrupt):
    """The command was asked to stop by ``signum``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """The shell's convention for a process ended by a signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum


_received: list[int] = []
"""The signal :func:`_stop` took in the current :func:`stopped_by_signals` block, if any."""


def _stop(signum: int, frame) -> None:
    _received.append(signum)
    for handled in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(handled) is _stop:
            signal.signal(handled, _already_stopping)
    raise Stopped(signum)


def _already_stopping(signum: int, frame) -> None:
    print(f"{signal.Signals(signum).name}: already stopping, cleaning up (SIGKILL ends it at once)",
          file=sys.stderr, flush=True)


@contextlib.contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Run the block with SIGINT and SIGTERM raising :class:`Stopped`; end the process if they did.

    SIGINT is taken over only when Python handles it (not when the shell made the process
    ignore it, as for a background job), so ``nohup``/``&`` keep their meaning.
    """
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGTERM, _stop)
    if previous[signal.SIGINT] is signal.default_int_handler:
        signal.signal(signal.SIGINT, _stop)
    _received.clear()
    try:
        yield
    except KeyboardInterrupt:
        # No signal taken: a KeyboardInterrupt Python raised itself, from a SIGINT it handled.
        stopped = Stopped(_received[0] if _received else signal.SIGINT)
        print(f"stopped by {signal.Signals(stopped.signum).name}", file=sys.stderr, flush=True)
        raise SystemExit(stopped.exit_code) from None
    finally:
        for sig, handler in previous.items():
            if handler is not None:
                signal.signal(sig, handler)
