"""The accelerator script a lent GPU runs first: bounded as its header says, and a clean refusal here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "accelerator_check.sh"


def test_every_step_runs_under_a_timeout_and_together_they_fit_eight_minutes():
    text = SCRIPT.read_text()
    defaults = dict(re.findall(r'^(\w+_TIMEOUT)="\$\{\w+:-(\d+)\}"', text, flags=re.MULTILINE))
    used = re.findall(r'^\s*(?:\S+=\S+ )?run_step \S+ "\$(\w+_TIMEOUT)"', text, flags=re.MULTILINE)
    steps = re.findall(r"^echo \"accelerator_check: \[(\d)/(\d)\]", text, flags=re.MULTILINE)
    assert len(used) == len(steps) == int(steps[0][1]) and sorted(used) == sorted(defaults)
    assert sum(int(v) for v in defaults.values()) <= 8 * 60, defaults


def test_without_cuda_it_runs_nothing_and_says_so_in_one_line(tmp_path):
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])  # `python`: this one
    env = {"OUT": str(tmp_path), "PATH": path, "HOME": os.environ.get("HOME", str(tmp_path))}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "no CUDA device" in done.stdout + done.stderr
    assert not list(tmp_path.iterdir())
