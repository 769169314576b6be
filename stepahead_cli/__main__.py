"""python -m stepahead_cli: the `stepahead` command (see `stepahead_cli.commands`)."""

from stepahead_cli.commands import main

if __name__ == "__main__":
    main()
