"""The ``ctapipelining`` command: its help, its answers to user mistakes (one line, status 2),
the CPU-only subcommands, and the README's main command in a fresh process."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ctapipelining import cli, operands

FINAL = Path(__file__).parent.parent / "benchmarks/results/2026-11-30-h200x2-protocol/final"


def test_help_lists_every_subcommand_in_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert set(cli.COMMANDS) == {"demo", "bench", "trace", "sim", "plan"}
    for name, text in cli.COMMANDS.items():
        assert f"    {name} " in out and "\n" not in text
        assert " ".join(text.split()[:4]) in " ".join(out.split())  # the help, wrapped as argparse likes
    assert "``" not in out and "`" not in out.replace("'ctapipelining COMMAND --help'", "")


def _subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (sub,) = [a for a in ap._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


@pytest.mark.parametrize("name", sorted(cli.COMMANDS))
def test_every_option_has_help_and_shows_its_default(name):
    p = _subparsers(cli.parser())[name]
    text = "".join(p.format_help().split())  # argparse wraps lines, also at hyphens
    for action in p._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help, f"{name} {action.option_strings[0]} has no help"
        if action.default is not None and not action.required:
            assert "(default:" + "".join(str(action.default).split()) + ")" in text, (
                f"{name} {action.option_strings[0]}"
            )
    assert "(default:None)" not in text  # an option without a default shows none


@pytest.mark.parametrize(
    "argv,message",
    [
        (["plan", "--dims", "8192"], "argument --dims: needs at least two widths (K0,N0: one layer), got '8192'"),
        (["plan", "--m", "64", "--gpus", "2", "--dims", "64,x"], "argument --dims: expected comma-separated integers"),
        (["plan", "--m", "64", "--dims", "64,64"], "the following arguments are required: --gpus"),
        (["bench", "--plot-only", "missing.json"], "argument --plot-only: no such file: missing.json"),
        (["sim", "--results", "missing.json"], "argument --results: no such file or folder: missing.json"),
        (["sim", "--seq", "-5"], "argument --seq: must be >= 1, got -5"),
        (["sim", "--k", "many"], "argument --k: expected an integer, got 'many'"),
        (["trace", "--seq", "0"], "argument --seq: must be >= 1, got 0"),
        (["demo", "--m", "0"], "argument --m: must be >= 1, got 0"),
        (["plan", "--m", "64", "--dims", "64,64", "--gpus", "2", "--gated", "-1"], "stage numbers >= 0"),
        (["plan", "--m", "64", "--dims", "64,64", "--gpus", "2", "--gated", "1"], "has stages 0 to 0"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_user_mistakes_end_in_one_line_and_status_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("ctapipelining") and ": error: " in last and message in last


def test_files_of_the_wrong_kind_end_in_one_line_and_status_2(tmp_path, capsys):
    """Mistakes only the subcommand can see (the file exists but holds something else)."""
    trace = tmp_path / "timeline.json"
    trace.write_text(json.dumps({"T1_signal": {"median_us": 1.0}}))
    cases = [
        (["sim", "--results", str(trace)], f"ctapipelining sim: error: cannot calibrate on {trace}: KeyError"),
        (["plan", "--m", "64", "--dims", "64,64", "--gpus", "1", "--results", str(tmp_path)], "cannot calibrate on"),
        (["sim", "--validate", str(trace)], f"--validate {trace}: not a bench results file"),
        (["sim", "--validate-shared", str(trace)], f"--validate-shared {trace}: not a shared_gpu.py results file"),
        (["sim", "--trace", str(trace)], "--trace and --tune calibrate together with --results"),
    ]
    for argv, message in cases:
        with pytest.raises(SystemExit) as e:
            cli.main([*argv, "--out", str(tmp_path)] if argv[0] == "sim" else argv)
        assert e.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert message in last, last


def test_plan_names_the_machine_its_model_was_calibrated_on(capsys):
    assert cli.main(["plan", "--m", "16384", "--dims", "8192,8192,8192", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "model calibrated on 2x NVIDIA H200 (torch 2.11.0+cu130, Triton 3.6.0), runs in " in out
    lines = out.splitlines()[1:]
    assert lines[0].startswith(" ->") and "cta+tp" in lines[0]  # the best first
    ms = [float(line.removeprefix(" ->").split()[0]) for line in lines]
    assert len(ms) > 5 and ms == sorted(ms)  # then the others, fastest first


def test_plan_of_a_llama_block(capsys):
    """A gated gate/up stage: the block split over two GPUs is a layout, TP is not."""
    assert cli.main(["plan", "--m", "4096", "--dims", "8192,57344,8192", "--gated", "0", "--gpus", "2"]) == 0
    out = capsys.readouterr().out
    assert "one GEMM per GPU" in out and " tp " not in out


@pytest.mark.skipif(not FINAL.is_dir(), reason="benchmarks/results not here")
def test_plan_calibrated_on_a_results_folder(capsys):
    assert cli.main(["plan", "--m", "2048", "--dims", "8192,8192,8192", "--gpus", "2", "--results", str(FINAL)]) == 0
    assert "runs in benchmarks/results/2026-11-30-h200x2-protocol/final)" in capsys.readouterr().out


def test_sim_writes_its_report_and_figures(tmp_path, capsys):
    assert cli.main(["sim", "--seq", "1024", "--k", "1024", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("calibrated on 2x NVIDIA H200") and "Figure 4" in out and "Figure 7" in out
    report = json.loads((tmp_path / "sim.json").read_text())
    assert report["calibration"]["device"].startswith("2x NVIDIA H200") and report["validation"] == {}
    assert {p.name for p in tmp_path.glob("*.png")} == {"sim_fig4.png", "sim_fig7.png", "sim_timeline_static.png"}


SHARED = Path(__file__).parent.parent / "benchmarks/results/2026-12-01-h200x2-decision/depth/shared_gpu.json"


@pytest.mark.skipif(not SHARED.is_file(), reason="benchmarks/results not here")
def test_sim_compares_the_shared_gpu_model_with_a_recorded_run(tmp_path, capsys):
    argv = ["sim", "--validate-shared", str(SHARED), "--seq", "1024", "--k", "1024", "--out", str(tmp_path)]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "stages sharing one GPU, against" in out
    assert sum("chain/ours_seq" in line and "measured" in line for line in out.splitlines()) == 6
    assert len(json.loads((tmp_path / "sim.json").read_text())["validation"]) == 1


def test_python_m_ctapipelining_help():
    r = subprocess.run([sys.executable, "-m", "ctapipelining", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert all(name in r.stdout for name in cli.COMMANDS) and r.stdout.startswith("usage: ctapipelining")


def test_demo_command_in_a_fresh_process():
    """The README's main command as a newcomer runs it: a fresh process, TRITON_INTERPRET unset
    (the demo sets it itself before the kernels are first imported; an import of the kernels
    on the way there would leave Triton in GPU mode and break the interpreter part)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    r = subprocess.run(
        [sys.executable, "-m", "ctapipelining", "demo", "--epochs", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = r.stdout
    assert "No CUDA device found" in out
    if operands._NUMPY_REFUSED:  # (a machine without the dev extra's pin)
        assert r.returncode == 1 and "install 'numpy<2.4'" in r.stderr.splitlines()[-1], r.stderr[-3000:]
        assert out.count("OK") == 2  # the reference executor ran first
        return
    assert r.returncode == 0, r.stderr[-3000:]
    assert out.count("OK") == 2  # the reference executor, both policies
    assert out.count("lone consumer -> PipelineTimeout") == 2 and "ERROR" not in out
    assert "prefill 16 + drain 16 of 40 rows: bitwise equal to the sequential GEMMs cut the same way: True" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the example's GPU branch runs on the device (device_run.sh)")
def test_the_llama_block_example_runs_on_the_cpu(capsys):
    """``examples/llama_block.py`` at small sizes without a GPU (its ``main``, in this process,
    where the kernels run under the interpreter): the fused block within 2x of
    ``transformers``' error against float32, and a model calling it compiled with
    ``fullgraph=True``, equal to the eager call."""
    import importlib.util

    path = Path(__file__).parents[1] / "examples/llama_block.py"
    spec = importlib.util.spec_from_file_location("llama_block_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main("--hidden 64 --intermediate 96 --rows 40".split()) == 0
    out = capsys.readouterr().out
    assert "(within 2x)" in out and "traces through the block: equal to eager True" in out
