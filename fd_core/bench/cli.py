"""The ``fd-bench`` command: dispatch to a benchmark by subcommand.

    fd-bench serve --url http://127.0.0.1:8000 ...   load-test a running fd-serve (online)
    fd-bench throughput ...                          offline throughput of the engine

Each subcommand lives in ``fd_core.bench.<name>`` with a ``main(argv) -> int``; it is imported
only when chosen.
"""

from __future__ import annotations

import difflib
import importlib
import sys
from typing import Final

#: Subcommand -> one-line description.
SUBCOMMANDS: Final = {
    "serve": "load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, e2e, throughput)",
    "throughput": "offline throughput of the engine (requests/s, tokens/s)",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fd-bench``; returns the exit code (2 for a missing or unknown subcommand)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "\n".join([f"usage: fd-bench {{{','.join(SUBCOMMANDS)}}} [options]"
                       "   (fd-bench SUBCOMMAND --help: its options)",
                       "", *(f"  {name:<12} {text}" for name, text in SUBCOMMANDS.items())])
    if argv[:1] in (["-h"], ["--help"]):
        print(usage)
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        if not argv:
            problem = "a subcommand is required"
        else:
            close = difflib.get_close_matches(argv[0], list(SUBCOMMANDS), n=1)
            problem = f"unknown subcommand {argv[0]!r}" + (f"; did you mean {close[0]!r}?" if close else "")
        print(f"fd-bench: error: {problem}\n{usage}", file=sys.stderr)
        return 2
    name, rest = argv[0], argv[1:]
    return importlib.import_module(f"fd_core.bench.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main())
