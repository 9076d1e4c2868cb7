import pytest

from ctapipelining import cli


def test_demo_without_gpu_runs_the_protocol(capsys):
    assert cli.main(["demo", "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "No GPU pair found" in out
    assert out.count("OK") == 2
    assert "lone consumer -> PipelineTimeout" in out and "ERROR" not in out


def test_demo_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--m", "0"])
    assert "--m must be >= 1" in capsys.readouterr().err
