"""`python -m tests.reliability`: the whole reliability suite with a longer soak, then the
soak's report. Starts its own Ray cluster serving on 127.0.0.1:8200 (ORCHARD_RELIABILITY_PORT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.reliability", description=__doc__)
    parser.add_argument("--soak-seconds", type=float, default=60.0,
                        help="how long the overload soak runs (default 60)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "soak.json"
        os.environ["ORCHARD_SOAK_S"] = str(args.soak_seconds)
        os.environ["ORCHARD_RELIABILITY_REPORT"] = str(report_path)
        code = pytest.main(["-q", "-p", "no:cacheprovider", str(HERE), *args.pytest_args])
        print()
        if report_path.exists():
            report = json.loads(report_path.read_text())
            print("reliability report")
            for key in ("sent", "ok", "refused", "left", "failed", "hung", "recovery_s",
                        "statuses", "concurrency", "capacity", "duration_s"):
                print(f"  {key:<12} {report[key]}")
        else:
            print("reliability report: the soak did not run")
    return int(code)


if __name__ == "__main__":
    sys.exit(main())
