"""Load generator for the `stepahead.v1.Generation` API: `python -m loadgen --help`.

Its metrics and result-file keys follow `vllm bench serve`, so results can be read by the
same tools; see loadgen/README.md for the definitions.
"""

from loadgen.benchmark import BenchmarkConfig, BenchmarkResult, Observer, run_benchmark
from loadgen.records import RequestRecord
from loadgen.stats import Distribution, Slos, Summary
from loadgen.workload import JsonlDataset, RandomDataset, WorkloadError

__all__ = [
    "BenchmarkConfig",
    "BenchmarkResult",
    "Distribution",
    "JsonlDataset",
    "Observer",
    "RandomDataset",
    "RequestRecord",
    "Slos",
    "Summary",
    "WorkloadError",
    "run_benchmark",
]
