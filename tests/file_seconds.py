"""Measured seconds per test file, which conftest.py uses to start the longest files first.

pytest-xdist (--dist loadfile) hands whole files to the two workers; started in
collection order, a long file that happens to come last leaves one worker idle while the
other finishes it. Regenerate after a full run that wrote a JUnit report:

    python -m pytest --junitxml=/tmp/junit.xml
    python tests/file_seconds.py /tmp/junit.xml      # rewrites tests/file_seconds.json
"""
import collections
import json
import os
import sys
import xml.etree.ElementTree as ET

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "file_seconds.json")


def from_junit(path: str) -> dict:
    """file name (e.g. "test_ppo.py") -> seconds of its tests (setup, call and teardown)."""
    seconds = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname").split(".")[1]  # "tests.test_ppo[.Class]"
        seconds[module + ".py"] += float(case.get("time"))
    return {name: round(s, 1) for name, s in seconds.most_common()}


def load() -> dict:
    """The checked-in measurement; empty when the file is missing."""
    if not os.path.exists(PATH):
        return {}
    with open(PATH) as f:
        return json.load(f)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/file_seconds.py JUNIT_XML")
    measured = from_junit(sys.argv[1])
    with open(PATH, "w") as f:
        json.dump(measured, f, indent=1)
        f.write("\n")
    print(f"{len(measured)} files, {sum(measured.values()):.0f} s in all -> {PATH}")
