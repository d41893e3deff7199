"""A plain install works: a fresh venv (no system site-packages), the CPU torch wheel, then
``pip install .`` (no extras) from a copy of the repository, and the README's main command
prints text.  This is what catches a runtime dependency missing from ``dependencies``.

Costs about 35 s here (torch ~20 s, ``pip install .`` ~8 s, the command ~5 s).  pip resolves
torch first on its own (``torch==2.13.0``; pip's configuration on this machine points at a
local CPU wheel); the test refuses to go on if that resolution is not a CPU build, so it
never pulls a CUDA torch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"


def _run(cmd, cwd, env, timeout=600):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


def _copy_repo(dst: Path) -> None:
    """The files git tracks or would track (no build outputs, caches or .git)."""
    try:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                               text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout to copy the repository")
    for f in files:
        src = REPO / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            (dst / f).write_bytes(src.read_bytes())


@pytest.mark.slow
def test_fresh_venv_pip_install_runs_the_readme_command(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    # which torch would pip take?  Only a CPU build may be installed
    report = tmp_path / "torch.json"
    _run(pip + ["install", "--dry-run", "--no-deps", "--only-binary=:all:", "--report", str(report), TORCH],
         tmp_path, env)
    chosen = [i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
              if i["metadata"]["name"] == "torch"]
    if not chosen or "+cpu" not in chosen[0]:
        pytest.skip(f"{TORCH} resolves to {chosen or 'nothing'} here, not a CPU wheel: not installing it")
    _run(pip + ["install", "-q", "--only-binary=:all:", TORCH], tmp_path, env)
    repo = tmp_path / "repo"
    _copy_repo(repo)
    _run(pip + ["install", "-q", str(repo)], tmp_path, env)   # no extras
    run_dir = tmp_path / "elsewhere"                        # not the source tree
    run_dir.mkdir()
    where = _run([py, "-c", "import replayssm, torch; print(replayssm.__file__); print(torch.version.cuda)"],
                 run_dir, env).stdout.split()
    assert str(venv) in where[0] and where[1] == "None"
    out = _run([py, "-m", "replayssm", "generate", "def fibonacci(n):", "--speculative", "draft",
                "--max-tokens", "12"], run_dir, env, timeout=300)
    assert out.stdout.startswith("def fibonacci(n):") and len(out.stdout.strip()) > len("def fibonacci(n):")
    assert "tokens/s" in out.stderr and "Traceback" not in out.stderr
