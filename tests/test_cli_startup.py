"""How the CLI starts: only the invoked command is registered, help pages show examples in plain notation,
and `python -m attnkit` works from a folder that holds a folder named attnkit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli import COMMANDS, app, build_app, invoked

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "args, expected",
    [
        (["kvmem", "llama-3.1-8b"], ["kvmem"]),
        (["convert", "mla", "--help"], ["convert"]),
        (["--version"], []),
        (["--help"], None),
        ([], None),
        (["kvmemm"], None),
        (["-x", "kvmem"], None),
    ],
)
def test_invoked_names_what_a_run_needs(args, expected):
    assert invoked(args) == expected


def _cli_modules(args: list[str]) -> set[str]:
    code = (
        "import sys\nfrom attnkit.cli import main\nsys.argv = ['attnkit', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('MODULES=' + ','.join(m for m in sys.modules if m.startswith('attnkit.cli.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    line = [l for l in out.stderr.splitlines() if l.startswith("MODULES=")][-1]
    return set(line[len("MODULES=") :].split(","))


def test_main_imports_only_the_invoked_commands_module():
    assert _cli_modules(["kvmem", "llama-3.1-8b", "--format", "json"]) == {
        "attnkit.cli.common",
        "attnkit.cli.options",
        "attnkit.cli.output",
        "attnkit.cli.kvmem_cmd",
    }
    assert {f"attnkit.cli.{m}" for m in COMMANDS.values()} <= _cli_modules(["--help"])


def _modules_beyond_typer(args: list[str]) -> set[str]:
    """The modules `attnkit ARGS` imports that `import typer` has not (a fresh interpreter, through main())."""
    code = (
        "import sys\nimport typer\nbase = set(sys.modules)\nfrom attnkit.cli import main\n"
        "sys.argv = ['attnkit', *sys.argv[1:]]\ntry:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.stderr.write('MODULES=' + ','.join(sorted(set(sys.modules) - base)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    line = [l for l in out.stderr.splitlines() if l.startswith("MODULES=")][-1]
    assert out.returncode == 0, out.stderr
    return set(line[len("MODULES=") :].split(","))


#: The attnkit modules a cold `attnkit kvmem PRESET --format json` imports (docs/benchmarks.md, cold start).
KVMEM_MODULES = {
    *("attnkit", "attnkit.api", "attnkit.errors", "attnkit.units", "attnkit.progress", "attnkit.kvcache"),
    *("attnkit.cli", "attnkit.cli.common", "attnkit.cli.options", "attnkit.cli.output", "attnkit.cli.kvmem_cmd"),
    *("attnkit.commands", "attnkit.commands.analyse", "attnkit.commands.analyse.kvmem"),
    "attnkit.commands.analyse.modelinfo",
    *("attnkit.archs", "attnkit.archs.schema", "attnkit.archs.spec", "attnkit.archs.validate", "attnkit.presets"),
}
#: `attnkit inspect config.json --format json`: inspect's modules instead of kvmem's, and the file readers.
INSPECT_MODULES = KVMEM_MODULES - {"attnkit.cli.kvmem_cmd", "attnkit.commands.analyse.kvmem"} | {
    *("attnkit.cli.inspect_cmd", "attnkit.commands.analyse.inspect", "attnkit.param_count"),
    *("attnkit.io", "attnkit.io.resolve", "attnkit.io.checkpoint", "attnkit.io.config", "attnkit.io.jsonsafe"),
    "attnkit.io.files",
}
#: All else either may import beyond typer: no rich (tables only), csv (--format csv only), importlib.resources,
#: numpy, torch, pandas, safetensors or the hub.
OTHER_IMPORTS = {
    "json",
    "json.decoder",
    "json.encoder",
    "json.scanner",
    "_json",
    "dataclasses",
    "typer._click.decorators",
}


@pytest.mark.parametrize("command", ["kvmem", "inspect"])
def test_kvmem_and_inspect_import_only_what_they_use(command, tmp_path):
    from attnkit.presets import find_preset

    config = tmp_path / "config.json"
    config.write_text(json.dumps(find_preset("llama-3.1-8b").config))
    args, expected = {
        "kvmem": (["kvmem", "llama-3.1-8b", "--format", "json"], KVMEM_MODULES),
        "inspect": (["inspect", str(config), "--format", "json"], INSPECT_MODULES),
    }[command]
    imported = _modules_beyond_typer(args)
    assert {m for m in imported if m.startswith("attnkit")} == expected
    assert {m for m in imported if not m.startswith("attnkit")} <= OTHER_IMPORTS


def test_every_command_is_registered_for_help_and_the_app():
    names = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert names == set(COMMANDS)
    assert {c.name for c in build_app(["presets"]).registered_commands} == {"presets"}


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["kvmem"],
        ["eval"],
        ["probe"],
        ["presets"],
        ["diff"],
        ["export"],
        ["convert", "gqa"],
        ["convert", "mqa"],
        ["convert", "mla"],
        ["retrofit", "softcap"],
        ["retrofit", "qknorm"],
        ["retrofit", "qkclip"],
        ["heal"],
        ["verify"],
    ],
)
def test_help_pages_show_examples_in_plain_notation(runner, command):
    result = runner.invoke(app, [*command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    assert "Examples:" in result.output and f"attnkit {' '.join(command)} " in result.output
    assert "<bool>" not in result.output and "<str>" not in result.output and "{" not in result.output


def test_python_dash_m_from_a_folder_holding_a_folder_named_attnkit(tmp_path):
    (tmp_path / "attnkit").mkdir()  # e.g. a clone's parent folder, or a data folder of that name
    out = subprocess.run(
        [sys.executable, "-m", "attnkit", "kvmem", "llama-3.1-8b", "--format", "json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert '"bytes_per_token": 131072' in out.stdout
