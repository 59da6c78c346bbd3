"""The trainer's progress display (read back from a StringIO stream) and its curve plots (read back as
PNG)."""

from __future__ import annotations

import io
import math

import matplotlib.image
import pytest

from llmrl.config import load_config
from llmrl.trainer import Trainer
from llmrl.trainer.plots import plot_curves
from llmrl.trainer.progress import ProgressDisplay, format_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

FULL_METRICS = {
    "reward/mean": 0.41234,
    "reward/pass_rate": 0.375,
    "train/kl": 0.0012,
    "train/ref_kl": 0.0012,
    "train/approx_kl": 0.5,
    "perf/tokens_per_s": 5123.4,
    "time/step_s": 1.8,
    "train/loss": 3.0,
}


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ---------------------------------------------------------------- ProgressDisplay


def test_format_metrics_shows_headline_metrics_in_order():
    assert format_metrics(FULL_METRICS) == "reward 0.412  pass 0.375  kl 0.0012  tok/s 5123  1.8 s/step"


def test_format_metrics_shows_kl_only_with_a_kl_term_and_omits_missing_keys():
    # A run without a KL term logs train/kl as KL(pi_old || pi), 0 with one mini-batch: no "kl 0".
    assert format_metrics({"train/kl": 0.0, "train/approx_kl": 0.0, "time/step_s": 12.0}) == "12 s/step"
    with_kl_term = {"train/kl": 0.25, "train/ref_kl": 0.25, "time/step_s": 12.0}
    assert format_metrics(with_kl_term) == "kl 0.25  12 s/step"
    assert format_metrics({"train/loss": 1.0}) == ""


def test_plain_mode_prints_one_line_per_step():
    stream = io.StringIO()
    with ProgressDisplay(40, mode="plain", stream=stream) as display:
        display.update(1, FULL_METRICS)
        display.message("evaluation at step 1: pass@1 0.500")
        display.update(2, {"reward/mean": math.nan, "perf/tokens_per_s": 100.0})
        display.update(3, {})
    assert stream.getvalue().splitlines() == [
        "step 1/40  reward 0.412  pass 0.375  kl 0.0012  tok/s 5123  1.8 s/step",
        "evaluation at step 1: pass@1 0.500",
        "step 2/40  reward nan  tok/s 100",
        "step 3/40",
    ]


def test_plain_mode_counts_from_start_step_of_a_resumed_run():
    stream = io.StringIO()
    with ProgressDisplay(40, start_step=30, mode="plain", stream=stream) as display:
        display.update(31, {"reward/mean": 0.5})
    assert stream.getvalue() == "step 31/40  reward 0.500\n"


def test_off_mode_prints_nothing():
    stream = io.StringIO()
    with ProgressDisplay(10, mode="off", stream=stream) as display:
        display.update(1, FULL_METRICS)
        display.message("evaluation at step 1")
    assert stream.getvalue() == ""


def test_rich_mode_on_a_non_terminal_stream_ends_with_the_last_step():
    stream = io.StringIO()
    with ProgressDisplay(5, start_step=2, mode="rich", stream=stream) as display:
        assert display.mode == "rich"
        display.message("evaluation at step 2: [bold]pass@1[/bold] 0.5")
        for step in range(3, 6):
            display.update(step, FULL_METRICS)
    output = stream.getvalue()
    # Messages print verbatim (no rich markup), before the final bar.
    assert output.startswith("evaluation at step 2: [bold]pass@1[/bold] 0.5\n")
    final_bar = output.split("\n", 1)[1]
    assert "step 5/5" in final_bar
    assert "reward 0.412" in final_bar
    assert "eta " in final_bar


def test_auto_mode_uses_rich_on_a_terminal_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    assert ProgressDisplay(3, stream=io.StringIO()).mode == "plain"
    display = ProgressDisplay(3, stream=FakeTerminal())
    assert display.mode == "rich"
    display.close()
    monkeypatch.setenv("CI", "true")
    assert ProgressDisplay(3, stream=FakeTerminal()).mode == "plain"


def test_close_is_idempotent_and_later_updates_are_refused():
    display = ProgressDisplay(3, mode="rich", stream=io.StringIO())
    display.close()
    display.close()
    with pytest.raises(ValueError, match="closed"):
        display.update(1, {})
    with pytest.raises(ValueError, match="closed"):
        display.message("late")


@pytest.mark.parametrize(
    ("total_steps", "start_step", "mode"),
    [(-1, 0, "plain"), (5, 6, "plain"), (5, -1, "plain"), (5, 0, "fancy")],
)
def test_invalid_arguments_are_rejected(total_steps, start_step, mode):
    with pytest.raises(ValueError):
        ProgressDisplay(total_steps, start_step=start_step, mode=mode, stream=io.StringIO())


def test_a_run_prints_its_starting_evaluation_and_no_kl_without_a_kl_term(tmp_path):
    config = load_config(
        None,
        [
            f"run_dir={tmp_path}",
            "training.steps=1",
            "training.prompts_per_step=2",
            "training.group_size=2",
            "evaluation.num_prompts=2",
            "evaluation.samples_per_prompt=1",
            "evaluation.ks=[1]",
            "logging.progress=plain",
            "logging.tensorboard=false",
            "logging.trace=false",
        ],
    )
    stream = io.StringIO()
    Trainer(config, progress_stream=stream).run()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("memory plan")
    started, evaluated, stepped = lines[-3:]  # after the memory plan
    assert started.startswith("evaluation before training (step 0): arithmetic: pass@1 ")
    assert evaluated.startswith("evaluation at step 1: arithmetic: pass@1 ")
    assert stepped.startswith("step 1/1  reward ") and " kl " not in stepped  # kl_beta is 0


# ---------------------------------------------------------------- plot_curves


def read_png(path):
    """(height, width, channels) of a PNG file, after checking its signature."""
    assert path.read_bytes()[: len(PNG_MAGIC)] == PNG_MAGIC
    return matplotlib.image.imread(path).shape


def training_rows(steps, envs=("arith",)):
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "reward/mean": step / steps, "train/loss": 1.0 / step}
        row.update({f"reward/{env}/mean": step / steps / (i + 1) for i, env in enumerate(envs)})
        rows.append(row)
    return rows


def test_plot_with_training_rows_only(tmp_path):
    output = plot_curves(training_rows(5), tmp_path / "curves.png", title="run")
    assert output == tmp_path / "curves.png"
    height, width, channels = read_png(output)
    assert (height, width) == (450, 1200)
    assert channels in (3, 4)
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]  # no temporary file left behind


def test_plot_with_no_rows_and_with_one_row(tmp_path):
    assert read_png(plot_curves([], tmp_path / "empty.png"))[:2] == (450, 1200)
    assert read_png(plot_curves(training_rows(1), tmp_path / "one.png"))[:2] == (450, 1200)


def test_plot_with_nan_values_and_missing_keys(tmp_path):
    rows = training_rows(10, envs=("arith", "math"))
    rows[3]["reward/mean"] = math.nan
    rows[4]["reward/math/mean"] = math.nan
    del rows[5]["reward/arith/mean"]
    rows[6] = {"step": 7}
    rows[9]["eval/arith/pass@1"] = math.nan
    read_png(plot_curves(rows, tmp_path / "curves.png"))


def test_plot_with_evaluation_rows_differs_from_no_evaluation(tmp_path):
    rows = training_rows(20, envs=("arith", "math"))
    for step in (0, 10, 20):
        rows.append(
            {
                "step": step,
                "eval/arith/pass@1": 0.2 + step / 100,
                "eval/arith/pass@8": 0.5 + step / 100,
                "eval/arith/greedy_accuracy": 0.3,
                "eval/math/pass@1": 0.1,
                "eval/math/reward_mean": 0.4,  # not an accuracy: left out
            }
        )
    with_eval = plot_curves(rows, tmp_path / "with_eval.png")
    without_eval = plot_curves(training_rows(20, envs=("arith", "math")), tmp_path / "without_eval.png")
    assert read_png(with_eval) == read_png(without_eval)
    assert (matplotlib.image.imread(with_eval) != matplotlib.image.imread(without_eval)).any()


def test_plot_replaces_an_existing_file(tmp_path):
    output = tmp_path / "plots" / "curves.png"
    output.parent.mkdir()
    output.write_bytes(b"old contents")
    plot_curves(training_rows(3), output)
    read_png(output)
    assert [p.name for p in output.parent.iterdir()] == ["curves.png"]


def test_plot_of_many_rows_and_environments(tmp_path):
    rows = training_rows(1000, envs=("arith", "math", "code"))
    for row in rows[::50]:
        row.update({"eval/arith/pass@1": 0.5, "eval/arith/pass@4": 0.7, "eval/math/greedy_accuracy": 0.4})
    read_png(plot_curves(rows, tmp_path / "curves.png"))
