"""The benchmarks behind `python -m cosyvoice_opt bench` (cli.py): three of them over shared parts.

- closed_loop.py: the sweep, closed rounds of equal requests per precision x concurrency x streaming;
- soak.py: N clients loop over the HTTP API for a bounded time; memory over time, failures;
- serving.py: traffic as users send it, in-process or over HTTP; per-load latency, underruns, throughput, capacity.

They share workload.py (voices, texts, request specs, arrivals), load.py (open- and closed-loop drivers),
transport.py (in-process or HTTP requests), report.py (percentiles, underruns, the table), capacity.py (the rate
search) and loopback.py (the API served on loopback, the clients in a child process). The three never import each
other; only cli.py imports them all (the import-linter contract in pyproject.toml).
"""
