"""Run vllm_worker.py in the interpreter that has vLLM and read its result (not named vllm.py: the worker's
folder is on its sys.path, where such a module would shadow vLLM)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from attnkit.errors import AttnkitError

WORKER = Path(__file__).resolve().parent / "vllm_worker.py"


def run_vllm_worker(python: str, request: dict, workdir: Path, timeout: float) -> dict:
    """The worker's result for `request` (see vllm_worker.py); its output goes to workdir/vllm.log."""
    (workdir / "vllm-request.json").write_text(json.dumps(request))
    log = workdir / "vllm.log"
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(
                [python, str(WORKER), str(workdir / "vllm-request.json"), str(workdir / "vllm-result.json")],
                stdout=fh,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                cwd=workdir,
            )
        except subprocess.TimeoutExpired:
            raise AttnkitError(f"vLLM did not finish in {timeout:.0f}s") from None
    if proc.returncode != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        errors = [line for line in lines if re.search(r"\w*(Error|Exception)\b", line)] or lines
        raise AttnkitError(f"vLLM failed (exit {proc.returncode}): {errors[-1].strip()[:400] if errors else ''}")
    return json.loads((workdir / "vllm-result.json").read_text())
