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


@pytest.fixture
def fused_blocks(monkeypatch):
    """Every MLP block runs its fused kernels at every row count (no ``unfused_rows``), unless a
    test sets the rows it runs unfused (the block tests' files use it for all their tests)."""
    from ctapipelining.nn import GPTMLP, LlamaMLP

    for cls in (LlamaMLP, GPTMLP):
        monkeypatch.setattr(cls, "unfused_rows", ())


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
    """Triton's interpreter repeats three lookups hundreds of thousands of times in a kernel
    test, about a third of its time; here each is done once, with the same effect (Triton 3.6 only:
    another version keeps its own interpreter):

    * at every device function call it finds the language modules among the function's globals,
      then lists each module's builtins (``inspect.getmembers``) and wraps those not wrapped yet.
      Here each function's language modules are found again only when its module gains names,
      each module's builtins are listed once, and a module whose first builtin is wrapped already
      is left alone: the interpreter wraps a module's builtins in one pass, so the first wrapped
      means all are (``reduce`` and ``associative_scan`` apart, which every pass sets again); in a
      device function called from a kernel, whose launch wrapped them, that is every time;
    * at every operation it builds its table from Triton's dtypes to NumPy's again
      (``_get_np_dtype``); here the table is built once.
    """
    import inspect
    from types import SimpleNamespace

    import numpy as np
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    if not triton.__version__.startswith("3.6."):
        return
    original = interpreter._patch_builtin
    pkgs = (tl, tl.core, tl.tensor, tl.math, tl.core.tensor_descriptor_base)
    names = {id(p): [n for n, m in inspect.getmembers(p) if tl.core.is_builtin(m)] for p in pkgs}

    def patch_builtin(pkg, builder, scope):
        listed = names.get(id(pkg))
        if listed is None:
            return original(pkg, builder, scope)
        if not tl.core.is_builtin(getattr(pkg, listed[0])):
            return  # patched already, as every name is patched at once (a device function called in a kernel)
        for name in listed:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    uint64 = np.dtype(np.uint64)
    table = {t: interpreter._get_np_dtype(t) for t in (
        tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16, tl.int32, tl.uint32,
        tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15,
    )}  # fmt: skip

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return uint64
        return table[tt_dtype]

    patch_lang, modules_of = interpreter._patch_lang, {}

    def patch_lang_from_cached_globals(fn):
        # the language modules among fn's globals, the only ones patch_lang reads, found again when
        # names are added to them (the interpreter adds its own to a device function's module)
        size, found = modules_of.get(fn, (None, None))
        if size != len(fn.__globals__):
            langs = {n: v for n, v in fn.__globals__.items() if inspect.ismodule(v) and v in (tl, tl.core)}
            size, found = len(fn.__globals__), SimpleNamespace(__globals__=langs)
            modules_of[fn] = size, found
        return patch_lang(found)

    interpreter._patch_builtin = patch_builtin
    interpreter._patch_lang = patch_lang_from_cached_globals
    interpreter._get_np_dtype = get_np_dtype


if INTERPRET:
    _faster_interpreter()
