"""A small streaming client.

python -m stepahead_client --chat "What is the capital of France?"
python -m stepahead_client "Hello, my name is" --max-new-tokens 32
python -m stepahead_client "Hello" --server 10.0.0.1:50051,10.0.0.2:50051
python -m stepahead_client "Hello" --server dns:///schedulers.internal:50051
python -m stepahead_client --chat "Name a city, as JSON" --json-schema city.schema.json
python -m stepahead_client "The answer is" --choice yes --choice no
python -m stepahead_client --chat "Weather in Paris?" --tools tools.json --tool-choice required

With --tools, the reply's calls are printed after its text, one JSON object a line
({"id": ..., "name": ..., "arguments": ...}).

Several schedulers serving one model (replicas) are reached over one channel that balances
calls over them with gRPC's `round_robin` policy (`stepahead/targets.py`, which loadgen's gRPC
backend uses too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import grpc

from stepahead import event_loop
from stepahead.serving import API_KEY_ENV, pem_file
from stepahead.targets import open_target, split_servers
from stepahead.v1 import generation_pb2, generation_pb2_grpc

TEXT_MAX_NEW_TOKENS = 32
CHAT_MAX_NEW_TOKENS = 256  # an answer usually ends with EOS well before
DEFAULT_SERVER = "127.0.0.1:50051"
EXIT_BAD_SERVER = 2  # as argparse exits on a bad flag
SERVER_HELP = (
    "the scheduler HOST:PORT; replicas: several, comma-separated, or one gRPC target URI "
    "(dns:///NAME:PORT, ipv4:..., ipv6:...): calls go round robin over them"
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m stepahead_client")
    p.add_argument("prompt", help="the text to continue, or with --chat the user's message")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message (chat template)")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--server", default=DEFAULT_SERVER, metavar="HOST:PORT[,HOST:PORT...]", help=SERVER_HELP)
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens at most (default: {TEXT_MAX_NEW_TOKENS}, with --chat {CHAT_MAX_NEW_TOKENS})",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--repetition-penalty", type=float, default=None, help="> 0; 1 is off")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="-2..2")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="-2..2")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this many tokens")
    _add_structured_args(p)
    p.add_argument(
        "--tools",
        metavar="FILE",
        help="with --chat: tools the model may call, a JSON list as OpenAI's `tools` "
        '([{"type": "function", "function": {"name": ..., "parameters": {...}}}]; bare functions too)',
    )
    p.add_argument(
        "--tool-choice",
        default=None,
        metavar="none|auto|required|NAME",
        help="with --tools: whether the reply may (auto, the default), must (required) or must not "
        "(none) call, or must call the tool NAME",
    )
    p.add_argument("--no-parallel-tool-calls", action="store_true", help="with --tools: one call at most")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})",
    )
    p.add_argument(
        "--tls-ca", type=pem_file, metavar="PEM", help="connect over TLS, trusting this CA for the server"
    )
    p.add_argument(
        "--tls-cert", type=pem_file, metavar="PEM", help="client certificate, for a server that requires one"
    )
    p.add_argument("--tls-key", type=pem_file, metavar="PEM", help="private key of --tls-cert")
    args = p.parse_args(argv)
    if (args.tls_cert is None) != (args.tls_key is None):
        p.error("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        p.error("--tls-cert needs --tls-ca")
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    if args.max_new_tokens is None:
        args.max_new_tokens = CHAT_MAX_NEW_TOKENS if args.chat else TEXT_MAX_NEW_TOKENS
    if (args.tools is not None or args.tool_choice is not None) and not args.chat:
        p.error("--tools and --tool-choice need --chat")
    try:
        args.json_schema = _schema_text(args.json_schema)
        args.grammar = _file_text(args.grammar, "--grammar")
        args.tools = _tools(args.tools)
    except ValueError as exc:
        p.error(str(exc))
    try:
        args.servers = split_servers(args.server)
    except ValueError as exc:
        p.error(f"--server: {exc}")
    return args


def _add_structured_args(p: argparse.ArgumentParser) -> None:
    """One constraint at most: the output is held to it (the server refuses one that does not
    compile, naming its field)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--json-schema", metavar="FILE|JSON", help="a JSON Schema: a file, or the schema itself ({...})"
    )
    group.add_argument("--json-object", action="store_true", help="any JSON object")
    group.add_argument("--regex", help="a regular expression the whole output matches")
    group.add_argument("--choice", action="append", help="one of these strings (repeatable)")
    group.add_argument("--grammar", metavar="FILE", help="a Lark grammar (llguidance's dialect)")


def _schema_text(value: str | None) -> str | None:
    """A schema given inline (it starts with `{`) or as a file."""
    if value is None or value.lstrip().startswith("{"):
        return value
    return _file_text(value, "--json-schema")


def _file_text(path: str | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag}: cannot read {path}: {exc}") from None


def _tools(path: str | None) -> list[generation_pb2.Tool]:
    text = _file_text(path, "--tools")
    if text is None:
        return []
    try:
        listed = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--tools: {path} is not JSON: {exc}") from None
    if not isinstance(listed, list):
        raise ValueError(f"--tools: {path} holds no list of tools")
    tools = []
    for i, item in enumerate(listed):
        function = item.get("function", item) if isinstance(item, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"--tools: tool {i} of {path} has no function name")
        tool = generation_pb2.Tool(name=function["name"], description=function.get("description") or "")
        if function.get("parameters") is not None:
            tool.parameters = json.dumps(function["parameters"])
        if isinstance(function.get("strict"), bool):
            tool.strict = function["strict"]
        tools.append(tool)
    return tools


def open_channel(args: argparse.Namespace) -> grpc.aio.Channel:
    """Raises ValueError when a server's name cannot be resolved."""
    if args.tls_ca is None:
        return open_target(args.servers)
    credentials = grpc.ssl_channel_credentials(args.tls_ca, args.tls_key, args.tls_cert)
    return open_target(args.servers, credentials)


def call_metadata(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {args.api_key}"),) if args.api_key else ()


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateRequest:
    sampling = generation_pb2.SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        min_tokens=args.min_tokens,
    )
    if args.repetition_penalty is not None:
        sampling.repetition_penalty = args.repetition_penalty
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    _add_constraint(sampling, args)
    if not args.chat:
        return generation_pb2.GenerateRequest(text=args.prompt, sampling=sampling)
    turns = [("system", args.system)] if args.system is not None else []
    turns.append(("user", args.prompt))
    messages = [generation_pb2.ChatMessage(role=role, content=content) for role, content in turns]
    chat = generation_pb2.ChatMessages(messages=messages, tools=args.tools)
    if args.tool_choice in ("none", "auto", "required"):
        chat.tool_choice.mode = args.tool_choice
    elif args.tool_choice is not None:
        chat.tool_choice.function = args.tool_choice
    if args.no_parallel_tool_calls:
        chat.parallel_tool_calls = False
    return generation_pb2.GenerateRequest(messages=chat, sampling=sampling)


def _add_constraint(sampling: generation_pb2.SamplingParams, args: argparse.Namespace) -> None:
    if args.json_schema is not None:
        sampling.json_schema = args.json_schema
    elif args.json_object:
        sampling.json_object = True
    elif args.regex is not None:
        sampling.regex = args.regex
    elif args.choice is not None:
        sampling.choice.choices.extend(args.choice)
    elif args.grammar is not None:
        sampling.grammar = args.grammar


async def stream_reply(args: argparse.Namespace) -> int:
    try:
        opened = open_channel(args)
    except ValueError as exc:
        print(f"error: --server: {exc}", file=sys.stderr)
        return EXIT_BAD_SERVER
    async with opened as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        last: generation_pb2.GenerateResponse | None = None
        calls: dict[int, dict[str, str]] = {}
        try:
            async for last in stub.Generate(build_request(args), metadata=call_metadata(args)):
                sys.stdout.write(last.text)
                sys.stdout.flush()
                for delta in last.tool_calls:
                    call = calls.setdefault(
                        delta.index, {"id": delta.id, "name": delta.name, "arguments": ""}
                    )
                    call["arguments"] += delta.arguments
        except grpc.aio.AioRpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    for index in sorted(calls):
        print(("\n" if index == 0 else "") + json.dumps(calls[index], ensure_ascii=False))
    if last is not None:
        reason = generation_pb2.FinishReason.Name(last.finish_reason)
        which = last.WhichOneof("stop_reason")
        if which is not None:  # the stop string or stop token that ended it
            reason += f" at {json.dumps(getattr(last, which), ensure_ascii=False)}"
        print(
            f"\n[{reason}; {last.prompt_tokens} prompt + {last.completion_tokens} completion tokens]",
            file=sys.stderr,
        )
    return 0


def main(argv: list[str] | None = None) -> None:
    sys.exit(event_loop.run(stream_reply(parse_args(argv))))
