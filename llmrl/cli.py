"""The `llmrl` command.

    llmrl train [CONFIG] [--set key=value ...]      train (no CONFIG: the built-in demo)
    llmrl eval [CONFIG] [--set key=value ...]       evaluate a model on the config's environments
    llmrl serve-env CONFIG                          serve environments over HTTP
    llmrl serve-inference --model SPEC              serve a model over an OpenAI-compatible API
    llmrl serve-tinker --model SPEC                 serve LoRA training and sampling to the tinker SDK
    llmrl export SOURCE OUTPUT                      write a model as a plain Hugging Face folder
    llmrl config show [CONFIG] [--set key=value]    print the fully resolved config

The commands but `config` leave out the warnings, log lines and progress bars of the libraries llmrl
runs on, unless run with `--verbose` (`llmrl.quiet`); llmrl's own lines and every error show.

User mistakes (a `UserError`: a bad config, model spec or plug-in name; a missing or existing file)
print one clear message and exit with status 2; any other exception is a bug and keeps its traceback.
Ctrl-C exits with 130. A training run stops on SIGINT (Ctrl-C), SIGTERM or SIGHUP after it saves a
checkpoint (of the step in flight, or with `checkpoint.on_signal: save_now` of the last finished one)
and exits with 128 + the signal's number: 130, 143, 129 (`StoppedBySignal`). A training
run whose inference server, or an agent's environment server, stops answering exits with 75 and one
line saying which and since when (`ServerUnavailableError`; `eval` and `serve-env` too, for an
environment server); running the same command again resumes it. A training run whose own code (reward
functions, agent programs) keeps failing exits with 1 and one line naming the failure (`UserCodeError`);
so does one whose run folder cannot be written (a full disk), saying which checkpoint the same command
resumes from. A run folder another run is training in is refused (2); a run that already ran more
steps than asked says so and exits with 0.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from llmrl.config import ConfigError, RunConfig, dump_config, load_config
from llmrl.errors import ServerUnavailableError, UserCodeError, UserError
from llmrl.quiet import quiet_libraries
from llmrl.stopping import StoppedBySignal
from llmrl.threads import bound_openmp_spinning, set_torch_threads

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT
EXIT_TRY_AGAIN = 75  # sysexits.h EX_TEMPFAIL: a temporary failure, the same command may succeed later
_REEXEC_MARK = "LLMRL_RUN_WITH_VLLM"  # set in a command run again with vLLM's interpreter
# Where torch's threads matter (llmrl.threads).
_COMMANDS_THAT_COMPUTE = ("train", "eval", "serve-inference", "serve-tinker")


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
    agents = build_agents(config.environments, config.seed, model_spec=config.model.spec)
    inference = build_inference(config.inference_for_run(), config.model, seed=config.seed)
    try:
        summary = run_sync(
            evaluate_environments(agents, inference, config.evaluation, config.inference.generation)
        )
    finally:
        inference.close()
    # Off a terminal rich assumes 80 columns and would abbreviate the metric names.
    Console(width=None if sys.stdout.isatty() else 120).print(summary_table(summary, title))
    return summary


def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def cmd_eval(args: argparse.Namespace) -> int:
    from llmrl.trainer.evaluated_model import find_evaluated_model, run_model, with_model_folder

    if args.model is not None:
        model = find_evaluated_model(args.model)
        # Without a config, a run's checkpoint is evaluated on what its run trained and evaluated on.
        config = load_config(args.config or model.run_config, args.overrides)
    else:
        config = with_model_folder(_load(args))
        model = run_model(config.run_dir, config.model.spec)
    _run_where_vllm_is(config, args)
    environments = [env.name for env in config.environments]
    print(
        f"evaluating {model.description} on {', '.join(environments)}: the first "
        f"{config.evaluation.num_prompts} held-out problems{' of each' if len(environments) > 1 else ''}"
    )
    print(set_torch_threads().describe())
    with model.served(config.model) as served:
        summary = _evaluate(config.model_copy(update={"model": served}), f"evaluation of {model.description}")
    # A model of no run lands in the run of a config given, never in the built-in demo's run folder.
    config_run_dir = config.run_dir if args.config is not None else None
    out = Path(args.output) if args.output else model.results_path(config_run_dir)
    checkpoint = str(model.checkpoint) if model.checkpoint is not None else None
    _write_json(out, {"model": model.description, "checkpoint": checkpoint, "evaluation": summary})
    print(f"wrote {out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from llmrl.evaluation import summary_table
    from llmrl.trainer import Trainer
    from llmrl.trainer.run_folder import RunFolderWriteError
    from llmrl.trainer.trainer import AlreadyTrainedError

    config = _load(args)
    _run_where_vllm_is(config, args)
    try:
        trainer = Trainer(config, resume=args.resume)  # its first weight sync may find the server gone
        if trainer.resumed and trainer.is_main:
            print(f"resuming {config.run_dir} from its checkpoint at step {trainer.step}")
        summary = trainer.run()
    except AlreadyTrainedError as exc:
        print(exc)
        return 0
    except ServerUnavailableError as exc:  # the inference, a teacher or an environment server
        print(f"llmrl train: stopped: {exc}", file=sys.stderr)
        return EXIT_TRY_AGAIN
    except RunFolderWriteError as exc:  # a full disk, a read-only file system: the message says what is kept
        print(f"llmrl train: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    if not trainer.is_main:  # under torchrun, rank 0 reports
        return 0
    console = Console(width=None if sys.stdout.isatty() else 120)
    for key, title in (
        ("eval_start", "before training (step 0)"),
        ("eval_end", f"after {summary['steps']} steps"),
    ):
        if summary[key]:
            console.print(summary_table(summary[key], f"held-out evaluation {title}"))
    for env, change in _improvement(summary).items():
        print(f"{env}: sampled accuracy (pass@1) {change}")
    print(f"run folder: {config.run_dir} (metrics.jsonl, curves.png, checkpoints/)")
    return 0


def _run_where_vllm_is(config: RunConfig, args: argparse.Namespace) -> None:
    """Colocated vLLM runs in the trainer's process: when this interpreter lacks vllm, the command
    runs again, whole, with the one that has it (`VLLMConfig.python`'s search: `.venv-vllm`). Without
    `--verbose` it logs errors alone (a managed server logs everything, to its file)."""
    import importlib.util

    from llmrl.inference.vllm import find_vllm_python

    inference = config.inference
    if inference.type != "vllm" or inference.vllm.mode != "colocate":
        return
    if not args.verbose:  # read as vLLM is imported, which sets its loggers' levels from it
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if importlib.util.find_spec("vllm"):
        return
    python = find_vllm_python(inference.vllm.python)
    # Not resolved: a virtual environment's python is a link to the same interpreter as others.
    if os.environ.get(_REEXEC_MARK) or Path(python).absolute() == Path(sys.executable).absolute():
        raise ConfigError(
            f"inference.vllm.mode: colocate needs vllm in the trainer's interpreter, and {python} has none: "
            "run `bash scripts/setup.sh vllm` or set inference.vllm.python"
        )
    print(
        f"llmrl {args.command}: vLLM runs in the trainer's process (inference.vllm.mode: colocate): "
        f"running with {python}",
        file=sys.stderr,
    )
    sys.stderr.flush()
    sys.stdout.flush()
    os.environ[_REEXEC_MARK] = "1"
    os.execv(python, [python, "-m", "llmrl", *args.argv])


def _improvement(summary: dict) -> dict[str, str]:
    """Per environment, 'before -> after (+N points)' of pass@1 when both evaluations have it."""
    lines = {}
    for env, end in summary["eval_end"].items():
        start = summary["eval_start"].get(env, {})
        if "pass@1" in start and "pass@1" in end:
            points = 100 * (end["pass@1"] - start["pass@1"])
            lines[env] = f"{start['pass@1']:.3f} -> {end['pass@1']:.3f} ({points:+.1f} points)"
    return lines


def _server_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per inference call drowns the rest


def cmd_serve_env(args: argparse.Namespace) -> int:
    from llmrl.server.common import resolve_api_key
    from llmrl.server.env_server import serve_env
    from llmrl.trainer.evaluated_model import with_model_folder

    _server_logging()
    # A run or checkpoint folder as model.spec: the agents' tokenizers load from its model folder.
    serve_env(
        with_model_folder(_load(args)),
        host=args.host,
        port=args.port,
        api_key=resolve_api_key(args.api_key),
        inference_urls=args.inference_urls,
    )
    return 0


def cmd_serve_inference(args: argparse.Namespace) -> int:
    from llmrl.config import ModelConfig
    from llmrl.server.inference_server import serve_inference
    from llmrl.trainer.evaluated_model import find_evaluated_model

    _server_logging()
    logging.getLogger("llmrl").info(set_torch_threads().describe())
    # What `llmrl eval --model` evaluates: a run folder its latest checkpoint, a LoRA one merged onto its base.
    model = find_evaluated_model(args.model)
    print(f"serving {model.description}", flush=True)
    with model.served(ModelConfig(dtype=args.dtype)) as served:
        serve_inference(
            served.spec,
            model_name=args.model,
            host=args.host,
            port=args.port,
            api_key=args.api_key,
            weights_dir=args.weights_dir,
            dtype=args.dtype,
            seed=args.seed,
            max_batch_tokens=args.max_batch_tokens,
            max_concurrent=args.max_concurrent,
            weight_update=args.weight_update,
            cuda_graphs=args.cuda_graphs,
        )
    return 0


def cmd_serve_tinker(args: argparse.Namespace) -> int:
    try:
        from llmrl.server.tinker import serve_tinker
    except ModuleNotFoundError as missing:
        if missing.name != "tinker":
            raise
        raise UserError("serve-tinker needs the tinker SDK: bash scripts/setup.sh tinker") from None

    _server_logging()
    logging.getLogger("llmrl").info(set_torch_threads().describe())
    serve_tinker(
        args.model,
        host=args.host,
        port=args.port,
        lora_rank_max=args.lora_rank_max,
        seed=args.seed,
        storage=Path(args.storage),
        max_samplers=args.max_samplers,
    )
    return 0


def _add_server_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default: loopback only)")
    parser.add_argument(
        "--port", type=int, default=default_port, help=f"port to listen on (default {default_port})"
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="bearer token every request must send (default: $LLMRL_API_KEY, else none)",
    )


def cmd_export(args: argparse.Namespace) -> int:
    from llmrl.models import export_model
    from llmrl.trainer.evaluated_model import find_evaluated_model
    from llmrl.trainer.lora import merge_adapter

    # What `llmrl eval --model` evaluates: a run folder its latest checkpoint, a LoRA one merged onto its base.
    model = find_evaluated_model(args.source)
    if model.adapter is None:
        path = export_model(model.spec, args.output, dtype=args.dtype)
    else:
        trust_remote_code = (
            model.run_config is not None and load_config(model.run_config).model.trust_remote_code
        )
        path = merge_adapter(
            model.adapter, model.spec, args.output, dtype=args.dtype, trust_remote_code=trust_remote_code
        )
    print(f"wrote {model.description} as a Hugging Face model folder: {path}")
    return 0


def _installed_version() -> str:
    """The installed distribution's version, what a bug report needs (pip's record, not a second copy
    kept in the code); a source tree put on the path without installing has none."""
    try:
        return importlib.metadata.version("llmrl")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: no version)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmrl",
        description="Reinforcement-learning post-training of language models.",
    )
    parser.add_argument("--version", action="version", version=f"llmrl {_installed_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def command(
        name: str, handler: Callable[[argparse.Namespace], int], help: str
    ) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        sub.add_argument(
            "--verbose",
            action="store_true",
            help="also show the warnings, log lines and progress bars of the libraries llmrl runs on "
            "(transformers, datasets, the Hugging Face hub, ...), which are left out by default",
        )
        return sub

    train = command("train", cmd_train, "Train a policy with GRPO-family RL (no CONFIG: the built-in demo).")
    _add_config_arguments(train, required=False)
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the run folder's latest checkpoint even if the config changed "
        "(an unchanged config resumes without it)",
    )

    evaluate = command(
        "eval",
        cmd_eval,
        "Evaluate a model (pass@k, greedy accuracy) on the config's environments; without --model, the "
        "config's run's latest checkpoint (its untrained model.spec while it has none).",
    )
    _add_config_arguments(evaluate, required=False)
    evaluate.add_argument(
        "--model",
        metavar="PATH",
        help="model to evaluate: a run folder (its latest checkpoint), a checkpoint or LoRA adapter "
        "folder (merged onto its base), a Hugging Face model folder or a model spec; a run's own "
        "config is used when no CONFIG is given",
    )
    evaluate.add_argument(
        "--output",
        metavar="PATH",
        help="JSON file to write the results to (default: RUN/eval-step_NNNNNN.json for a run's "
        "checkpoint, else eval-MODEL.json in the config's run folder, or in the current folder "
        "without a CONFIG)",
    )

    serve_env = command("serve-env", cmd_serve_env, "Serve the config's environments over HTTP.")
    _add_config_arguments(serve_env, required=True)
    _add_server_arguments(serve_env, default_port=8100)
    serve_env.add_argument(
        "--inference-url",
        dest="inference_urls",
        action="append",
        default=[],
        metavar="URL",
        help="an inference base URL requests may name (repeatable; the config's inference.base_url is one); "
        "only these receive the inference token, others are refused",
    )

    serve_inference = command(
        "serve-inference", cmd_serve_inference, "Serve a model over an OpenAI-compatible HTTP API."
    )
    serve_inference.add_argument(
        "--model",
        required=True,
        help="model to serve: a run folder (its latest checkpoint), a checkpoint or LoRA adapter folder "
        "(merged onto its base), a Hugging Face model folder or a model spec (tiny://arithmetic, a hub id)",
    )
    _add_server_arguments(serve_inference, default_port=8000)
    serve_inference.add_argument(
        "--weights-dir", default=None, help="the only folder POST /v1/weights may load files from"
    )
    serve_inference.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    serve_inference.add_argument("--seed", type=int, default=0, help="seeds requests that carry no seed")
    serve_inference.add_argument(
        "--max-batch-tokens", type=int, default=8192, help="KV-cache admission budget"
    )
    serve_inference.add_argument(
        "--max-concurrent", type=int, default=64, help="most sequences decoded together"
    )
    serve_inference.add_argument(
        "--weight-update",
        default="wait",
        choices=["wait", "abort", "in_flight"],
        help="what a weight update does with running requests (inference.weight_update)",
    )
    serve_inference.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="decode steps at fixed shapes, replayed as CUDA graphs (inference.cuda_graphs)",
    )

    serve_tinker = command(
        "serve-tinker",
        cmd_serve_tinker,
        "Serve LoRA training and sampling over the Tinker API, to the official tinker SDK (docs/tinker.md).",
    )
    serve_tinker.add_argument(
        "--model",
        required=True,
        action="append",
        help="a base model clients may train (repeatable): a model spec (tiny://arithmetic, a hub id) or folder",
    )
    serve_tinker.add_argument(
        "--host", default="127.0.0.1", help="interface to bind (default: loopback only)"
    )
    serve_tinker.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    serve_tinker.add_argument(
        "--lora-rank-max", type=int, default=64, help="largest LoRA rank a client may ask for (default 64)"
    )
    serve_tinker.add_argument(
        "--seed", type=int, default=0, help="seeds adapters and samples that carry no seed"
    )
    serve_tinker.add_argument(
        "--storage",
        default="tinker_storage",
        help="folder of saved states and sampler weights, kept across restarts (default ./tinker_storage)",
    )
    serve_tinker.add_argument(
        "--max-samplers",
        type=int,
        default=4,
        help="samplers a session keeps, each a copy of its model; the least recently used goes (default 4)",
    )

    export = command(
        "export",
        cmd_export,
        "Write a model (spec or folder) as a plain Hugging Face model folder; a LoRA run's adapter is "
        "merged into its base model.",
    )
    export.add_argument(
        "source",
        help="run or checkpoint folder, model spec (tiny://arithmetic), Hugging Face folder or hub id",
    )
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
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command in _COMMANDS_THAT_COMPUTE:
        bound_openmp_spinning()  # before anything loads torch
    if not getattr(args, "verbose", True):  # `llmrl config` loads no library
        quiet_libraries()
    try:
        return args.handler(args)
    except UserCodeError as exc:  # the run started: what failed is the user's code, not its config
        print(f"llmrl {args.command}: stopped: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (UserError, FileExistsError, FileNotFoundError) as exc:
        print(f"llmrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ServerUnavailableError as exc:  # `eval` or `serve-env` found an environment server down
        print(f"llmrl {args.command}: stopped: {exc}", file=sys.stderr)
        return EXIT_TRY_AGAIN
    except StoppedBySignal as stop:  # the run said what it saved
        print(f"llmrl {args.command}: stopped by {stop.name}", file=sys.stderr)
        return stop.exit_status
    except KeyboardInterrupt:
        print(f"llmrl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (
        RuntimeError
    ) as exc:  # inference servers that would not start or take weights: their message says why
        if not _is_inference_failure(exc):
            raise
        print(f"llmrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _is_inference_failure(exc: BaseException) -> bool:
    from llmrl.inference.vllm import VLLMStartError
    from llmrl.weights import WeightSyncError

    return isinstance(exc, (WeightSyncError, VLLMStartError))


if __name__ == "__main__":
    sys.exit(main())
