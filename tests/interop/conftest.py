"""The real-vLLM interop suite needs vLLM's own virtual environment (``.venv-vllm``, built by
``make interop-venv``) and the tiny model (``make interop-model``); ``make interop`` builds
both first. The engine tools are ``tools.interop``.

Without the venv (plain ``pytest``, or ``make test`` on a machine that never ran
``make interop``) the real-engine tests skip and say how to build it; under ``make interop``
(``NARWHAL_INTEROP_REQUIRED=1``) a missing venv or model fails instead, so that target cannot
pass by skipping.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from narwhal.testing.procfs import available_memory_bytes
from tools.interop import vllm_engines

TOOLS = Path(__file__).resolve().parents[2] / "tools" / "interop"

REQUIRED = os.environ.get("NARWHAL_INTEROP_REQUIRED") == "1"
# Two engines hold about 3 GB each; leave room for the router and the test.
MIN_AVAILABLE_BYTES = 7 * 2**30


def _missing(why: str) -> None:
    if REQUIRED:
        pytest.fail(why, pytrace=False)
    pytest.skip(why)


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    python = vllm_engines.default_vllm_python()
    stamp = python.parent.parent / ".narwhal-vllm-installed"
    if not python.exists() or not stamp.exists():
        _missing(f"the vLLM virtual environment is not built ({stamp} missing): run `make interop`")
    available = available_memory_bytes()
    if available is not None and available < MIN_AVAILABLE_BYTES:
        _missing(
            f"two vLLM engines need about 7 GiB of free memory; {available / 2**30:.1f} GiB "
            "available"
        )
    return python


@pytest.fixture(scope="session")
def tiny_model(vllm_python: Path) -> Path:
    model = vllm_engines.default_model_dir()
    if not (model / "narwhal-tiny.json").exists():
        done = subprocess.run(
            [str(vllm_python), str(TOOLS / "make_tiny_model.py"), str(model)],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        if done.returncode != 0:
            pytest.fail(
                f"building the tiny model failed ({done.returncode}):\n{done.stderr[-3000:]}",
                pytrace=False,
            )
    return model
