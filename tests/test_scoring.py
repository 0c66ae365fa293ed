"""attnkit.scoring: one request field per scoring option (EvalOptions, embedded by every writing command's
request), the comparison's block and its one scoring of the source, and heal's report built from two blocks."""

from __future__ import annotations

import dataclasses

import pytest

from attnkit.commands.heal.request import HealRequest
from attnkit.commands.rewrite import RewriteRequest
from attnkit.scoring import comparison as comparison_module
from attnkit.scoring.capability import CapabilitySpec
from attnkit.scoring.comparison import EVAL_KEYS, Comparison
from attnkit.scoring.options import EvalOptions
from attnkit.scoring.passkey import PasskeySpec
from tests.helpers import PROSE, char_tokenizer

#: What EvalOptions holds, which no request may declare again.
SCORING_FIELDS = (
    "eval",
    "eval_tokens",
    "eval_seq_len",
    "eval_long_seq_len",
    "sample_prompts",
    "sample_tokens",
    "capability",
)


@pytest.mark.parametrize("request_class", [RewriteRequest, HealRequest])
def test_every_scoring_option_is_one_field_of_eval_options(request_class):
    fields = {f.name: f for f in dataclasses.fields(request_class)}
    assert not set(SCORING_FIELDS) & set(fields)
    assert fields["scoring"].type in (EvalOptions, "EvalOptions")
    assert {f.name for f in dataclasses.fields(EvalOptions)} == {
        "files",
        "tokens",
        "seq_len",
        "sample_prompts",
        "sample_tokens",
        "long_seq_len",
        "capability",
    }


def test_the_cli_builds_one_eval_options_from_the_scoring_groups():
    from attnkit.cli.options import eval_options

    shared = {
        "eval_files": ["a.txt"],
        "eval_tokens": 1024,
        "eval_seq_len": 256,
        "eval_long_seq_len": 2048,
        "sample_prompts": ["Once"],
        "eval_tasks": None,
        "eval_tasks_dir": None,
        "eval_limit": None,
        "eval_passkey": "1k",
    }
    opts = eval_options(shared)
    assert opts == EvalOptions(
        files=("a.txt",),
        tokens=1024,
        seq_len=256,
        long_seq_len=2048,
        sample_prompts=("Once",),
        capability=CapabilitySpec(passkey=PasskeySpec((1024,))),
    )
    assert eval_options({**shared, "sample_prompts": []}).sample_prompts == EvalOptions().sample_prompts
    assert not EvalOptions() and EvalOptions(files=("a.txt",)) and EvalOptions(capability=opts.capability)


def _fake_passkey(accuracy: float) -> dict:
    return {"variant": "repeat", "by_length": [{"length": 1024, "prompt_tokens": 1000, "accuracy": accuracy}]}


def test_a_comparison_scores_its_source_once_and_keeps_each_results_scores(monkeypatch):
    """heal compares two results (before and after training) against one teacher: the teacher's pass keys are
    run once, and both results' raw scores are kept in order."""
    runs = []

    def run_capability(loaded, spec, manager, name="model"):
        runs.append(loaded)
        return {"tasks": None, "passkey": _fake_passkey({"teacher": 1.0, "before": 0.25, "after": 0.75}[loaded])}

    monkeypatch.setattr(comparison_module, "run_capability", run_capability)
    monkeypatch.setattr(comparison_module, "check_capability", lambda spec, refs: None)
    comparison = Comparison(EvalOptions(capability=CapabilitySpec(passkey=PasskeySpec((1024,)))))
    first, second = comparison("teacher", "before"), comparison("teacher", "after")
    assert runs == ["teacher", "before", "after"]
    assert list(first) == list(second) == list(EVAL_KEYS) and first["perplexity"] is None
    assert [r["difference"] for r in second["passkey"]["comparison"]] == [-0.25]
    assert [c["passkey"]["by_length"][0]["accuracy"] for c in comparison.result_capability] == [0.25, 0.75]


def test_the_comparison_block_of_two_loaded_models(tiny):
    """On --eval windows: both perplexities, KL and top-1 agreement; a model against itself has KL 0 and
    agrees everywhere; the greedy samples are the same text."""
    from attnkit.runtime import load_model, make_windows

    folder = char_tokenizer(tiny("llama_gqa"))
    model = load_model(str(folder), device="cpu", dtype="float32")
    opts = EvalOptions(seq_len=32, tokens=64, sample_prompts=("The harbour",), sample_tokens=4)
    windows = make_windows(model.tokenizer, [PROSE], 32, 64)
    block = Comparison(opts, windows)(model, model)
    assert list(block) == list(EVAL_KEYS)
    assert block["tokens"] == 64 and block["predicted"] == 62 and block["seq_len"] == 32
    assert block["perplexity"] == pytest.approx(block["source_perplexity"])
    assert block["kl_mean"] == pytest.approx(0.0, abs=1e-6) and block["top1_agreement"] == 1.0
    (sample,) = block["samples"]
    assert sample["prompt"] == "The harbour" and sample["source"] == sample["result"]
    assert block["tasks"] is None and block["passkey"] is None


def test_heal_eval_report_is_the_after_block_with_before_change_and_the_old_keys():
    from attnkit.commands.heal.scores import eval_report

    def block(perplexity: float, accuracy: float) -> dict:
        out = dict.fromkeys(EVAL_KEYS)
        out.update(source_perplexity=10.0, perplexity=perplexity, kl_mean=perplexity / 100, kl_max=1.0)
        out["top1_agreement"] = 0.5
        out["passkey"] = {"source": _fake_passkey(1.0), "result": _fake_passkey(accuracy), "comparison": []}
        return out

    comparison = Comparison(EvalOptions(capability=CapabilitySpec(passkey=PasskeySpec((1024,)))))
    comparison.result_capability = [{"tasks": None, "passkey": _fake_passkey(a)} for a in (0.25, 0.75)]
    before, after = block(30.0, 0.25), block(20.0, 0.75)
    report = eval_report(comparison, before, after)
    assert report["perplexity"] == 20.0 and report["before"] is before
    assert report["change"]["tasks"] is None
    assert [r["difference"] for r in report["change"]["passkey"]["comparison"]] == [0.5]
    assert report["teacher_perplexity"] == 10.0
    assert report["after"] == {"perplexity": 20.0, "kl_mean": 0.2, "kl_max": 1.0, "top1_agreement": 0.5}
    passkey = report["passkey"]
    assert passkey["teacher"] == passkey["source"] and passkey["after"] == passkey["result"]
    assert passkey["before"] == report["change"]["passkey"]["before"]
    assert passkey["against_teacher"] == passkey["comparison"]


def test_the_comparison_scores_long_windows_by_distance(tiny, tmp_path):
    """--eval text also in long windows (capped at the model's 512 positions), scored by distance; a text shorter
    than one long window says so in the block instead of failing the run."""
    from attnkit.runtime import load_model

    model = load_model(str(char_tokenizer(tiny("llama_gqa"))), device="cpu", dtype="float32")
    other = load_model(str(char_tokenizer(tiny("llama_gqa", seed=1))), device="cpu", dtype="float32")
    (tmp_path / "long.txt").write_text(PROSE * 8)
    opts = EvalOptions(files=(str(tmp_path / "long.txt"),), seq_len=64, tokens=128, sample_tokens=2)
    block = Comparison(opts, opts.windows(model.tokenizer))(model, other)
    long = block["long_context"]
    assert long["seq_len"] == 512 and long["windows"] == 1 and long["tokens"] == 512 and long["skipped"] is None
    assert [(r["start"], r["end"]) for r in long["by_distance"]] == [(0, 128), (128, 256), (256, 512)]
    assert long["longest"] == long["by_distance"][-1] and long["longest"]["ratio"] > 0
    assert long["longest"]["predicted"] == 256

    (tmp_path / "short.txt").write_text(PROSE)
    opts = dataclasses.replace(opts, files=(str(tmp_path / "short.txt"),), tokens=64)
    long = Comparison(opts, opts.windows(model.tokenizer))(model, other)["long_context"]
    assert long["windows"] == 0 and long["by_distance"] is None and "less than one window of 512" in long["skipped"]
    off = dataclasses.replace(opts, long_seq_len=0)
    assert Comparison(off, off.windows(model.tokenizer))(model, other)["long_context"] is None
