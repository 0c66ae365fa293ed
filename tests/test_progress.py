"""One progress display per command (attnkit.progress) and the libraries' own output kept quiet."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from attnkit import progress


def _console(buffer):
    from rich.console import Console

    return lambda: Console(file=buffer, force_terminal=True, width=120)


def test_phases_are_no_ops_without_a_display():
    with progress.phase("work", 3, "steps") as advance:
        advance(3)
    assert progress._display is None


def test_a_display_shows_every_phase_with_its_count_and_unit():
    buffer = io.StringIO()
    with progress.display(_console(buffer), force=True):
        with progress.phase("calibrating on 512 tokens", 2, "layers") as advance:
            advance()
            advance()
        with progress.phase("writing out", 5, "tensors") as advance:
            advance(5)
    text = buffer.getvalue()
    assert "calibrating on 512 tokens" in text and "2/2" in text and "layers" in text
    assert "writing out" in text and "5/5" in text and "tensors" in text and "ETA" in text
    assert progress._display is None


def test_no_display_when_stderr_is_not_a_terminal(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False, raising=False)
    with progress.display():
        assert progress._display is None


def test_calibration_reports_its_layers(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    from attnkit.runtime.calibrate import calibrate

    model = AutoModelForCausalLM.from_pretrained(str(tiny("llama_gqa"))).eval()
    buffer = io.StringIO()
    with progress.display(_console(buffer), force=True):
        calibrate(
            model, torch.randint(3, 200, (2, 16)), [f"model.layers.{i}.self_attn" for i in range(2)], lambda *_: None
        )
    assert "calibrating on 32 tokens" in buffer.getvalue() and "2/2" in buffer.getvalue()


def test_cli_runs_keep_library_bars_and_warnings_out_of_a_stderr_file(tmp_path):
    code = (
        "import os, sys, warnings\nfrom attnkit.cli.common import quiet_libraries\nquiet_libraries()\n"
        "warnings.warn('old api', FutureWarning)\nwarnings.warn('older api', DeprecationWarning)\n"
        "from tqdm.auto import tqdm\nfor _ in tqdm(range(3), desc='library bar'):\n    pass\n"
        "print(os.environ['TRANSFORMERS_VERBOSITY'])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "ATTNKIT_DEBUG", "TRANSFORMERS_VERBOSITY")}
    with open(tmp_path / "err.txt", "w") as err:
        out = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "error"
    assert (tmp_path / "err.txt").read_text() == ""


def test_data_on_stdout_is_not_redirected_and_the_display_stops_between_phases(capsys):
    buffer = io.StringIO()
    with progress.display(_console(buffer), force=True):
        with progress.phase("scoring", 2, "windows") as advance:
            print("printed during a phase")
            advance(2)
        assert progress._display.progress is None  # no live display while the command renders its data
        print('{"data": 1}')
        with progress.phase("writing", 1, "tensors") as advance:
            advance()
    out = capsys.readouterr().out
    assert "printed during a phase" in out and '{"data": 1}' in out
    assert "data" not in buffer.getvalue() and "scoring" in buffer.getvalue() and "writing" in buffer.getvalue()


def test_a_phase_shows_a_bracketed_path_as_it_is():
    buffer = io.StringIO()
    with progress.display(_console(buffer), force=True):
        with progress.phase("writing runs/[test]", 1, "tensors") as advance:
            advance(1, note="[bold]x")
    assert "writing runs/[test]" in buffer.getvalue() and "[bold]x" in buffer.getvalue()
