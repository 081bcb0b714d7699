"""Joining Macs to an Orchard cluster, and the Metal check a pinned replica runs at start.

    python -m deployments.cluster head                      # the head: no models land here
    python -m deployments.cluster worker --address HEAD:6379  # a Mac that serves models
    python -m deployments.cluster status [--watch]          # what runs where (`orchard status`)

`head` and `worker` print the `ray start` command they run; arguments after `--` are passed
to it. `status` is `deployments/status.py`'s table of `GET /v1/cluster`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import sys
from pathlib import Path
from typing import Sequence

from deployments.config import PlacementSettings

# What a worker advertises is what a pinned model asks for: the config's default, kept there.
DEFAULT_RESOURCE: str = PlacementSettings.model_fields["resource"].default


def metal_available() -> bool:
    import mlx.core as mx  # here, so `--help` and the head need no mlx

    return bool(mx.metal.is_available())


def require_metal(model_id: str) -> None:
    """Raise, with what to do about it, when this node cannot run MLX on a GPU."""
    if metal_available():
        return
    raise RuntimeError(
        f"model '{model_id}' requires Metal (placement.require_metal), but node "
        f"'{socket.gethostname()}' ({platform.system()} {platform.machine()}) has no Metal "
        "GPU. Start Mac workers with `python -m deployments.cluster worker`, pin the model "
        "with `placement: {pin: true}`, or set `placement: {require_metal: false}` to allow "
        "CPU replicas."
    )


def ray_start_command(args: argparse.Namespace) -> list[str]:
    command = [_ray_exe(), "start"]
    if args.role == "head":
        command += ["--head", "--port", str(args.port)]
    else:
        command += ["--address", args.address, "--num-cpus", str(args.cpus)]
    if args.role == "worker" or args.with_models:
        amount = int(args.amount) if args.amount.is_integer() else args.amount
        command += ["--resources", json.dumps({args.resource: amount})]
    extra = list(args.ray_args)
    return command + (extra[1:] if extra[:1] == ["--"] else extra)


def _ray_exe() -> str:
    # The `ray` next to this interpreter: the venv's Ray must match the cluster's.
    sibling = Path(sys.executable).with_name("ray")
    return str(sibling) if sibling.exists() else shutil.which("ray") or "ray"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deployments.cluster",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    roles = parser.add_subparsers(dest="role", required=True)
    head = roles.add_parser("head", help="start the head node (runs the Serve controller "
                                         "and the HTTP proxy)")
    head.add_argument("--port", type=int, default=6379, help="GCS port workers join (6379)")
    head.add_argument("--with-models", action="store_true",
                      help="also advertise the resource, so pinned models may run on the head")
    worker = roles.add_parser("worker", help="join a Mac that serves models")
    worker.add_argument("--address", required=True, help="the head's HOST:PORT")
    worker.add_argument("--cpus", type=int, default=0,
                        help="logical CPUs to advertise (0): with none, the ingress and "
                             "other CPU work stay on the head, and only models land here")
    from deployments.status import add_arguments

    add_arguments(roles.add_parser("status", help="the cluster as a table (GET /v1/cluster; "
                                                  "also `orchard status`)"))
    for role in (head, worker):
        role.add_argument("--allow-no-metal", action="store_true",
                          help="advertise the resource even without Metal (tests, CPU nodes)")
        role.add_argument("--resource", default=DEFAULT_RESOURCE,
                          help=f"custom resource to advertise ({DEFAULT_RESOURCE})")
        role.add_argument("--amount", type=float, default=1.0,
                          help="units advertised: replicas this node hosts at "
                               "resource_per_replica 1 (1)")
        role.add_argument("--dry-run", action="store_true", help="print the command only")
        role.add_argument("ray_args", nargs=argparse.REMAINDER,
                          help="after --: more `ray start` arguments (e.g. --block)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.role == "status":
        from deployments.status import run

        return run(args)
    advertises = args.role == "worker" or args.with_models
    if advertises and not args.allow_no_metal and not metal_available():
        print(f"error: {socket.gethostname()} has no Metal GPU, so it cannot serve models "
              "pinned to Apple Silicon (--allow-no-metal joins anyway)", file=sys.stderr)
        return 2
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        print("warning: RAY_AUTH_MODE is not 'token', so anyone who can reach this cluster's "
              "ports can run code on it; see docs/cluster.md", file=sys.stderr)
    command = ray_start_command(args)
    print(shlex.join(command), flush=True)
    if args.dry_run:
        return 0
    # exec, so signals reach `ray start` itself (with --block it stops the node on SIGTERM).
    os.execv(command[0], command)


if __name__ == "__main__":
    raise SystemExit(main())
