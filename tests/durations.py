"""Each test file's measured seconds under `make test` (tests/durations.json), by which
tests/conftest.py hands the longest files to the two workers first. Refresh it from a
run's JUnit report:

    make test PYTEST_ARGS=--junitxml=build/junit.xml
    .venv/bin/python -m tests.durations build/junit.xml
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

FILE = Path(__file__).with_name("durations.json")


def load() -> dict[str, float]:
    try:
        return json.loads(FILE.read_text())
    except (OSError, ValueError):
        return {}


def main(report: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        seconds[f"tests/{case.get('classname').split('.')[-1]}.py"] += float(case.get("time") or 0)
    FILE.write_text(json.dumps({f: round(s, 1) for f, s in seconds.most_common()}, indent=0) + "\n")
    print(f"{len(seconds)} files, {sum(seconds.values()):.0f} s of tests -> {FILE}")


if __name__ == "__main__":
    main(sys.argv[1])
