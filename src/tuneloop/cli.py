"""The `tuneloop` command. Server commands import the server stack only when run."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tuneloop", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    try:
        from tuneloop.server.cli import add_commands
    except ImportError as exc:  # the bare install is the SDK only
        print(f"the server commands need `pip install tuneloop[server]` ({exc})", file=sys.stderr)
        return 2
    add_commands(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
