import os
import subprocess
import sys

import pytest

from ctapipelining import cli


def test_demo_without_gpu_runs_the_protocol(capsys):
    assert cli.main(["demo", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "No GPU pair found" in out
    assert out.count("OK") == 2
    assert "lone consumer -> PipelineTimeout" in out and "ERROR" not in out
    assert "prefill 16 + drain 16 of 40 rows: bitwise equal to the sequential GEMMs cut the same way: True" in out


def test_demo_command_in_a_fresh_process():
    """The README's main command as a newcomer runs it: a fresh process, TRITON_INTERPRET unset
    (the demo sets it itself before the kernels are first imported; an import of the kernels
    on the way there would leave Triton in GPU mode and break the interpreter part)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run(
        [sys.executable, "-m", "ctapipelining.cli", "demo", "--epochs", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "No GPU pair found" in r.stdout
    assert r.stdout.count("lone consumer -> PipelineTimeout") == 2 and "ERROR" not in r.stdout


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--m", "0"])
    assert "--m must be >= 1" in capsys.readouterr().err
