"""Markers: ``gpu`` needs one CUDA GPU, ``gpu2`` two with peer access; both skip cleanly
without them. Without any GPU the Triton kernels run under the interpreter, so the
interpreter must be switched on before anything imports them. The processes the tests start
(torchrun, ``python -m ctapipelining``) import this checkout, as the tests do, not whichever
copy of the package is installed: the checkout's root leads their ``PYTHONPATH``."""

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:  # this process imports the checkout too (pytest's entry point puts tests/ there)
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])

NGPU = torch.cuda.device_count() if torch.cuda.is_available() else 0
if NGPU == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    """Under pytest-xdist's ``-n`` (the README's test command), tests marked ``xdist_group``
    run on one worker, one after another: the sm_90 compile tests share Triton's cache there
    instead of compiling the same kernels on both workers at once."""
    if getattr(config.option, "dist", "no") == "load":  # the controller: group-aware scheduling
        config.option.dist = "loadgroup"
    if hasattr(config, "workerinput"):  # a worker: name each test's group in its node id, as loadgroup does
        config.option.loadgroup = True


@pytest.fixture(scope="session")
def sm90():
    """``sm90_report.py``'s JSON: the kernels compiled for sm_90 on the CPU, in one process
    (once per test run: the tests that use it share an ``xdist_group``, so one worker)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    here = Path(__file__).parent
    env["PYTHONPATH"] = os.pathsep.join([str(here), str(here.parent), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, str(here / "sm90_report.py")], env=env, capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu2" in item.keywords and NGPU < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2 GPUs, found {NGPU}"))
        elif "gpu" in item.keywords and NGPU < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        elif "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(pytest.mark.skip(reason="runs only under TRITON_INTERPRET=1 (the GPU tests cover the GPU)"))


def _faster_interpreter() -> None:
    """Triton's interpreter looks up the language modules' builtins (``inspect.getmembers``)
    again at every device function call, a quarter of a kernel test's time; the builtins do not
    change, so their names are listed once here and each call patches the same ones as before
    (those not patched already)."""
    import inspect

    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith("3.6."):  # (Triton 3.6's interpreter: another keeps its own)
        return
    original = interpreter._patch_builtin
    pkgs = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    names = {id(p): [n for n, m in inspect.getmembers(p) if tl.core.is_builtin(m)] for p in pkgs}

    def patch_builtin(pkg, builder, scope):
        if id(pkg) not in names:
            return original(pkg, builder, scope)
        for name in names[id(pkg)]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


if INTERPRET:
    _faster_interpreter()
