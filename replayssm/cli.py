"""The ``replayssm`` command: ``generate``, ``traffic``, ``bench kernels``, ``bench e2e``.

Each subcommand lives in its own module and exposes ``main(argv) -> int``; this file
only routes, so importing it stays cheap.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help)
_COMMANDS = {
    "generate": ("replayssm.engine.cli", "generate text with the LLM engine (default: shipped tiny model)"),
    "traffic": ("replayssm.bench.traffic", "print the per-step memory-traffic model (DESIGN §3)"),
    "bench kernels": ("replayssm.bench.kernels", "benchmark decode/verify kernels against peers"),
    "bench e2e": ("replayssm.bench.e2e", "end-to-end throughput benchmark"),
    "bench mtp": ("replayssm.bench.mtp", "MTP drafting vs draft model vs n-gram: draft cost per step, tokens/s"),
}

_DEFAULT = "generate"


def _usage() -> str:
    lines = ["usage: replayssm <command> [options]", "", "commands:"]
    for name, (_, help_) in _COMMANDS.items():
        lines.append(f"  {name:<14} {help_}")
    lines.append("")
    lines.append("`replayssm <command> --help` shows a command's options.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name = None
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in _COMMANDS:
        name, rest = f"{argv[0]} {argv[1]}", argv[2:]
    elif argv and argv[0] in _COMMANDS:
        name, rest = argv[0], argv[1:]
    elif argv and argv[0] == "bench":
        print("usage: replayssm bench {kernels,e2e} [options]", file=sys.stderr)
        return 2
    elif argv and not argv[0].startswith("-") and argv[0] not in _COMMANDS:
        print(f"replayssm: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    else:
        name, rest = _DEFAULT, argv
    module = importlib.import_module(_COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
