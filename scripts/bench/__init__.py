"""The benchmark behind scripts/benchmark.py (its docstring is the user's guide and --help).

    specs.py     command-line values, policy specs (cache/spec.py syntax), configurations, prompts
    measure.py   memory meter, one timed end-to-end run, warm-up, one request, timed loops
    roofline.py  read bandwidth and the bytes-per-step bound
    report.py    row writer (atomic JSON/CSV), ratios between rows, printed tables, plot
    runner.py    Bench: the state every mode shares, common row fields, failed rows
    modes.py     the Mode protocol and the registry of modes:
      grid.py       e2e (default) and --sweep-context
      attention.py  --op attention
      memory.py     --memory-limit
      soak.py       --soak N (long runs: RSS, tokens/s, NaN/inf per window)
    cli.py       flags, validation (exit 2), the run, Ctrl-C (exit 130), exit status

Imports go one way: cli -> modes -> (grid, attention, memory, soak) -> runner -> (report, roofline,
measure) -> specs -> cache/engine.  The package needs the repository root and scripts/ on sys.path
(scripts/benchmark.py puts them there).
"""
