"""python -m scheduler_svc: the scheduler (see `scheduler_svc.process.app`)."""

from scheduler_svc.process.app import main

if __name__ == "__main__":
    main()
