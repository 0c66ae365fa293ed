"""Task accuracy through lm-eval and pass-key retrieval: attnkit's numbers equal `lm_eval --model hf` on a stock
model, the paired difference is computed on the same items, pass-key prompts are what they claim, rewrites and
heal report both models, and bad input is refused before any model loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from attnkit.cli import app
from tests.helpers import PROSE, one_line_error, tiny_source

WORDS = ("harbour", "fishing", "boats", "gulls", "scraps", "water", "morning", "town")


def local_task(folder, name: str = "tiny_cloze", rows: int = 16):
    """A local lm-eval multiple-choice task (YAML and a JSON Lines file of its own) in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    with data.open("w") as fh:
        for i in range(rows):
            choices = [WORDS[(i + k) % len(WORDS)] for k in range(4)]
            fh.write(json.dumps({"context": PROSE[: 40 + 7 * i], "choices": choices, "label": i % 4}) + "\n")
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{context}}'\ndoc_to_choice: '{{choices}}'\n"
        "doc_to_target: '{{label}}'\nmetric_list:\n  - metric: acc\n    aggregation: mean\n"
        "    higher_is_better: true\n  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return folder


@pytest.fixture
def src(tmp_path):
    return tiny_source(tmp_path, "llama_gqa")


@pytest.fixture
def tasks_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return local_task(tmp_path / "tasks")


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_task_scores_equal_lm_eval_hf_on_a_stock_model(runner, src, tasks_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    doc = _json(
        runner.invoke(
            app,
            [
                "eval",
                str(src),
                "--tasks",
                "tiny_cloze",
                "--tasks-dir",
                str(tasks_dir),
                "--dtype",
                "float32",
                "--format",
                "json",
            ],
        )
    )
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={src},dtype=float32,device=cpu",
        tasks=["tiny_cloze"],
        task_manager=TaskManager(include_path=str(tasks_dir)),
    )
    expected = theirs["results"]["tiny_cloze"]
    rows = {r["metric"]: r for r in doc["tasks"]["model"]["rows"]}
    assert set(rows) == {"acc", "acc_norm"} and doc["perplexity"] is None and doc["tasks"]["reference"] is None
    for metric in ("acc", "acc_norm"):
        assert rows[metric]["value"] == expected[f"{metric},none"]
        assert rows[metric]["stderr"] == pytest.approx(expected[f"{metric}_stderr,none"])
        assert rows[metric]["n"] == 16


def test_paired_difference_on_the_same_items(runner, src, tasks_dir, tmp_path):
    other = tiny_source(tmp_path / "other", "llama_gqa", offset=3.0)
    doc = _json(
        runner.invoke(
            app,
            [
                "eval",
                str(other),
                "--reference",
                str(src),
                "--tasks",
                "tiny_cloze",
                "--tasks-dir",
                str(tasks_dir),
                "--format",
                "json",
            ],
        )
    )
    rows = doc["tasks"]["comparison"]
    assert {r["metric"] for r in rows} == {"acc", "acc_norm"}
    for row in rows:
        assert row["difference"] == pytest.approx(row["result"] - row["source"])
        assert row["ci95_low"] <= row["difference"] <= row["ci95_high"]
    same = _json(
        runner.invoke(
            app,
            [
                "eval",
                str(src),
                "--reference",
                str(src),
                "--tasks",
                "tiny_cloze",
                "--tasks-dir",
                str(tasks_dir),
                "--limit",
                "8",
                "--format",
                "json",
            ],
        )
    )
    assert all(
        r["difference"] == 0 and r["ci95_low"] == 0 == r["ci95_high"] and r["n"] == 8
        for r in same["tasks"]["comparison"]
    )


def test_paired_interval_matches_a_hand_computation():
    from attnkit.scoring.tasks import Z95, compare_tasks

    row = {"task": "t", "metric": "acc", "filter": "none", "stderr": None, "n": 4}
    source = {"rows": [{**row, "value": 0.5}], "items": {"t|acc|none": {0: 1, 1: 0, 2: 1, 3: 0}}}
    result = {"rows": [{**row, "value": 0.75}], "items": {"t|acc|none": {0: 1, 1: 1, 2: 1, 3: 0}}}
    (out,) = compare_tasks(source, result)
    # differences 0, 1, 0, 0: mean 0.25, sample sd 0.5, half width 1.96 * 0.5 / 2
    assert out["difference"] == 0.25
    assert out["ci95_low"] == pytest.approx(0.25 - Z95 * 0.25) and out["ci95_high"] == pytest.approx(0.25 + Z95 * 0.25)


def test_the_lm_eval_command_line_runs_attnkit_models(src, tasks_dir, tmp_path):
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from attnkit.runtime.lm_eval_model import main; main()",
            "run",
            "--model",
            "attnkit",
            "--model_args",
            f"pretrained={src},dtype=float32",
            "--tasks",
            "tiny_cloze",
            "--include_path",
            str(tasks_dir),
            "--output_path",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = out.rglob("results_*.json")
    assert json.loads(report.read_text())["results"]["tiny_cloze"]["acc,none"] >= 0


@pytest.mark.parametrize(
    "args, words",
    [
        (["--tasks", "tiny_clozee", "--tasks-dir", "{tasks}"], "unknown task 'tiny_clozee'; closest: tiny_cloze"),
        (["--tasks", "tiny_cloze", "--tasks-dir", "{empty}"], "holds no YAML task files"),
        (["--tasks", "tiny_cloze", "--tasks-dir", "{tasks}", "--limit", "0"], "--limit must be at least 1"),
        (["--tasks", "tiny_cloze,,x", "--tasks-dir", "{tasks}"], "empty item in the list"),
        (["--passkey", "0"], "not a positive whole token count: '0'"),
        (["--passkey", "10m"], "--passkey 10,485,760 is past"),
        (
            ["--passkey", "1k", "--passkey-variant", "echo"],
            "--passkey-variant must be one of repeat, named, distractors",
        ),
        (
            ["--text", PROSE, "--seq-len", "64", "--plot", "p.png"],
            "--plot draws pass-key accuracy or scores by distance",
        ),
        ([], "nothing to score"),
    ],
)
def test_bad_task_and_passkey_input_is_refused_before_a_model_loads(
    runner, src, tasks_dir, tmp_path, monkeypatch, args, words
):
    from attnkit.commands.analyse import eval as eval_command

    monkeypatch.setattr(eval_command, "open_model", lambda *a, **k: pytest.fail("a model loaded before the checks"))
    (tmp_path / "empty").mkdir()
    argv = ["eval", str(src), *[a.format(tasks=tasks_dir, empty=tmp_path / "empty") for a in args]]
    one_line_error(runner.invoke(app, argv), 2, words)


def test_without_lm_eval_the_error_names_the_extra(runner, src, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    one_line_error(
        runner.invoke(app, ["eval", str(src), "--tasks", "hellaswag"]),
        1,
        "task evaluation needs lm-eval: pip install 'attnkit[tasks]'",
    )


# ------------------------------------------------------------------ pass keys


def test_passkey_prompts_are_sized_placed_and_start_as_the_tokenizer_starts(src):
    from transformers import AutoTokenizer

    from attnkit.runtime.texts import prompt_ids
    from attnkit.scoring.passkey import ANSWER_TOKENS, FILLER, PasskeySpec, depths, probes

    tok = AutoTokenizer.from_pretrained(str(src))
    spec = PasskeySpec(lengths=(400, 500), depths=3, trials=2, seed=1)
    items = probes(tok, spec)
    assert len(items) == 2 * 3 * 2 and depths(3) == [0.0, 0.5, 1.0]
    for probe in items:
        ids = prompt_ids(tok, probe.text)
        assert probe.length - ANSWER_TOKENS - 100 < len(ids) <= probe.length - ANSWER_TOKENS
        assert probe.text.count(probe.answer) == 2 and len(probe.answer) == 5  # "is 71432 ... 71432 is"
        before, after = (part.count(FILLER) for part in probe.text.split(probe.answer, 1))
        assert before == round(probe.depth * (before + after))  # fillers before the key: the depth
    assert items == probes(tok, spec)  # seeded
    named = probes(tok, PasskeySpec(lengths=(500,), depths=1, trials=3, variant="named"))
    for probe in named:
        assert probe.text.count("pass key of the") == 4 + 2 and probe.text.count(probe.answer) == 1
    for probe in probes(tok, PasskeySpec(lengths=(500,), depths=1, trials=3, variant="distractors")):
        numbers = re.findall(r"\d{5}", probe.text)
        assert len(numbers) == 4 and numbers.count(probe.answer) == 1 and probe.text.count("pass key is") == 2


def test_passkey_scores_and_refusals(runner, src, tmp_path):
    doc = _json(
        runner.invoke(
            app,
            [
                "eval",
                str(src),
                "--passkey",
                "300,400",
                "--depths",
                "2",
                "--trials",
                "2",
                "--reference",
                str(src),
                "--plot",
                str(tmp_path / "pk.png"),
                "--format",
                "json",
            ],
        )
    )
    passkey = doc["passkey"]
    assert [r["length"] for r in passkey["model"]["by_length"]] == [300, 400]
    assert len(passkey["model"]["cells"]) == 4 and all(c["trials"] == 2 for c in passkey["model"]["cells"])
    assert all(r["difference"] == 0 for r in passkey["comparison"])  # the same model twice
    assert (tmp_path / "pk.png").stat().st_size > 0
    one_line_error(runner.invoke(app, ["eval", str(src), "--passkey", "1k"]), 2, "past")


# ------------------------------------------------------------------ rewrites and heal report both models


def test_a_rewrite_reports_tasks_and_pass_keys_source_beside_result(runner, src, tasks_dir, tmp_path):
    out = tmp_path / "mqa"
    report = _json(
        runner.invoke(
            app,
            [
                "convert",
                "mqa",
                str(src),
                str(out),
                "--eval-tasks",
                "tiny_cloze",
                "--eval-tasks-dir",
                str(tasks_dir),
                "--eval-passkey",
                "300",
                "--format",
                "json",
            ],
        )
    )
    evaluation = report["eval"]
    assert evaluation["perplexity"] is None  # no --eval text
    assert {r["metric"] for r in evaluation["tasks"]["comparison"]} == {"acc", "acc_norm"}
    assert evaluation["tasks"]["source"]["rows"] and evaluation["tasks"]["result"]["rows"]
    assert [r["length"] for r in evaluation["passkey"]["comparison"]] == [300]
    manifest = json.loads((out / "attnkit.json").read_text())
    assert manifest["eval"]["tasks"]["comparison"] == evaluation["tasks"]["comparison"]
    table = runner.invoke(
        app, ["retrofit", "softcap", str(src), str(tmp_path / "cap"), "--attn-cap", "20", "--eval-passkey", "300"]
    )
    assert table.exit_code == 0 and "pass key (repeat): accuracy" in table.stdout, table.output


def test_heal_reports_teacher_before_and_after(runner, tmp_path, tasks_dir):
    teacher = tiny_source(tmp_path, "llama")
    student = tmp_path / "student"
    assert runner.invoke(app, ["convert", "mqa", str(teacher), str(student)]).exit_code == 0
    data = tmp_path / "data.txt"
    data.write_text(PROSE * 60)
    report = _json(
        runner.invoke(
            app,
            [
                "heal",
                str(student),
                str(tmp_path / "healed"),
                "--teacher",
                str(teacher),
                "--data",
                str(data),
                "--tokens",
                "512",
                "--seq-len",
                "32",
                "--val-tokens",
                "64",
                "--eval-tasks",
                "tiny_cloze",
                "--eval-tasks-dir",
                str(tasks_dir),
                "--eval-passkey",
                "300",
                "--device",
                "cpu",
                "--format",
                "json",
            ],
        )
    )
    evaluation = report["eval"]
    tasks, change = evaluation["tasks"], evaluation["change"]["tasks"]
    # the shared block: the teacher is the source, the healed student the result; `before` is the same block
    assert tasks["source"]["rows"] and change["before"]["rows"] and tasks["result"]["rows"]
    assert evaluation["before"]["tasks"]["result"] == change["before"]
    assert evaluation["before"]["tasks"]["source"] == tasks["source"]  # against the same teacher scores
    assert {r["metric"] for r in change["comparison"]} == {r["metric"] for r in tasks["comparison"]}
    assert [r["length"] for r in evaluation["passkey"]["comparison"]] == [300]
    assert [r["length"] for r in evaluation["change"]["passkey"]["comparison"]] == [300]
    # the keys of the last release, kept for one more
    assert tasks["teacher"]["rows"] and tasks["before"]["rows"] and tasks["after"]["rows"]
    assert {r["metric"] for r in tasks["comparison"]} == {r["metric"] for r in tasks["against_teacher"]}
    assert (tasks["teacher"], tasks["before"], tasks["after"], tasks["against_teacher"]) == (
        tasks["source"],
        change["before"],
        tasks["result"],
        tasks["comparison"],
    )
