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
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from llmrl.config import RunConfig, dump_config, load_config

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


def _evaluate(config: RunConfig, title: str) -> dict[str, dict[str, float]]:
    """Build the config's agents and inference, evaluate every environment and print the table."""
    from rich.console import Console

    from llmrl.agents import build_agents
    from llmrl.evaluation import evaluate_environments, summary_table
    from llmrl.inference import build_inference, run_sync
    from llmrl.registry import import_plugins

    import_plugins(config.plugins)
    agents = build_agents(config.environments, config.seed)
    inference = build_inference(config.inference, config.model, seed=config.seed)
    summary = run_sync(
        evaluate_environments(agents, inference, config.evaluation, config.inference.generation)
    )
    # Off a terminal rich assumes 80 columns and would abbreviate the metric names.
    Console(width=None if sys.stdout.isatty() else 120).print(summary_table(summary, title))
    return summary


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def cmd_eval(args: argparse.Namespace) -> int:
    config = _load(args)
    summary = _evaluate(config, f"evaluation of {config.model.spec}")
    out = Path(config.run_dir) / "eval.json"
    _write_json(out, {"model": config.model.spec, "evaluation": summary})
    print(f"wrote {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    config = _load(args)
    run_dir = Path(config.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(config))
    started = time.perf_counter()
    summary = _evaluate(config, f"starting policy: {config.model.spec}")
    _write_json(
        run_dir / "summary.json",
        {"eval_start": summary, "steps": 0, "seconds": round(time.perf_counter() - started, 3)},
    )
    print(
        f"Evaluated the starting policy; results in {run_dir / 'summary.json'}.\n"
        "The RL training loop (rollouts -> GRPO update -> weight sync) is not part of this version yet: "
        "this run stopped after the start-of-training evaluation."
    )
    return 0


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
    except (ValueError, FileExistsError, FileNotFoundError) as exc:  # user errors (ConfigError, RegistryError, ...)
        print(f"llmrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except NotAvailableError as exc:
        print(f"llmrl {args.command}: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE


if __name__ == "__main__":
    sys.exit(main())
