"""Check that this Python environment holds the versions a lock file (locks/*.txt) pins.

    .venv/bin/python scripts/check_locked.py locks/trainer.txt [--strict]
    .venv/bin/python scripts/check_locked.py locks/trainer.txt --pip-report REPORT.json

A lock is used as pip constraints, so a pinned package may be absent (the CUDA packages on a machine
with the CPU build of torch); every package present must carry its pinned version (a local build
label such as +cpu aside). With --strict, a package that the lock does not name fails too (a stale
lock, or something installed by hand). The editable llmrl itself is not in the locks.

--pip-report checks what a `pip install --dry-run --report` would install instead of this environment:
strictly, and with versions equal to the pins to the letter (no +cpu where the lock names none).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from importlib import metadata

try:
    from packaging.markers import Marker
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version
except ImportError:  # an environment without packaging still has pip's copy
    from pip._vendor.packaging.markers import Marker
    from pip._vendor.packaging.specifiers import SpecifierSet
    from pip._vendor.packaging.version import Version

NOT_LOCKED = {"llmrl"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: str) -> dict[str, str]:
    """Pins of the lock whose environment markers hold here, by normalized name."""
    pins = {}
    for raw in open(path, encoding="utf-8"):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        requirement, _, marker = line.partition(";")
        name, sep, version = requirement.strip().partition("==")
        if not sep:
            raise SystemExit(f"{path}: not a pin: {line!r}")
        if marker.strip() and not Marker(marker.strip()).evaluate():
            continue
        pins[normalize(name)] = version.strip()
    return pins


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("lock")
    parser.add_argument("--strict", action="store_true", help="fail on packages the lock does not name")
    parser.add_argument("--pip-report", help="check the installs of this pip --report file instead")
    args = parser.parse_args()
    pins = read_pins(args.lock)
    if args.pip_report:
        with open(args.pip_report, encoding="utf-8") as f:
            report = json.load(f)
        found = [(item["metadata"]["name"], item["metadata"]["version"]) for item in report["install"]]
        args.strict = True
    else:
        found = [(dist.metadata["Name"], dist.version) for dist in metadata.distributions()]
    wrong, unlocked, matched = [], [], 0
    for raw_name, version in found:
        name = normalize(raw_name)
        if name in NOT_LOCKED:
            continue
        if name not in pins:
            unlocked.append(f"{name}=={version}")
        elif (
            Version(version) == Version(pins[name])
            if args.pip_report
            else Version(version) in SpecifierSet(f"=={pins[name]}")
        ):
            matched += 1
        else:
            wrong.append(f"{name}: {version}, {args.lock} pins {pins[name]}")
    for line in wrong:
        print(f"version differs from the lock: {line}", file=sys.stderr)
    if unlocked:
        print(f"not in {args.lock}: {', '.join(sorted(unlocked))}", file=sys.stderr)
    if wrong or (unlocked and args.strict):
        print(
            "Refresh the locks with `bash scripts/lock.sh` if pyproject.toml changed, then rerun "
            "scripts/setup.sh.",
            file=sys.stderr,
        )
        return 1
    what = "packages in the dry run" if args.pip_report else "installed packages"
    print(f"{matched} {what} match {args.lock}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
