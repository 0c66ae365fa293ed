"""`convert mla` on SmolLM2-135M-Instruct at half the KV cache (short calibration and evaluation windows)."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnkit.commands.convert.mla import MLARequest, convert_mla
from attnkit.ops.mla import MLAOptions
from attnkit.realmodels import smollm2_folder
from attnkit.runtime.generate import cache_check
from attnkit.scoring.options import EvalOptions
from attnkit.scoring.selfcheck import CheckOptions

PROSE = Path(__file__).parent / "data" / "prose"


def _convert(out: Path, options: MLAOptions, sequential: bool = True) -> dict:
    req = MLARequest(
        model=str(smollm2_folder()),
        out=out,
        kv_budget=0.5,
        calib=[str(PROSE / "calib.txt")],
        calib_tokens=256,
        calib_seq_len=256,
        scoring=EvalOptions(files=(str(PROSE / "heldout.txt"),), tokens=256, seq_len=256),
        sequential=sequential,
        options=options,
        device="cpu",
        check=CheckOptions(enabled=False),
    )
    return convert_mla(req)


@pytest.mark.real_model
def test_smollm2_half_cache_loads_generates_and_beats_weight_only_svd(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

    calibrated = _convert(tmp_path / "whitened", MLAOptions())
    kv = calibrated["kv_bytes_per_token"]
    assert kv["elements_before"] == 384 and kv["elements_after"] == 192
    assert calibrated["eval"]["cache"]["values_per_token_layer"] == 192
    weight_only = MLAOptions(whiten=False, key_weight="uniform", value_weight="none", o_refit=0.0)
    plain = _convert(tmp_path / "plain", weight_only, sequential=False)  # no activations used
    ppl, plain_ppl = calibrated["eval"]["perplexity"], plain["eval"]["perplexity"]
    source_ppl = calibrated["eval"]["source_perplexity"]
    assert source_ppl < ppl < plain_ppl, (source_ppl, ppl, plain_ppl)
    assert calibrated["eval"]["kl_mean"] < plain["eval"]["kl_mean"]

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "whitened")
    assert type(model) is DeepseekV3ForCausalLM
    tok = AutoTokenizer.from_pretrained(tmp_path / "whitened")
    ids = tok("The river ran past the old mill and", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 8
    assert cache_check(model)["key_shape"][-1] == calibrated["kv_lora_rank"]


@pytest.mark.real_model
def test_the_docs_calibration_text_holds_prose_and_code_where_convert_mla_reads():
    """tests/data/mixed/calib.txt, the docs' `convert mla` calibration: its first 8,192 tokens (convert mla's
    default --calib-tokens, in 512-token windows) hold every code sample beside the prose, and what follows holds a
    4,096-token window for the self-check's held-out text."""
    from transformers import AutoTokenizer

    from attnkit.commands.rewrite import CALIB_SEQ_LEN, MLA_CALIB_TOKENS
    from attnkit.runtime.texts import make_windows, read_texts

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_folder()))
    path = str(Path(__file__).parent / "data" / "mixed" / "calib.txt")
    windows = make_windows(tokenizer, read_texts([path]), CALIB_SEQ_LEN, 1 << 20)
    assert windows.numel() >= MLA_CALIB_TOKENS + 4096
    calibrated = tokenizer.decode(windows[: MLA_CALIB_TOKENS // CALIB_SEQ_LEN].flatten())
    for sample in (
        "class Garden:",
        "def test_rota_starts_on_a_monday",
        "class Parser:",
        "function debounce(",
        "rsync -a",
        "#include <stdint.h>",
        "SELECT b.title, b.author, b.shelf",
    ):
        assert sample in calibrated, sample
