"""python -m stepahead_client: a command-line client of the Generation API (see `client`)."""

from stepahead_client.client import main

if __name__ == "__main__":
    main()
