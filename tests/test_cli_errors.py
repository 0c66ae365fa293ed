"""Every error is attnkit's own: one line, exit 1 or 2, checked before the expensive part, and the handler
itself never fails (markup in messages, undecodable bytes)."""

from __future__ import annotations

import pytest

from attnkit.cli import app
from tests import hostile
from tests.helpers import PROSE, char_tokenizer, one_line_error


@pytest.fixture
def src(tiny):
    return char_tokenizer(tiny("llama_gqa"))


@pytest.fixture
def texts(tmp_path):
    """name -> path of a text input that is not text."""
    (tmp_path / "binary.txt").write_bytes(b"\x7fELF\0\0\0\x01" * 64)
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (tmp_path / "folder.txt").mkdir()
    return {name: str(tmp_path / name) for name in ("binary.txt", "latin1.txt", "latin1.jsonl", "folder.txt")}


WORDS = {
    "binary.txt": (1, "a binary file (it holds NUL bytes), not text"),
    "latin1.txt": (1, "not a UTF-8 text file (byte 3)"),
    "latin1.jsonl": (1, "not a UTF-8 text file (byte 13)"),
    "folder.txt": (1, "is a folder, not a text file"),
}


@pytest.mark.parametrize("name", sorted(WORDS))
@pytest.mark.parametrize("command", ["eval", "probe", "convert --calib"])
def test_text_inputs_that_are_not_text(runner, src, tmp_path, texts, command, name):
    code, words = WORDS[name]
    args = {
        "eval": ["eval", str(src), texts[name]],
        "probe": ["probe", str(src), texts[name]],
        "convert --calib": [
            "convert",
            "mqa",
            str(src),
            str(tmp_path / "out"),
            "--method",
            "merge",
            "--calib",
            texts[name],
        ],
    }[command]
    one_line_error(runner.invoke(app, args), code, f"{texts[name]}: {words}")


def test_markup_in_a_message_is_printed_as_is(runner, src):
    header = hostile.safetensors_header()
    header["a"]["dtype"] = "[/bold][red]"  # rich would read this as a closing tag and fail
    (src / "model.safetensors").write_bytes(hostile.safetensors_bytes(header))
    result = runner.invoke(app, ["inspect", str(src)])
    one_line_error(result, 1, "tensor 'a' has unknown dtype '[/bold][red]'")


def test_device_is_checked_before_any_model_is_loaded(runner, src, tmp_path):
    result = runner.invoke(
        app,
        [
            "convert",
            "mqa",
            str(src),
            str(tmp_path / "out"),
            "--method",
            "merge",
            "--calib",
            _text(tmp_path),
            "--device",
            "tpu9",
        ],
    )
    one_line_error(result, 2, "unknown --device 'tpu9'")


def _text(tmp_path, copies: int = 8) -> str:
    path = tmp_path / "calib.txt"
    path.write_text(PROSE * copies)
    return str(path)


def test_calibration_window_errors_name_the_calibration_options(runner, src, tmp_path):
    base = ["convert", "mqa", str(src), str(tmp_path / "out"), "--method", "merge", "--calib"]
    result = runner.invoke(app, [*base, _text(tmp_path), "--calib-tokens", "100", "--calib-seq-len", "512"])
    one_line_error(result, 2, "--calib-tokens 100 is shorter than one window (--calib-seq-len 512)")
    result = runner.invoke(app, [*base, _text(tmp_path, copies=1), "--calib-tokens", "512", "--calib-seq-len", "256"])
    one_line_error(result, 2, "give more text or a smaller --calib-seq-len")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, words",
    [
        (["--context", "99999999999999999999999k"], "is over the limit of 1,099,511,627,776"),
        (["--context", "9" * 5000], "is over the limit"),
        (["--batch", "9" * 5000], "is over the limit of 4,294,967,296"),
        (["--gpu-mem", "1e400GiB"], "not a memory size"),
    ],
)
def test_kvmem_bounds_its_numbers(runner, args, words):
    one_line_error(runner.invoke(app, ["kvmem", "llama-3.1-8b", *args]), 2, words)


def test_probe_output_names_are_checked_before_loading(runner, src, tmp_path):
    result = runner.invoke(app, ["probe", str(src), _text(tmp_path), "--out", str(tmp_path / "stats.txt")])
    one_line_error(result, 2, "use a .parquet or .csv file name")


def test_gguf_head_counts_through_inspect(runner, tmp_path):
    fields = [(k, t, 0 if k.endswith("head_count_kv") else v) for k, t, v in hostile.gguf_fields()]
    path = tmp_path / "model.gguf"
    path.write_bytes(hostile.gguf_bytes(fields, hostile.gguf_tensors()))
    one_line_error(runner.invoke(app, ["inspect", str(path)]), 1, "num_key_value_heads = 0 must be at least 1")


def test_hub_server_errors_are_not_called_unreachable(monkeypatch):
    import httpx2
    import huggingface_hub
    from huggingface_hub import errors

    from attnkit.errors import AttnkitError
    from attnkit.io.resolve import resolve

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    response = httpx2.Response(500, request=httpx2.Request("HEAD", "https://huggingface.co/acme/m"))

    def failing(*args, **kwargs):
        try:
            raise errors.HfHubHTTPError("500 Server Error", response=response)
        except errors.HfHubHTTPError as exc:  # how huggingface_hub reports it: wrapped, the status in __cause__
            raise errors.LocalEntryNotFoundError("An error happened while trying to locate the file") from exc

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", failing)
    with pytest.raises(AttnkitError, match="the hub answered HTTP 500 \\(a server error\\); try again later"):
        resolve("acme/m", need_weights=False)
