"""``shiftjax client generate|chat|info --server HOST:PORT``: the gRPC API from a terminal.

Text is printed as it streams in; a summary (finish reason, tokens and how many of the
prompt's came from the prefix cache, time to first token, the modes the request's steps ran
in) goes to stderr. ``--json-schema``, ``--json-object``, ``--regex``, ``--choice`` and
``--grammar`` constrain the output (one of them at most). Imports no JAX, so it starts fast.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import grpc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shiftjax client", description="Talk to a shiftjax gRPC server.")
    connection = argparse.ArgumentParser(add_help=False)
    connection.add_argument("--server", default="127.0.0.1:50051", metavar="HOST:PORT")
    connection.add_argument("--api-key-file", type=Path, help="a file holding the server's bearer token")
    connection.add_argument("--tls", action="store_true", help="connect with TLS (system roots unless --tls-ca)")
    connection.add_argument("--tls-ca", type=Path, help="PEM file of the CA (or self-signed cert) to trust")
    connection.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-tokens", type=int, default=None)
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    sampling.add_argument("--stop-token-id", action="append", type=int, default=[], dest="stop_token_ids")
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--cache-salt", default=None, metavar="SALT",
                          help="share cached prompt pages only with requests of this salt (a tenant's secret)")
    sampling.add_argument("--disable-speculation", action="store_true",
                          help="keep this request out of speculative decoding on a server that speculates")
    sampling.add_argument("--json", action="store_true", help="print each streamed response as a JSON line")
    constraint = sampling.add_mutually_exclusive_group()  # structured outputs: one at most
    constraint.add_argument("--json-schema", type=_json_schema, default=None, metavar="FILE_OR_JSON",
                            help="the output is JSON matching this schema: a file, or the schema inline ('{...}')")
    constraint.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    constraint.add_argument("--regex", type=_non_empty, default=None, metavar="PATTERN",
                            help="the whole output matches this regular expression (Rust regex syntax)")
    constraint.add_argument("--choice", type=_non_empty, action="append", default=None,
                            help="the output is one of these strings (repeatable: --choice A --choice B)")
    constraint.add_argument("--grammar", type=_grammar_file, default=None, metavar="FILE",
                            help="the output matches this grammar: a file of Lark or GBNF")
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser("generate", parents=[connection, sampling], help="continue a prompt")
    generate.add_argument("prompt", nargs="?", default="")
    generate.add_argument("--prompt-ids", default=None, metavar="1,2,3", help="the prompt as token ids")
    chat = commands.add_parser("chat", parents=[connection, sampling], help="one user turn, chat template applied")
    chat.add_argument("message")
    chat.add_argument("--system", default=None, help="a system message before it")
    commands.add_parser("info", parents=[connection], help="model, mesh, modes, buckets, page pool, policy")
    return parser


def _json_schema(value: str) -> str:
    """``--json-schema``: inline JSON when it starts with '{', else a file holding it."""
    if value.lstrip().startswith("{"):
        text, where = value, "the inline schema"
    else:
        try:
            text, where = Path(value).read_text(), f"the file {value}"
        except OSError as error:
            raise argparse.ArgumentTypeError(f"cannot read the schema file {value!r} ({error.strerror or error}); "
                                             "give a file, or the schema inline as JSON starting with '{'") from None
    try:
        schema = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{where} is not valid JSON ({error})") from None
    if not isinstance(schema, (dict, bool)):
        raise argparse.ArgumentTypeError(f"{where} is not a JSON schema: it must be an object")
    return text


def _non_empty(value: str) -> str:
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def _grammar_file(value: str) -> str:
    try:
        text = Path(value).read_text()
    except OSError as error:
        raise argparse.ArgumentTypeError(f"cannot read the grammar file {value!r} "
                                         f"({error.strerror or error})") from None
    if not text.strip():
        raise argparse.ArgumentTypeError(f"the grammar file {value!r} is empty")
    return text


def _client(args):
    from shiftjax.serving.client.grpc_client import Client

    api_key = args.api_key_file.read_text().strip() if args.api_key_file else None
    root = args.tls_ca.read_bytes() if args.tls_ca else None
    return Client(args.server, api_key=api_key, tls=args.tls, root_certificates=root, timeout=args.timeout)


def _sampling_fields(args) -> dict:
    fields = {name: getattr(args, name) for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed")
              if getattr(args, name) is not None}
    if args.cache_salt is not None:
        fields["cache_salt"] = args.cache_salt
    if args.disable_speculation:
        fields["disable_speculation"] = True
    constraint = {name: getattr(args, name) for name in ("json_schema", "json_object", "regex", "choice", "grammar")
                  if getattr(args, name) not in (None, False)}
    if constraint:
        from shiftjax.serving.client.grpc_client import StructuredOutputs

        fields["structured_outputs"] = StructuredOutputs(**constraint)
    return fields | {"stop": args.stop, "stop_token_ids": args.stop_token_ids, "ignore_eos": args.ignore_eos}


def _stream(responses, as_json: bool) -> int:
    from google.protobuf.json_format import MessageToDict

    from shiftjax.serving.client.grpc_client import Completion

    completion = Completion()
    for response in responses:
        completion.add(response)
        if as_json:
            print(json.dumps(MessageToDict(response)), flush=True)
        else:
            print(response.text, end="", flush=True)
    if not as_json:
        print()
    usage = completion.usage
    if usage is not None:
        modes = ", ".join(f"{mode} x{count}" for mode, count in collections.Counter(usage.modes).items())
        print(f"[{completion.finish_reason}; {usage.prompt_tokens} prompt ({usage.cached_prompt_tokens} cached) + "
              f"{usage.output_tokens} output tokens; "
              f"queue {usage.queue_seconds * 1e3:.0f} ms, TTFT {usage.ttft_seconds * 1e3:.0f} ms, "
              f"total {usage.e2e_seconds:.2f} s; steps by mode: {modes or 'none'}]", file=sys.stderr)
    return 0


def client_main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    try:
        with _client(args) as client:
            if args.command == "info":
                from google.protobuf.json_format import MessageToDict

                info = MessageToDict(client.info(), preserving_proto_field_name=True)
                info["info"] = json.loads(info.pop("info_json", "{}"))
                for key in ("steps", "switches", "preemptions"):  # proto JSON writes int64 as strings
                    info[key] = int(info.get(key, 0))
                for key in ("steps_by_mode", "tokens_by_mode"):
                    info[key] = {mode: int(n) for mode, n in info.get(key, {}).items()}
                if speculative := info.get("speculative"):
                    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
                        speculative[key] = int(speculative.get(key, 0))
                    speculative["accepted_per_position"] = [int(n) for n in speculative.get("accepted_per_position", ())]
                print(json.dumps(info, indent=2))
                return 0
            fields = _sampling_fields(args)
            if args.command == "chat":
                messages = ([{"role": "system", "content": args.system}] if args.system else [])
                return _stream(client.chat(messages + [{"role": "user", "content": args.message}], **fields), args.json)
            if args.prompt_ids is not None:
                fields["prompt_ids"] = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
            return _stream(client.generate(args.prompt, **fields), args.json)
    except grpc.RpcError as error:
        print(f"\nshiftjax client: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as error:
        print(f"shiftjax client: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the stream's generator cancels the call on its way out
        return 130
