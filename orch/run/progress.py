"""Live progress in the terminal: a bar with step, loss, tokens/s and ETA; plain lines when
the output is not a terminal (CI logs, pipes)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class Progress:
    def __init__(self, total_steps: int, stream=None):
        self.stream = stream or sys.stderr
        self.interactive = self.stream.isatty()
        self.bar = tqdm(total=total_steps, unit="step", file=self.stream, dynamic_ncols=True,
                        disable=not self.interactive)
        self.total = total_steps

    def update(self, step: int, loss: float, throughput: float | None, eval_loss: float | None = None,
               unit: str = "tok/s") -> None:
        """``throughput`` in ``unit``: tokens/s for token data, samples/s otherwise (None: nothing
        was timed, as in an attempt resumed at the last step)."""
        if self.interactive:
            self.bar.update(step - self.bar.n)
            postfix = {"loss": f"{loss:.4f}", unit: "-" if throughput is None else f"{throughput:,.0f}"}
            if eval_loss is not None:
                postfix["eval"] = f"{eval_loss:.4f}"
            self.bar.set_postfix(postfix, refresh=True)
        else:
            shown = "tokens/s" if unit == "tok/s" else unit
            rate = "-" if throughput is None else f"{throughput:,.{0 if unit == 'tok/s' else 1}f}"
            line = f"step {step}/{self.total}  loss {loss:.4f}  {shown} {rate}"
            if eval_loss is not None:
                line += f"  eval_loss {eval_loss:.4f}"
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        self.bar.close()
