"""python -m loadgen: the load generator (see `loadgen.cli`)."""

from loadgen.cli import main

if __name__ == "__main__":
    main()
