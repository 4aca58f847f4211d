"""Sub-commands of the ``cbs-tracker`` console script, one module each with ``main(argv)``.

``cbs_tracker.cli`` imports a module only when its command runs; add a command by adding a
module here and a line to ``cli.COMMANDS``.
"""


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1")
    return value


def open_unit_ratio(text: str) -> float:
    """argparse type: a number strictly between 0 and 1."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a ratio strictly between 0 and 1")
    return value
