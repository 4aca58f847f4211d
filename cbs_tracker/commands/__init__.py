"""Sub-commands of the ``cbs-tracker`` console script, one module each with ``main(argv)``."""
