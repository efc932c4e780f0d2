"""The `infer` command line: generate, serve and bench."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TextIO

import torch

from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.generate import generate
from infer.engine.sampler import SamplingParams
from infer.models.loader import DEFAULT_SOURCE, LoadedModel, LoadError, load_model

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
EXIT_USAGE = 2  # argparse's code for bad arguments; also ours for bad models and parameters

Command = Callable[[argparse.Namespace], int]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``infer`` command line.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 when the model cannot be loaded or a parameter is
        invalid (a one-line message goes to stderr), 130 on Ctrl-C.
    """
    args = build_parser().parse_args(argv)
    command: Command = args.command
    try:
        return command(args)
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
    return parser


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """Arguments every command that loads a model shares."""
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
    p.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
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
    params = SamplingParams(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        repetition_penalty=args.repetition_penalty,
        stop=args.stop,
        seed=args.seed,
    )
    loaded = load_model(args.model, dtype=DTYPES[args.dtype])
    if args.chat and not loaded.chat_template:
        raise ValueError(f"{loaded.name} has no chat template; drop --chat")
    prompts = [args.prompt] if args.prompt is not None else _read_prompts(sys.stdin)
    for prompt in prompts:
        stream_completion(loaded, encode_prompt(loaded, prompt, args.chat), params, sys.stdout)
    return 0


# `infer serve` flags that map one to one onto EngineConfig / ServerConfig fields.
_ENGINE_FLAGS = ("model", "dtype", "device", "batching_mode", "max_batch_size", "max_seq_len",
                 "max_waiting_requests", "prefill_token_budget", "seed", "num_threads",
                 "block_size", "kv_cache_gb", "prefix_caching")
_SERVER_FLAGS = ("host", "port", "max_prompt_bytes", "max_body_bytes", "rate_limit",
                 "rate_burst", "heartbeat_s", "max_timeout_s", "output_buffer",
                 "max_pending_tokens", "resume_window_s")


def _add_serve(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "serve",
        help="serve the HTTP API (OpenAI-compatible and native SSE streams)",
        description="Serve the model over HTTP with Hypercorn (trio). Unset flags fall back "
        "to INFER_* environment variables (INFER_API_KEYS, INFER_CORS_ORIGINS, ...), then to "
        "the defaults. SIGINT/SIGTERM end open streams with a terminal event, then exit.",
    )
    p.add_argument("--host", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (default: 8000)")
    p.add_argument("--model", help="'default', a Hugging Face directory, a .gguf file or a hub id")
    p.add_argument("--dtype", choices=list(DTYPES))
    p.add_argument("--device", help="torch device (default: cpu)")
    p.add_argument("--batching-mode", choices=["continuous", "static"])
    for flag in ("--max-batch-size", "--max-seq-len", "--max-waiting-requests",
                 "--prefill-token-budget", "--seed", "--num-threads", "--max-prompt-bytes",
                 "--max-body-bytes", "--rate-burst", "--output-buffer", "--max-pending-tokens",
                 "--block-size"):
        p.add_argument(flag, type=int)
    p.add_argument("--kv-cache-gb", type=float,
                   help="KV cache budget in GB (default: 0.75, or less if enough)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_const",
                   const=False, default=None, help="do not reuse KV blocks of shared prefixes")
    p.add_argument("--rate-limit", type=float, help="requests per minute per client (off)")
    p.add_argument("--heartbeat-s", type=float, help="SSE heartbeat interval (default: 15)")
    p.add_argument("--max-timeout-s", type=float, help="cap on a request's run time (600)")
    p.add_argument("--resume-window-s", type=float,
                   help="how long a /v1/generate stream with a request_id waits for its "
                        "client to reconnect (default: 10)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="accepted bearer token (repeatable; prefer INFER_API_KEYS)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                   help="origin allowed by CORS (repeatable; '*' allows any)")
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(command=_serve)


def _serve(args: argparse.Namespace) -> int:
    from infer.server.config import ServerConfig
    from infer.server.serve import limit_malloc_arenas, run

    base = ServerConfig.from_env()
    engine = {f: getattr(args, f) for f in _ENGINE_FLAGS if getattr(args, f) is not None}
    server = {f: getattr(args, f) for f in _SERVER_FLAGS if getattr(args, f) is not None}
    if args.api_key:
        server["api_keys"] = tuple(args.api_key)
    if args.cors_origin:
        server["cors_origins"] = tuple(args.cors_origin)
    config = dataclasses.replace(
        base, engine=dataclasses.replace(base.engine, **engine), **server
    )
    handler = logging.StreamHandler()  # Hypercorn's own loggers keep their handlers
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("infer")
    logger.addHandler(handler)
    logger.setLevel(args.log_level.upper())
    limit_malloc_arenas()
    return run(config, access_log=args.access_log)


def _add_bench(commands: argparse._SubParsersAction) -> None:
    # The benchmark's code lives in infer/bench/ (so installed copies have it too); its
    # options and its command function come from there.
    from infer.bench.main import add_arguments

    p = commands.add_parser(
        "bench",
        help="benchmark serving against baselines; write a report with tables and charts",
        description="Start infer servers (static and continuous batching) on free loopback "
        "ports, or measure --url; run seeded workloads (W1 single, W2 mixed, a concurrency "
        "sweep) on them and on in-process baselines (sequential generate(), transformers "
        "generate(), llama-cpp-python when installed); write bench/results/<date>-<host>.json "
        "and .md plus PNG charts, and print the tables.",
    )
    add_arguments(p)


def encode_prompt(loaded: LoadedModel, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt, as a single user message of the chat template if ``chat``."""
    tokenizer = loaded.tokenizer
    if not chat:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "user", "content": prompt}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template already holds the special tokens (BOS, role markers).
    return list(tokenizer.encode(str(text), add_special_tokens=False))


def stream_completion(
    loaded: LoadedModel, prompt_ids: list[int], params: SamplingParams, out: TextIO
) -> None:
    """Generate a completion and write its text to ``out`` as it is produced."""
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
