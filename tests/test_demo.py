"""The CPU demo's report says what the run checked and that it measured no speed, and its stages show
progress while they run (the demo itself runs in about three minutes: README)."""

import time

import pytest

from openrlhf_oppo import demo


def test_pipeline_check_reports_mechanics_and_no_speed():
    results = {
        "upstream-sync": dict(steps=6, summary=dict(step_mean_s=3.0)),
        "oppo-both": dict(
            steps=6,
            summary=dict(
                step_mean_s=4.0,
                prefill_hidden_fraction=0.93,
                last_token_to_experience_s=0.41,
                carried_groups=2.0,
                fallback_micro_batches=0.0,
            ),
        ),
    }
    text = demo.pipeline_check(results, 3e-7)
    assert "| oppo-both | 6 | 93% | 0.41 | 2 | 0 |" in text
    assert "| upstream-sync | 6 | - | - | - | - |" in text
    assert "max |diff| 3.0e-07" in text and "no micro-batch the upstream way" in text
    assert "did not measure: speed" in text
    assert "speed-up" not in text.lower() and "3.00" not in text  # no step times, no ratios


def test_progress_ticks_with_the_steps_logged_and_lets_errors_through(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo, "PROGRESS_EVERY_S", 0.05)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "worker-1.err").write_text("INFO ✨ Global step 1: {...}\nINFO ✨ Global step 2: {...}\n")
    with demo._progress("a slow stage", lambda: f"{demo._steps_logged(str(logs))}/4 steps"):
        time.sleep(0.3)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[demo] a slow stage ..."
    assert out[1].endswith(", 2/4 steps") and out[-1].startswith("[demo]   done in")
    with pytest.raises(ZeroDivisionError):
        with demo._progress("a failing stage"):
            1 / 0
    assert "done" not in capsys.readouterr().out


def test_the_libraries_start_up_notices_are_held_back_and_everything_else_shown():
    """The lines torch, vLLM and DeepSpeed print as they import on a machine without a GPU; a warning's source
    line goes with it, and any other line, an error included, is shown."""
    from openrlhf_oppo import quiet

    printed = (
        "/x/torch/cuda/__init__.py:64: FutureWarning: The pynvml package is deprecated. Please install nvidia-ml-py.\n"
        "  import pynvml  # type: ignore[import]\n"
        "WARNING 12-06 21:06:40 [importing.py:83] Triton is installed, but `triton.backends` could not be imported.\n"
        "INFO 12-06 21:06:40 [importing.py:98] Triton not installed or not compatible; certain GPU-related functions\n"
        "[2026-12-06 21:06:41,068] [WARNING] [real_accelerator.py:199:get_accelerator] Setting accelerator to CPU.\n"
        "[openrlhf-oppo] OPPO on: intra-step streaming\n"
        "  an indented line of the run's own\n"
        "RuntimeError: CUDA out of memory\n"
    )
    assert quiet.shown(printed) == (
        "[openrlhf-oppo] OPPO on: intra-step streaming\n  an indented line of the run's own\n"
        "RuntimeError: CUDA out of memory\n"
    )
