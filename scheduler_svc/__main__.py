"""python -m scheduler_svc: the scheduler (see `scheduler_svc.process.cli`)."""

from scheduler_svc.process.cli import main

if __name__ == "__main__":
    main()
