"""``python -m mismatch_probe`` == the ``mismatch-probe`` command."""

from mismatch_probe.cli.main import main

if __name__ == "__main__":  # worker processes started with "spawn" re-import this module: run nothing then
    main()
