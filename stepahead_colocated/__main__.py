"""python -m stepahead_colocated: the scheduler with the worker engine in its process (see `runner`)."""

from stepahead_colocated.runner import main

if __name__ == "__main__":
    main()
