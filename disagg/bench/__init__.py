"""``disagg bench``: an agentic-workload benchmark client for OpenAI-, Anthropic- and Responses-compatible servers.

One concept per module: ``lengths`` (length distributions), ``text`` (synthetic prompt text),
``workload`` (multi-turn sessions), ``api_clients`` (request bodies and stream parsers per API),
``sender`` (one streamed request, raw SSE), ``runner`` (arrival processes and the run loop),
``metrics`` (records and summaries), ``server_info`` (what the server says about itself),
``report`` (the results file), ``progress``, ``plots``, ``stats`` (confidence intervals),
``compare``, ``trace`` and ``trace_replay`` (a Mooncake-format trace replayed) and ``cli``.
Imports no torch, and neither matplotlib nor rich until it plots or shows progress, so a
benchmark script can use the library without the ``bench`` extra.
"""

from disagg.bench.metrics import RequestRecord, RunSummary, parse_slo
from disagg.bench.runner import BenchPlan, LevelResult, run_bench
from disagg.bench.workload import WorkloadConfig

__all__ = ["BenchPlan", "LevelResult", "RequestRecord", "RunSummary", "WorkloadConfig", "parse_slo", "run_bench"]
