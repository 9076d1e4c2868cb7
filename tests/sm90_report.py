"""Everything the CPU tests compile for Hopper (sm_90), in one process so that Triton's cache
serves a kernel the checks share: prints one JSON object with the compile check's report of the
GEMM and chain variants (``kernels``), of the fused epilogues (``epilogues``), the norm pass's
registers and spills (``norms``), and the launcher
format check's lines (``launcher``: ``ok`` per variant, or the error). Run without
``TRITON_INTERPRET`` (``conftest.sm90``)."""

import contextlib
import io
import json
import traceback

import launcher_format

from ctapipelining.kernels.compile_check import compile_epilogues, compile_norms, report

out = {"kernels": report(), "epilogues": compile_epilogues(), "norms": compile_norms()}
lines = io.StringIO()
try:
    with contextlib.redirect_stdout(lines):
        launcher_format.main()
    out["launcher"] = {"lines": lines.getvalue().splitlines(), "error": None}
except Exception:
    out["launcher"] = {"lines": lines.getvalue().splitlines(), "error": traceback.format_exc()}
print(json.dumps(out))
