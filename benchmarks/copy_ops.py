"""What the copy transport's stream operations cost, each sequence replayed from a CUDA graph.

usage: python3 benchmarks/copy_ops.py OUT_DIR [ROWS] [K]

Moves ROWS x K bf16 (default 16384 x 8192, the workload's intermediate) from cuda:0 to cuda:1
in pieces, on streams of cuda:1 (a pull, as the pipeline does), with every ready flag already
raised, so the times are the operations' own costs: the copies alone; with a flag wait before
each; with a flag write after each (the pipeline's sequence); with a 4-byte epoch copy instead
of the write; over 1, 2 or 4 streams; in pieces of 1 or 4 row-blocks of 128 rows. Prints ms
per sequence and us per piece; writes OUT_DIR/copy_ops.json.
"""

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ctapipelining import fabric
from ctapipelining.bench import environment

out_dir = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
ROWS = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
K = int(sys.argv[3]) if len(sys.argv) > 3 else 8192
out_dir.mkdir(parents=True, exist_ok=True)
fabric.enable_peer_access([0, 1])
src = torch.randn(ROWS, K, device="cuda:0").bfloat16()
dst = torch.empty(ROWS, K, dtype=torch.bfloat16, device="cuda:1")
ready = torch.ones(ROWS // 128, dtype=torch.int32, device="cuda:1")
landed = torch.zeros(ROWS // 128, dtype=torch.int32, device="cuda:1")
epoch = torch.ones(1, dtype=torch.int32, device="cuda:1")
streams = [torch.cuda.Stream("cuda:1") for _ in range(4)]


def sequence(rows_per_piece, nstreams, wait, flag):
    def run():
        main = torch.cuda.current_stream("cuda:1")
        for st in streams[:nstreams]:
            st.wait_stream(main)
        for i, r0 in enumerate(range(0, ROWS, rows_per_piece)):
            st = streams[i % nstreams]
            c = r0 // 128
            if wait:
                fabric.wait_flag(st, ready, c)
            fabric.copy_async(dst[r0 : r0 + rows_per_piece], src[r0 : r0 + rows_per_piece], st)
            if flag == "write":
                fabric.write_flag(st, landed, c, 1 << 30)
            elif flag == "memcpy":
                fabric.copy_async(landed[c : c + 1], epoch, st)
        for st in streams[:nstreams]:
            main.wait_stream(st)

    return run


VARIANTS = {
    "copy only, 128 rows": (128, 1, False, None),
    "wait+copy, 128 rows": (128, 1, True, None),
    "wait+copy+write, 128 rows": (128, 1, True, "write"),
    "wait+copy+memcpy4B, 128 rows": (128, 1, True, "memcpy"),
    "wait+copy+write, 128 rows, 2 streams": (128, 2, True, "write"),
    "wait+copy+write, 128 rows, 4 streams": (128, 4, True, "write"),
    "copy only, 512 rows": (512, 1, False, None),
    "wait+copy+write, 512 rows": (512, 1, True, "write"),
    "wait+copy+write, 512 rows, 2 streams": (512, 2, True, "write"),
    "copy only, whole matrix": (ROWS, 1, False, None),
}
rows = []
with torch.cuda.device(1):
    for name, (rpp, ns, wait, flag) in VARIANTS.items():
        fn = sequence(rpp, ns, wait, flag)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(1)
        eager_ms = (time.perf_counter() - t0) * 1e3
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        ms = []
        for i in range(25):
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            g.replay()
            torch.cuda.synchronize(1)
            if i >= 5:
                ms.append((time.perf_counter() - t0) * 1e3)
        assert torch.equal(dst, src.to("cuda:1"))
        pieces = ROWS // rpp
        med = statistics.median(ms)
        gbs = ROWS * K * 2 / med / 1e6
        rows.append(
            dict(name=name, pieces=pieces, streams=ns, median_ms=round(med, 4), min_ms=round(min(ms), 4),
                 max_ms=round(max(ms), 4), us_per_piece=round(med * 1e3 / pieces, 2), GBps=round(gbs, 1),
                 eager_first_call_ms=round(eager_ms, 3))
        )  # fmt: skip
        print(
            f"{name:42s} {med:7.3f} ms [{min(ms):.3f}-{max(ms):.3f}]  {med * 1e3 / pieces:6.2f} us/piece "
            f"{gbs:6.1f} GB/s  (eager first call {eager_ms:.2f} ms)",
            flush=True,
        )
(out_dir / "copy_ops.json").write_text(json.dumps(dict(environment=environment(), ROWS=ROWS, K=K, rows=rows), indent=1))
