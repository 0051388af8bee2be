"""The command line: the Typer app (:mod:`.app`) and one module per command. No other module imports cli."""
