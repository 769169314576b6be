"""Stepahead: one-step-ahead (overlap) scheduling for LLM serving across gRPC.

`stepahead.v1` holds the code generated from `protos/` (by `make proto`);
`stepahead.protocol` the typed messages both services share.
"""

__version__ = "0.1.0"
