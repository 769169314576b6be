"""python -m worker_svc: the worker (see `worker_svc.app`)."""

from worker_svc.app import main

if __name__ == "__main__":
    main()
