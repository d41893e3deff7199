"""The ``replayssm`` command: ``generate``, ``serve``, ``quantize``, ``traffic``, ``bench kernels|prefill|e2e|serve``.

Each subcommand lives in its own module and exposes ``main(argv) -> int``; this file
only routes, so importing it stays cheap.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help)
_COMMANDS = {
    "generate": ("replayssm.engine.cli", "generate text with the LLM engine (default: shipped tiny model)"),
    "serve": ("replayssm.server.cli", "OpenAI-compatible HTTP server (needs the serve extra)"),
    "quantize": ("replayssm.models.quantize_cli", "write an FP8 (e4m3) copy of a checkpoint: MODEL_DIR OUT_DIR"),
    "traffic": ("replayssm.bench.traffic", "print the per-step memory-traffic model (docs/MATH.md)"),
    "bench kernels": ("replayssm.bench.kernels", "benchmark decode/verify kernels against peers"),
    "bench e2e": ("replayssm.bench.e2e", "end-to-end throughput benchmark"),
    "bench mtp": ("replayssm.bench.mtp", "MTP drafting vs draft model vs n-gram: draft cost per step, tokens/s"),
    "bench serve": ("replayssm.bench.serve", "serving benchmark: Poisson load against the HTTP server"),
    "bench prefill": ("replayssm.bench.prefill", "benchmark packed prefill kernels against peers"),
}

_DEFAULT = "generate"


def _usage() -> str:
    lines = ["usage: replayssm <command> [options]", "       replayssm PROMPT [options]   (same as `replayssm generate PROMPT`)",
             "", "commands:"]
    for name, (_, help_) in _COMMANDS.items():
        lines.append(f"  {name:<14} {help_}")
    lines.append("")
    lines.append("`replayssm <command> --help` shows a command's options; `replayssm --version` the version.")
    return "\n".join(lines)


def _bench_usage() -> str:
    lines = ["usage: replayssm bench <benchmark> [options]", "", "benchmarks:"]
    for name, (_, help_) in _COMMANDS.items():
        if name.startswith("bench "):
            lines.append(f"  {name[6:]:<10} {help_}")
    lines.append("")
    lines.append("`replayssm bench <benchmark> --help` shows its options.")
    return "\n".join(lines)


def _typo(word: str) -> str | None:
    """The command ``word`` looks like a misspelling of (a bare word close to a command name)."""
    import difflib

    if not word.isalpha() or word.lower() != word:
        return None
    names = sorted({n.split()[0] for n in _COMMANDS})
    close = difflib.get_close_matches(word, names, n=1, cutoff=0.75)
    return close[0] if close else None


def main(argv: list[str] | None = None) -> int:
    """Route ``argv`` to a subcommand's ``main``.  A first argument that is not a command
    (and not an option) is a prompt: ``replayssm "def f():"`` runs ``generate``, as
    ``replayssm --mode kv "x"`` does; a bare word close to a command name (``generat``) is
    reported as a likely typo instead."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv and argv[0] in ("--version", "-V"):
        from . import __version__

        print(f"replayssm {__version__}")
        return 0
    name = None
    if len(argv) >= 2 and f"{argv[0]} {argv[1]}" in _COMMANDS:
        name, rest = f"{argv[0]} {argv[1]}", argv[2:]
    elif argv and argv[0] in _COMMANDS:
        name, rest = argv[0], argv[1:]
    elif argv and argv[0] == "bench":
        if len(argv) >= 2 and argv[1] in ("-h", "--help", "help"):
            print(_bench_usage())
            return 0
        what = f"unknown benchmark {argv[1]!r}\n\n" if len(argv) >= 2 else ""
        print(f"replayssm bench: {what}{_bench_usage()}", file=sys.stderr)
        return 2
    elif argv and not argv[0].startswith("-") and (guess := _typo(argv[0])) is not None:
        print(f"replayssm: unknown command {argv[0]!r} (did you mean {guess!r}? to generate from "
              f"this text, run `replayssm generate {argv[0]}`)\n\n{_usage()}", file=sys.stderr)
        return 2
    else:
        name, rest = _DEFAULT, argv
    target = _COMMANDS[name][0]
    if name == "generate" and _backend(rest) == "jax":
        target = "replayssm.jax.cli"   # the same command on the JAX backend (a wing above the engine)
    module = importlib.import_module(target)
    if not name.startswith("bench "):
        return int(module.main(rest) or 0)
    try:   # a benchmark's bad setting (a mode, a preset, a file) is its message, not a traceback
        return int(module.main(rest) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"replayssm {name}: error: {e}", file=sys.stderr)
        return 2


def _backend(argv: list[str]) -> str | None:
    """The value of ``--backend`` in ``argv`` (``--backend X`` or ``--backend=X``), if any."""
    for i, a in enumerate(argv):
        if a == "--backend" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--backend="):
            return a.split("=", 1)[1]
    return None


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
