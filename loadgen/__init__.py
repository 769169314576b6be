"""Load generator for the `stepahead.v1.Generation` API and for OpenAI-compatible HTTP servers
(`/v1/completions`, `/v1/chat/completions`): `python -m loadgen --help`.

Its metrics and result-file keys follow `vllm bench serve`, so results can be read by the
same tools; see loadgen/README.md for the definitions.
"""

from loadgen.backend import BackendError
from loadgen.benchmark import BenchmarkConfig, BenchmarkResult, Observer, run_benchmark
from loadgen.records import RequestRecord
from loadgen.stats import Distribution, Slos, Summary
from loadgen.workload import JsonlDataset, PrefixRepetitionDataset, RandomDataset, WorkloadError

__all__ = [
    "BackendError",
    "BenchmarkConfig",
    "BenchmarkResult",
    "Distribution",
    "JsonlDataset",
    "Observer",
    "PrefixRepetitionDataset",
    "RandomDataset",
    "RequestRecord",
    "Slos",
    "Summary",
    "WorkloadError",
    "run_benchmark",
]
