"""``python -m mismatch_probe`` == the ``mismatch-probe`` command."""

from mismatch_probe.cli import main

main()
