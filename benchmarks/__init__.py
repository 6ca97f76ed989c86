"""Speed and memory benchmarks of `keras_accum.AccumModel` against alternatives.

Run from the repository root:

    python -m benchmarks.run            # full run, writes benchmarks/results.*
    python -m benchmarks.run --quick --out /tmp/bench   # a smoke run

`run` is the driver; it starts one fresh Python per workload (`timing`) and
per memory configuration (`memory`), then writes the report (`report`).
The models, data and implementations are defined in `workloads`.
"""
