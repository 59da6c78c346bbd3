"""The `llmrl` command.

    llmrl train [CONFIG] [--set key=value ...]      train (no CONFIG: the built-in demo)
    llmrl eval [CONFIG] [--set key=value ...]       evaluate a model on the config's environments
    llmrl serve-env CONFIG                          serve environments over HTTP
    llmrl serve-inference --model SPEC              serve a model over an OpenAI-compatible API
    llmrl export SOURCE OUTPUT                      write a model as a plain Hugging Face folder
    llmrl config show [CONFIG] [--set key=value]    print the fully resolved config

User mistakes (bad config, missing file) print one clear message and exit with status 2;
commands whose machinery is not part of this version say so and exit with status 3.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from llmrl.config import ConfigError, dump_config, load_config
from llmrl.registry import RegistryError

EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3


class NotAvailableError(RuntimeError):
    """A command whose machinery this version of llmrl does not have yet."""


def _add_config_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "config",
        nargs=None if required else "?",
        metavar="CONFIG",
        help="YAML run config" + ("" if required else " (default: the built-in demo)"),
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set training.steps=20 (repeatable; value parsed as YAML)",
    )


def _load(args: argparse.Namespace):
    return load_config(args.config, args.overrides)


def cmd_config_show(args: argparse.Namespace) -> int:
    print(dump_config(_load(args)), end="")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    _load(args)
    raise NotAvailableError("`llmrl train` needs the trainer, which is not part of this version yet")


def cmd_eval(args: argparse.Namespace) -> int:
    _load(args)
    raise NotAvailableError("`llmrl eval` needs the evaluation agents, which are not part of this version yet")


def cmd_serve_env(args: argparse.Namespace) -> int:
    _load(args)
    raise NotAvailableError("`llmrl serve-env` (the environment server) is not part of this version yet")


def cmd_serve_inference(args: argparse.Namespace) -> int:
    raise NotAvailableError("`llmrl serve-inference` (the inference server) is not part of this version yet")


def cmd_export(args: argparse.Namespace) -> int:
    from llmrl.models import export_model

    path = export_model(args.source, args.output, dtype=args.dtype)
    print(f"wrote {args.source} as a Hugging Face model folder: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmrl",
        description="Reinforcement-learning post-training of language models.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(name: str, handler: Callable[[argparse.Namespace], int], help: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    train = command("train", cmd_train, "Train a policy with GRPO-family RL (no CONFIG: the built-in demo).")
    _add_config_arguments(train, required=False)
    train.add_argument("--resume", action="store_true", help="continue from the run folder's latest checkpoint")

    evaluate = command("eval", cmd_eval, "Evaluate a model (pass@k, greedy accuracy) on the config's environments.")
    _add_config_arguments(evaluate, required=False)

    serve_env = command("serve-env", cmd_serve_env, "Serve the config's environments over HTTP.")
    _add_config_arguments(serve_env, required=True)
    serve_env.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    serve_env.add_argument("--port", type=int, default=8100, help="port to listen on")

    serve_inference = command(
        "serve-inference", cmd_serve_inference, "Serve a model over an OpenAI-compatible HTTP API."
    )
    serve_inference.add_argument("--model", required=True, help="model spec: tiny://arithmetic, a folder or hub id")
    serve_inference.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    serve_inference.add_argument("--port", type=int, default=8000, help="port to listen on")

    export = command("export", cmd_export, "Write a model (spec or folder) as a plain Hugging Face model folder.")
    export.add_argument("source", help="model spec (tiny://arithmetic), Hugging Face folder or hub id")
    export.add_argument("output", help="folder to write (must not exist or be empty)")
    export.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])

    config = commands.add_parser("config", help="Inspect run configs.", description="Inspect run configs.")
    config_commands = config.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = config_commands.add_parser("show", help="Print the fully resolved config (defaults included).")
    _add_config_arguments(show, required=False)
    show.set_defaults(handler=cmd_config_show)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ConfigError, RegistryError, FileExistsError, FileNotFoundError) as exc:
        print(f"llmrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NotAvailableError as exc:
        print(f"llmrl {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
