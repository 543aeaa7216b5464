"""The benchmark scripts' shared preamble (benchmarks/common.sh): usage, OUT_DIR, and the missing-text exit."""

import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parent.parent / "benchmarks").glob("run_*.sh"))


def _run(script, *args, env=None):
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_prints_the_usage(script):
    r = _run(script, "-h")
    assert r.returncode == 0 and r.stdout.startswith(f"usage: {script.name} [OUT_DIR] [FLAG...]"), r.stderr


@pytest.mark.parametrize("name,var", [("run_recall.sh", "HAYSTACK"), ("run_niah.sh", "HAYSTACK"),
                                      ("run_learned.sh", "TEXT")])
def test_a_missing_text_is_one_line_and_exit_2(name, var, tmp_path):
    out = tmp_path / "out"
    r = _run(Path(SCRIPTS[0]).parent / name, str(out), env={var: str(tmp_path / "none.txt")})
    assert r.returncode == 2 and r.stderr.strip() == f"error: no text at {tmp_path / 'none.txt'} (apt install " \
                                                      f"jargon-text, or set {var})", r.stderr
    assert out.is_dir()  # OUT_DIR, the first argument, is made before anything runs
