"""`python -m replicas.builtin NAME`: build (if needed) and print the model's path (NAME:
tiny, bench, pipe, ceiling, or fmt-<tool format> for a model family's test model).

`python -m replicas.builtin tiny --refresh-shipped` trains tiny from scratch and replaces the
weights shipped in the package (replicas/builtin/shipped/), printing their file: run it after
changing the recipe, the scripts, the chat template or the tokenizer, then commit the files.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from . import BUILTIN_NAMES, ensure_builtin
from .build import refresh_shipped
from .recipe import RECIPES


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m replicas.builtin", description=__doc__)
    parser.add_argument("name", choices=BUILTIN_NAMES)
    parser.add_argument("--cache-dir", type=Path, default=None, help="overrides the cache root")
    parser.add_argument("--refresh-shipped", action="store_true",
                        help="train from scratch and replace the shipped weights (trained "
                             "recipes only); prints the weights file")
    args = parser.parse_args()
    # Progress goes to stderr so stdout is just the path, for use in shell scripts.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if args.refresh_shipped:
        if args.name not in RECIPES:
            parser.error(f"{args.name} has random weights: nothing to ship")
        print(refresh_shipped(RECIPES[args.name]))
    else:
        print(ensure_builtin(args.name, args.cache_dir))


if __name__ == "__main__":
    main()
