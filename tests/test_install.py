"""A plain `pip install .` (no extras) runs the command line and the README's main job, `shoal demo`.

The test extras are installed wherever the other tests run, so a runtime import that only they provide
(an HTTP client, say) passes every other test and breaks every user's `shoal` command. This test installs
the project as a user would, into a venv of its own, and runs it there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
INSTALL_TIMEOUT_S = 1200  # pip's cache makes it a minute or two; a cold cache downloads faiss, pyarrow, ...
DEMO_TIMEOUT_S = 600


def _user_env(data_dir: Path) -> dict[str, str]:
    """The environment of a user who configured nothing but the data directory (none of the session's
    SHOAL_* variables leak in, so the demo starts its own embedded servers under `data_dir`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "PYTHON", "VIRTUAL_ENV"))}
    return env | {"SHOAL_DATA_DIR": str(data_dir), "PIP_NO_INPUT": "1"}


def _run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(INSTALL_TIMEOUT_S + 2 * DEMO_TIMEOUT_S)
def test_plain_install_runs_the_cli_and_the_demo(tmp_path: Path) -> None:
    venv, data_dir, work = tmp_path / "venv", tmp_path / "data", tmp_path / "work"
    work.mkdir()  # run from an empty directory: no ./shoal.toml of the repository is read
    env = _user_env(data_dir)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    installed = _run([str(venv / "bin" / "pip"), "install", "--no-input", "-q", str(REPO)], env, work,
                     INSTALL_TIMEOUT_S)
    assert installed.returncode == 0, installed.stderr[-4000:]
    shoal = str(venv / "bin" / "shoal")

    # No test extra came with it: the checks below run without them.
    probe = _run([str(venv / "bin" / "python"), "-c", "import httpx"], env, work, 60)
    assert probe.returncode != 0 and "ModuleNotFoundError" in probe.stderr

    try:
        helped = _run([shoal, "--help"], env, work, 120)
        assert helped.returncode == 0, helped.stderr[-4000:]
        assert "demo" in helped.stdout

        demo = _run([shoal, "demo"], env, work, DEMO_TIMEOUT_S)
        assert demo.returncode == 0, (demo.stdout[-4000:], demo.stderr[-4000:])
        # What a user reads: the held-out searches with their nearest packages, read-your-writes, the
        # Vektonn search over HTTP (served by the plain install's API) and the end.
        assert "search: the 5 nearest to the embedding of" in demo.stdout
        assert "read-your-writes: uploaded shoal-demo-point" in demo.stdout
        assert "POST /api/v1/search/debian.packages.hnsw/1.0 -> " in demo.stdout
        assert "HTTP API: did not start" not in demo.stdout
        assert "demo finished in" in demo.stdout
    finally:
        stopped = _run([shoal, "server", "stop"], env, work, 120)
    assert stopped.returncode == 0, stopped.stderr[-4000:]
