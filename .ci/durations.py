"""Print where CI's test time went, from the JUnit XML files pytest wrote: each test file's total
and the slowest tests of all tiers, so the time budget can be read from every CI log.

    python .ci/durations.py tests.xml
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict

SLOWEST = 30


def cases(path: str) -> list[tuple[str, str, float]]:
    """(tier, test id, seconds) of every test case in one JUnit file; the tier is the case's
    ``tier`` property (tests/conftest.py), else the file's stem."""
    stem = path.rsplit("/", 1)[-1].removesuffix(".xml")
    found = []
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        tier = next((p.get("value") for p in case.iter("property") if p.get("name") == "tier"), stem)
        found.append((tier, f"{module}.py::{case.get('name')}", float(case.get("time", 0))))
    return found


def main(paths: list[str]) -> None:
    everything = [case for path in paths for case in cases(path)]
    per_file: dict[tuple[str, str], float] = defaultdict(float)
    for tier, test, seconds in everything:
        per_file[tier, test.split("::")[0]] += seconds
    print(f"test time by file (summed; a run with -n 2 takes about half the sum), {len(everything)} tests:")
    for (tier, file), seconds in sorted(per_file.items(), key=lambda item: -item[1]):
        print(f"  {seconds:8.1f} s  {tier:5}  {file}")
    print(f"the {SLOWEST} slowest tests:")
    for tier, test, seconds in sorted(everything, key=lambda case: -case[2])[:SLOWEST]:
        print(f"  {seconds:8.1f} s  {tier:5}  {test}")


if __name__ == "__main__":
    main(sys.argv[1:])
