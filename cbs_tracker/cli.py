"""The ``cbs-tracker`` console script: a thin dispatcher over ``cbs_tracker.commands``.

Each sub-command lives in its own module ``cbs_tracker/commands/<name>.py`` that
defines ``main(argv: list[str]) -> int``; the module is imported only when its
command runs, so optional dependencies (matplotlib, tensorboard) stay optional.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, str] = {
    "demo": "train a small byte-level GPT on the standard library's .py files and print the noise scale",
    "plot": "draw noise scale, critical batch and global batch against tokens from TensorBoard logs",
    "plan": "print the power-of-two doubling plan of the optimal schedule for a token budget",
    "nqm": "compare batch schedules on the noisy quadratic model",
    "calibrate": "measure the demo GPT's critical batch by short branches, and kappa = critical batch / B_simple",
}


def _usage() -> str:
    lines = ["usage: cbs-tracker COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    lines += ["", "Run `cbs-tracker COMMAND --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"cbs-tracker: unknown command {name!r}; expected one of {sorted(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    module = importlib.import_module(f"cbs_tracker.commands.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
