"""`ptdp calibrate`: measure this machine (ptdp.perf.calibrate) and write
its hardware profile, by default the `local` one `ptdp plan --gpu local`
reads. Torch-free at import: the measurements import torch when they run."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ptdp.perf.price.profiles import default_profile_path, save_profile


def add_calibrate_parser(commands) -> argparse.ArgumentParser:
    parser = commands.add_parser(
        "calibrate", help="measure this machine and write a hardware profile for the simulator",
        description="Measure matrix-multiply rates, memory-bound operator throughput, eager "
                    "operator overhead and gloo communication between two local processes, and "
                    "write them as a hardware profile (JSON) that `ptdp plan --gpu` and "
                    "ptdp.perf.simulate.predict.simulate read. Takes under a minute (--quick: "
                    "under 20 s).")
    parser.add_argument("--out", metavar="FILE.json", default=None,
                        help=f"where to write the profile (default: {default_profile_path()}, "
                             f"which the profile name 'local' loads)")
    parser.add_argument("--quick", action="store_true", help="fewer, shorter measurements")
    parser.add_argument("--name", default="local", help="the profile's name (default: local)")
    return parser


def run_calibrate_command(args: argparse.Namespace) -> int:
    out = Path(args.out) if args.out else default_profile_path()
    if out.is_dir():
        print(f"ptdp: error: --out {out} is a directory; give a file name", file=sys.stderr)
        return 2
    if args.out and not out.resolve().parent.is_dir():
        print(f"ptdp: error: --out {out}: directory {out.resolve().parent} does not exist",
              file=sys.stderr)
        return 2
    from ptdp.perf.calibrate.profile import calibrate  # the measurements import torch

    profile = calibrate(quick=args.quick, name=args.name,
                        log=lambda line: print(f"ptdp: {line}", flush=True))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_profile(profile, out)
    print(f"ptdp: wrote the {profile.name} profile to {out}", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="ptdp")
    run_command = add_calibrate_parser(parser.add_subparsers(dest="command", required=True))
    sys.exit(run_calibrate_command(parser.parse_args()))
