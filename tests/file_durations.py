"""Seconds per test file from a measured run, for the order in which `make test` hands files to its workers.

    make test PYTEST_ARGS=--junitxml=/tmp/junit.xml && .venv/bin/python tests/file_durations.py /tmp/junit.xml

writes tests/durations.json. pytest-xdist gives each worker whole files (`--dist loadfile`); conftest.py sorts the
files slowest first (the longest-processing-time rule), so that no slow file starts while the other worker has
nothing left to do. A file missing from the table runs last; a stale table costs time, never a test.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")


def file_seconds(junit_xml: Path) -> dict[str, float]:
    """{tests/test_x.py: seconds} summed over a JUnit report's test cases, slowest first."""
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).iter("testcase"):
        seconds[f"{case.get('classname').replace('.', '/')}.py"] += float(case.get("time") or 0)
    return {name: round(s, 1) for name, s in seconds.most_common()}


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.is_file() else {}


if __name__ == "__main__":
    TABLE.write_text(json.dumps(file_seconds(Path(sys.argv[1])), indent=1) + "\n")
