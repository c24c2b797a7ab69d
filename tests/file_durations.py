"""Seconds per test from measured runs, for the order in which `make test` (and `make test-slow`) hand files to
their workers.

    make test PYTEST_ARGS=--junitxml=/tmp/fast.xml && make test-slow PYTEST_ARGS=--junitxml=/tmp/slow.xml
    .venv/bin/python tests/file_durations.py /tmp/fast.xml /tmp/slow.xml

writes tests/durations.json ({test id: seconds}). pytest-xdist gives each worker whole files (`--dist loadfile`);
conftest.py sums each file's selected tests, so each tier sees its own weights, and sorts the files slowest first
(the longest-processing-time rule), so that no slow file starts while the other worker has nothing left to do. A
test missing from the table counts 0 s; a stale table costs time, never a test.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

TABLE = Path(__file__).with_name("durations.json")


def test_seconds(junit_xml: Path) -> dict[str, float]:
    """{tests/test_x.py::test_y[param]: seconds} of a JUnit report's test cases (setup and teardown included)."""
    seconds = {}
    for case in ET.parse(junit_xml).iter("testcase"):
        package, module, *classes = case.get("classname").split(".")
        seconds["::".join([f"{package}/{module}.py", *classes, case.get("name")])] = float(case.get("time") or 0)
    return seconds


def file_seconds(test_ids: Iterable[str], table: dict[str, float]) -> Counter[str]:
    """{tests/test_x.py: seconds} summed over the given tests."""
    seconds: Counter[str] = Counter()
    for test_id in test_ids:
        seconds[test_id.split("::")[0]] += table.get(test_id, 0.0)
    return seconds


def load() -> dict[str, float]:
    return json.loads(TABLE.read_text()) if TABLE.is_file() else {}


if __name__ == "__main__":
    table = {}
    for report in sys.argv[1:]:  # later reports win
        table.update(test_seconds(Path(report)))
    TABLE.write_text(json.dumps({k: round(v, 1) for k, v in sorted(table.items())}, indent=0) + "\n")
