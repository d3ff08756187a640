"""`hpcrl dashboard DIR [DIR ...]`: a read-only web app over run directories on disk (docs/dashboard.md).

No second database: every page reads the files the roles write (metrics.jsonl, logs/, configs/,
rollouts/step_N/{train,eval}/) while they are being written, through small incremental indexes that
remember byte offsets. Nothing in hpcrl imports this package except the command line.

    serve.py      arguments, the bind rule (loopback, or a token), uvicorn
    app.py        the starlette app: pages, JSON routes, auth, read-only
    runs.py       the run directories given, and the one check that keeps every path inside them
    tail.py       append-only JSONL files read by byte offset (a torn last line is skipped)
    series.py     metrics.jsonl as columns; downsampling and smoothing on the server
    overview.py   each role's state, stalls, error causes, step and ETA
    logs.py       log records of a component, env logs merged, searched, paged by byte offset
    configs.py    each role's resolved config, and what differs between runs
    rollouts.py   the saved rollouts of a step, grouped by prompt, paged
    static/       HTML, CSS, JS; vendor/uplot (scripts/vendor_uplot.sh)
"""
