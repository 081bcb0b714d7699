"""`python -m replicas.builtin tiny|bench`: build (if needed) and print the model's path."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from . import BUILTIN_NAMES, ensure_builtin


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m replicas.builtin", description=__doc__)
    parser.add_argument("name", choices=BUILTIN_NAMES)
    parser.add_argument("--cache-dir", type=Path, default=None, help="overrides the cache root")
    args = parser.parse_args()
    # Progress goes to stderr so stdout is just the path, for use in shell scripts.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    print(ensure_builtin(args.name, args.cache_dir))


if __name__ == "__main__":
    main()
