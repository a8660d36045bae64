"""After only the README's first command (``pip install torch==2.13.0 && pip install -e .``), in
a virtual environment of its own, the demo saves and resumes a checkpoint: what its features
need (NumPy for torch.distributed.checkpoint's writer) is declared, not brought in by extras.
What does need an extra (the README's table) says which, in one line, exit status 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICK = ["--quiet", "--layers", "2", "--width", "32", "--batch-size", "4"]


def _run(*argv: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, check=False, cwd=cwd)


def test_demo_saves_and_resumes_after_a_bare_install(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    made = _run(sys.executable, "-m", "venv", venv)
    assert made.returncode == 0, made.stderr[-2000:]
    pip, bin_dir = venv / "bin" / "pip", venv / "bin"
    for args in (["torch==2.13.0"], ["-e", str(ROOT)]):
        done = _run(pip, "install", "-q", "--disable-pip-version-check", *args)
        assert done.returncode == 0, done.stderr[-3000:]
    assert _run(bin_dir / "python", "-c", "import matplotlib").returncode != 0  # no extras came along
    checkpoint = tmp_path / "ckpt"
    saved = _run(bin_dir / "fsdp-demo", "--steps", "2", "--save", checkpoint, *QUICK, cwd=tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    resumed = _run(bin_dir / "fsdp-demo", "--steps", "4", "--resume", checkpoint, *QUICK, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "3..4" in resumed.stdout, resumed.stdout
    for command, extra in (
        (["fsdp-demo", "--plot", "loss.png"], "--plot: needs matplotlib; install it with pip install -e '.[plot]'"),
        (["fsdp-demo", "--model", "gpt2"], "--model gpt2: needs transformers; install it with pip install -e '.[hf]'"),
        (["fsdp-plan", "--model", "llama-7b"], "Hugging Face models need transformers (pip install -e '.[hf]')"),
    ):
        refused = _run(bin_dir / command[0], *command[1:], cwd=tmp_path)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-2000:]
        assert extra in refused.stderr, refused.stderr
