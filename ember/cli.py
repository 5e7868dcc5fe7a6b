"""The `ember` command: demo, cache management.

ember --version      ember's version, and the torch it runs with (if installed)
ember demo           compile a built-in program, show its kernel and wrapper, time it
ember bench [...]    the side-by-side benchmark (eager, inductor, ember); flags as benchmarks/README.md
ember cache clear    remove what ember wrote in its cache folder (EMBER_CACHE_DIR or ~/.cache/ember),
                     and nothing else (runtime/cache_clear.py)
ember cache info     where the cache is, how big, and what in it is not ember's
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="ember", description="ember, a deep-learning compiler for PyTorch")
    parser.add_argument("--version", action="version", version=_version())
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
        _cache(args.action)


def _version() -> str:
    """ember's version and torch's, read from package metadata (importing torch takes seconds)."""
    from importlib import metadata

    from ember import __version__

    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return f"ember {__version__} (torch {torch_version})"


def _cache(action: str) -> None:
    from ember.config import load
    from ember.runtime.cache_clear import NotAnEmberCache, clear, describe_removed, ember_contents

    folder = Path(load().cache_dir).expanduser().absolute()
    if not folder.exists():
        print(f"{folder}: no cache there")
        return
    try:
        contents = ember_contents(folder)
        size = contents.bytes
        if action == "clear":
            print(describe_removed(clear(folder), size))
            return
    except NotAnEmberCache as e:
        raise SystemExit(f"ember cache {action}: {e}") from None
    files = sum(len(paths) for paths in contents.files.values())
    print(
        f"{folder}: {files} files, {size / 1e6:.1f} MB"
        + (f"; not ember's: {len(contents.foreign)}" if contents.foreign else "")
    )


def _bench(argv: list[str]) -> None:
    """The suite lives beside the package in the repository checkout, not in an installed wheel:
    from an editable install (`pip install -e .`) it is found from any directory."""
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "benchmarks" / "run.py").is_file() and str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    try:
        from benchmarks.run import main as bench
    except ImportError as e:
        raise SystemExit(
            f"ember bench: the benchmark suite is not installed with ember ({e}); it runs from a repository "
            "checkout: `pip install -e .[bench]` there, then `ember bench` works from any directory"
        ) from None
    bench(argv)


if __name__ == "__main__":
    main()
