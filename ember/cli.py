"""The `ember` command: demo, cache management.

ember demo           compile a built-in program, show its kernel and wrapper, time it
ember bench [...]    the side-by-side benchmark (eager, inductor, ember); flags as benchmarks/README.md
ember cache clear    remove the on-disk cache (EMBER_CACHE_DIR or ~/.cache/ember)
ember cache info     where the cache is and how big
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ember", description="ember, a deep-learning compiler for PyTorch")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="compile a built-in program and compare it with eager")
    explain = commands.add_parser("explain", help="run a script and explain what ember did with each graph")
    explain.add_argument("script")
    explain.add_argument("args", nargs=argparse.REMAINDER)
    commands.add_parser("bench", help="benchmark eager, inductor and ember side by side (flags: ember bench -h)")
    cache = commands.add_parser("cache", help="manage the on-disk cache")
    cache.add_argument("action", choices=["clear", "info"])
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # every flag after `bench` belongs to the benchmark
        return _bench(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "demo":
        from ember.demo import main as demo

        demo()
    elif args.command == "explain":
        from ember.explain import explain_script

        print(explain_script(args.script, args.args))
    elif args.command == "cache":
        from ember.config import load

        folder = Path(load().cache_dir)
        if args.action == "clear":
            shutil.rmtree(folder, ignore_errors=True)
            print(f"removed {folder}")
        else:
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
            print(f"{folder}: {size / 1e6:.1f} MB")


def _bench(argv: list[str]) -> None:
    try:  # the suite lives beside the package, in the repository checkout
        from benchmarks.run import main as bench
    except ImportError:
        raise SystemExit(
            "ember bench: run it from an ember repository checkout (benchmarks/ is not installed)"
        ) from None
    bench(argv)


if __name__ == "__main__":
    main()
