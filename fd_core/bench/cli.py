"""The ``fd-bench`` command: dispatch to a benchmark by subcommand.

    fd-bench serve --url http://127.0.0.1:8000 ...   load-test a running fd-serve (online)
    fd-bench throughput ...                          offline throughput of the engine

Each subcommand lives in ``fd_core.bench.<name>`` with a ``main(argv) -> int``; it is imported
only when chosen.
"""

from __future__ import annotations

import importlib
import sys
from typing import Final

#: Subcommand -> one-line description.
SUBCOMMANDS: Final = {
    "serve": "load-test a running OpenAI-compatible server (TTFT, TPOT, ITL, e2e, throughput)",
    "throughput": "offline throughput of the engine (requests/s, tokens/s)",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fd-bench``; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        usage = "usage: fd-bench {" + ",".join(SUBCOMMANDS) + "} [options]\n\n" + "\n".join(
            f"  {name:<12} {text}" for name, text in SUBCOMMANDS.items())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"fd-bench: error: unknown subcommand {argv[0]!r}\n{usage}", file=sys.stderr)
            return 2
        print(usage)
        return 0
    name, rest = argv[0], argv[1:]
    return importlib.import_module(f"fd_core.bench.{name}").main(rest)


if __name__ == "__main__":
    sys.exit(main())
