"""Where one GRPO step of the demo spends its time, and what the packed row length costs.

    python bench/training_step.py [--prompts 32] [--repeats 3] [--row-tokens 256 512 1024 2048]

Builds the demo's trainer (tiny model, 2-digit addition; a temporary run folder), collects one
step's rollouts (`prompts x 8` samples) and times, best of `--repeats`:

- rollouts: generation + reward of the step through the embedded engine;
- update: `PolicyUpdate` on that batch (logprobs, loss, backward, AdamW) for each
  `training.pack_row_tokens` in `--row-tokens`, with `micro_batch_tokens` at its default (4096),
  with and without `training.share_prefixes`; each line says the row length the update picked
  (`llmrl.algorithms.packing.plan_rows`) and the tokens its rows hold;
- sync: `update_weights` of the engine with the policy's state dict.

On CPU, attention over a packed row costs its length squared (the sdpa kernel applies the
block-diagonal mask densely), so the update picks rows no longer than they need to be.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import tempfile
import time

import torch

from llmrl.algorithms.packing import unit_tokens
from llmrl.config import load_config
from llmrl.inference import run_sync
from llmrl.rollouts import prepare_batch
from llmrl.trainer import Trainer


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row-tokens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as run_dir:
        config = load_config(
            None, [f"run_dir={run_dir}", f"training.prompts_per_step={args.prompts}", "logging.progress=off"]
        )
        trainer = Trainer(config)
        group_size = config.training.group_size

        def collect():
            return run_sync(
                trainer.agents.group_rollouts(
                    trainer.inference, args.prompts, group_size, trainer.generation_args
                )
            )

        rollout_s = best_of(args.repeats, collect)
        groups = collect()
        batch, _ = prepare_batch(
            groups,
            group_size=group_size,
            algorithm=config.algorithm,
            max_tokens=config.inference.generation.max_tokens,
        )
        tokens = sum(len(r.tokens) for r in batch.rollouts)
        print(f"threads {torch.get_num_threads()}, {len(batch)} rollouts, {tokens} tokens")
        print(f"rollouts (generate + reward): {rollout_s:.3f} s")
        initial = copy.deepcopy(trainer.policy.state_dict())
        lengths = [len(s) for s in batch.sequences]
        trained = [
            i for i in range(len(batch)) if batch.advantages[i] != 0 or not trainer.update.skip_zero_advantage
        ]
        for row_tokens, share in itertools.product(args.row_tokens, (True, False)):
            trainer.update.passes.training = config.training.model_copy(
                update={"pack_row_tokens": row_tokens, "share_prefixes": share}
            )
            units, row_length = trainer.update.passes.layout(batch.sequences, batch.loss_masks, trained)
            laid_out = sum(unit_tokens(unit, lengths) for unit in units)

            def update():
                trainer.policy.load_state_dict(initial)
                trainer.update(batch, torch.Generator().manual_seed(0))

            print(
                f"update, pack_row_tokens={row_tokens:5d}, share_prefixes={share!s:5}: "
                f"{best_of(args.repeats, update):.3f} s (rows of <= {row_length} tokens, {laid_out} tokens)"
            )
        sync_s = best_of(
            args.repeats, lambda: trainer.inference.update_weights(trainer.policy.state_dict(), 1)
        )
        print(f"weight sync to the embedded engine: {sync_s * 1000:.1f} ms")


if __name__ == "__main__":
    main()
