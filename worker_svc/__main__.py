"""python -m worker_svc: the worker (see `worker_svc.cli`)."""

from worker_svc.cli import main

if __name__ == "__main__":
    main()
