"""Run Python in a fresh process without TRITON_INTERPRET (compiled kernels: GPU, TensorRT, AOT PTX)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def run_clean(code: str, timeout: float = 600) -> str:
    """Run `code` with the repo importable and the interpreter off; fail the test with its output if it fails."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"subprocess failed (rc {done.returncode}):\n{output[-6000:]}"
    return output
