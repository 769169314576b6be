"""The core-frontend link's wire forms: requests, sampling parameters, step outputs and the
worker's state, to and from `stepahead.v1` core messages."""

from __future__ import annotations

import grpc

from scheduler_svc.contract import CoreRequestSpec, SamplingParams, StepOutputs, TokenLogprob
from stepahead.packed import I32, U8, U64, pack, unpack
from stepahead.protocol import WorkerInfo, constraint_of, info_to_proto, same_fields
from stepahead.v1 import core_pb2

# SamplingParams' scalars, the same in CoreSampling (stop ids, stop strings and the bias aside).
SAMPLING_FIELDS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "logprobs",
    "top_logprobs",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_tokens",
    "min_p",
)


def params_to_proto(p: SamplingParams) -> core_pb2.CoreSampling:
    msg = core_pb2.CoreSampling(
        **same_fields(p, SAMPLING_FIELDS),
        stop_token_ids=sorted(p.stop_token_ids),
        bias_ids=[token for token, _ in p.logit_bias],
        bias_values=[bias for _, bias in p.logit_bias],
    )
    if p.constraint is not None:
        msg.constraint.CopyFrom(core_pb2.Constraint(kind=p.constraint.kind, text=p.constraint.text))
    if p.prompt_logprobs is not None:
        msg.prompt_logprobs = p.prompt_logprobs
    return msg


# A field the wire leaves out holds its zero (proto3), whatever SamplingParams' own default.
_SAMPLING_ZEROS = {
    name: core_pb2.CoreSampling.DESCRIPTOR.fields_by_name[name].default_value for name in SAMPLING_FIELDS
}


def params_from_proto(m: core_pb2.CoreSampling) -> SamplingParams:
    """Stop strings stay in the frontend: the core's copy has none.

    NOTE: read through `ListFields` (the fields set, in one call): every request that reaches the
    core is read here, and a field read by name costs the protobuf runtime a lookup and, for a
    repeated one, a container even when empty."""
    given = {field.name: value for field, value in m.ListFields()}
    scalars = {name: given.get(name, zero) for name, zero in _SAMPLING_ZEROS.items()}
    constraint = given.get("constraint")
    return SamplingParams(
        **scalars,
        stop_token_ids=frozenset(given.get("stop_token_ids", ())),
        stop=(),
        logit_bias=tuple(zip(given.get("bias_ids", ()), given.get("bias_values", ()), strict=True)),
        constraint=None if constraint is None else constraint_of(constraint.kind, constraint.text),
        prompt_logprobs=given.get("prompt_logprobs"),
    )


def spec_to_proto(spec: CoreRequestSpec) -> core_pb2.NewCoreRequest:
    return core_pb2.NewCoreRequest(
        handle=spec.handle,
        request_id=spec.rid,
        prompt_ids=spec.prompt_ids,
        sampling=params_to_proto(spec.params),
        arrival_unix_s=spec.arrival_time,
        index=spec.index,
    )


def spec_from_proto(m: core_pb2.NewCoreRequest) -> CoreRequestSpec:
    return CoreRequestSpec(
        m.handle, m.request_id, list(m.prompt_ids), params_from_proto(m.sampling), m.arrival_unix_s, m.index
    )


def outputs_to_proto(outputs: StepOutputs) -> core_pb2.StepOutputs:
    msg = core_pb2.StepOutputs(
        handles=pack(U64, outputs.handles),
        token_ids=pack(I32, outputs.token_ids),
        finish_reasons=pack(U8, outputs.finish_reasons),
        errors=[
            core_pb2.RequestError(handle=h, code=grpc.StatusCode[code].value[0], message=message)
            for h, code, message in outputs.errors
        ],
    )
    if outputs.logprobs:
        msg.logprob_entries.extend(outputs.logprob_entries)
        for lp in outputs.logprobs:
            msg.logprobs.append(lp.logprob)
            msg.top_counts.append(len(lp.top_ids))
            msg.top_ids.extend(lp.top_ids)
            msg.top_logprobs.extend(lp.top_logprobs)
    msg.cached_entries.extend(outputs.cached_entries)
    msg.cached_tokens.extend(outputs.cached_tokens)
    for entry, prompt in zip(outputs.prompt_entries, outputs.prompt_logprobs, strict=True):
        top_n = len(prompt[0].top_ids) if prompt else 0
        msg.prompt_logprobs.append(
            core_pb2.PromptLogprobs(
                entry=entry,
                logprobs=[lp.logprob for lp in prompt],
                top_n=top_n,
                top_ids=[i for lp in prompt for i in lp.top_ids],
                top_logprobs=[v for lp in prompt for v in lp.top_logprobs],
            )
        )
    return msg


_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


def outputs_from_proto(m: core_pb2.StepOutputs) -> StepOutputs:
    return StepOutputs(
        unpack(U64, m.handles, "handles"),
        unpack(I32, m.token_ids, "token_ids"),
        unpack(U8, m.finish_reasons, "finish_reasons"),
        [(e.handle, _CODE_NAMES.get(e.code, "UNKNOWN"), e.message) for e in m.errors],
        list(m.logprob_entries),
        _logprobs_from_proto(m),
        list(m.cached_entries),
        list(m.cached_tokens),
        [p.entry for p in m.prompt_logprobs],
        [_prompt_logprobs_from_proto(p) for p in m.prompt_logprobs],
    )


def _prompt_logprobs_from_proto(m: core_pb2.PromptLogprobs) -> tuple[TokenLogprob, ...]:
    n, ids, values = m.top_n, m.top_ids, m.top_logprobs
    if len(ids) != n * len(m.logprobs) or len(values) != len(ids):
        raise ValueError(f"prompt_logprobs: {len(ids)} alternatives for {len(m.logprobs)} tokens of {n}")
    return tuple(
        TokenLogprob(logprob, tuple(ids[i * n : (i + 1) * n]), tuple(values[i * n : (i + 1) * n]))
        for i, logprob in enumerate(m.logprobs)
    )


def _logprobs_from_proto(m: core_pb2.StepOutputs) -> list[TokenLogprob]:
    logprobs, start = [], 0
    for logprob, count in zip(m.logprobs, m.top_counts, strict=True):
        end = start + count
        logprobs.append(TokenLogprob(logprob, tuple(m.top_ids[start:end]), tuple(m.top_logprobs[start:end])))
        start = end
    return logprobs


def worker_state_to_proto(info: WorkerInfo | None, connected: bool) -> core_pb2.WorkerState:
    state = core_pb2.WorkerState(connected=connected)
    if info is not None:
        state.welcome.CopyFrom(info_to_proto(info))
    return state


# ---- the core's side -------------------------------------------------------------------------
