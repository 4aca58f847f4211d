"""Sub-commands of the ``cbs-tracker`` console script, one module each with ``main(argv)``.

``cbs_tracker.cli`` imports a module only when its command runs; add a command by adding a
module here and a line to ``cli.COMMANDS``.
"""
