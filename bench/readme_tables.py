"""Copy the benchmark tables from ``bench/results/*.md`` into ``bench/README.md``, so none is typed by hand.

``bench/README.md`` marks each copied table::

    <!-- results: bench/results/overhead_vs_deepspeed.md table 1 -->
    ...replaced by this script...
    <!-- /results -->

and this script replaces what is between the markers with when the results file was measured and
its N-th table. Run it after a benchmark wrote its file; ``--check`` exits non-zero when
``bench/README.md`` is out of date (the tests run it).

    python -m bench.readme_tables [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKED = re.compile(r"(?P<open><!-- results: (?P<path>\S+) table (?P<n>\d+) -->\n).*?(?P<close><!-- /results -->)",
                    re.S)
DATE = re.compile(r"^- date: (.+)$", re.M)
LOAD = re.compile(r"^- load average \(1/5/15 min\): (.+)$", re.M)


def tables(text: str) -> list[list[str]]:
    """The Markdown tables of a file: runs of consecutive lines starting with ``|``."""
    found, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            found.append(current)
            current = []
    if current:
        found.append(current)
    return found


def block(path: str, n: int) -> str:
    """What goes between the markers: when the file was measured, then its n-th table."""
    text = (REPO / path).read_text()
    table = tables(text)[n - 1]
    when = []
    if date := DATE.search(text):
        when.append(f"Measured {date.group(1)}")
    if load := LOAD.search(text):
        when.append(f"load average {load.group(1)}")
    lead = f"{', '.join(when)} (`{path}`):\n\n" if when else ""
    return lead + "\n".join(table) + "\n"


def render(readme: str) -> str:
    return MARKED.sub(lambda m: m["open"] + block(m["path"], int(m["n"])) + m["close"], readme)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if bench/README.md's tables differ from the results")
    args = parser.parse_args()
    readme = REPO / "bench" / "README.md"
    current = readme.read_text()
    updated = render(current)
    if args.check:
        if updated != current:
            sys.exit("bench/README.md's benchmark tables differ from bench/results: run python -m bench.readme_tables")
        return
    readme.write_text(updated)


if __name__ == "__main__":
    main()
