"""The ``disagg`` command line: one subcommand per process role or tool.

Subcommands import their implementation lazily so that ``disagg serve`` with
the synthetic engine, and the frontends it spawns, never import torch.
"""

from __future__ import annotations

import argparse
import os
import sys


def _make_tiny_model(args: argparse.Namespace) -> int:
    if args.arch == "deepseek_v4":
        from workers.engine.model.tiny_dsv4 import make_tiny_dsv4

        path = make_tiny_dsv4(args.dir, seed=args.seed)
        print(f"wrote a random-weight tiny DeepSeek-V4 model to {path}")
        return 0
    from workers.engine.model.tiny import make_tiny_model

    path = make_tiny_model(args.dir, size=args.size, seed=args.seed)
    print(f"wrote a random-weight {args.size} model to {path}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from disagg.generate import run_generate

    return run_generate(args)


def _serve(args: argparse.Namespace) -> int:
    from disagg.serve import run_serve

    return run_serve(args)


def _orchestrator(args: argparse.Namespace) -> int:
    from orchestrator.server import run_orchestrator

    return run_orchestrator(args)


def _render(args: argparse.Namespace) -> int:
    from disagg.slurm_deployment import run_render

    return run_render(args)


def _deployment(args: argparse.Namespace) -> int:
    from disagg.deployment import run_deployment_command

    return run_deployment_command(args)


def _live(args: argparse.Namespace) -> int:
    from disagg.live_commands import run_live_command

    return run_live_command(args)


def _bench(args: argparse.Namespace) -> int:
    from disagg.bench.cli import run_bench_command

    return run_bench_command(args)


def _simulate(args: argparse.Namespace) -> int:
    from disagg.sim.replay import run_simulate_command

    return run_simulate_command(args)


def version_line() -> str:
    """``disagg VERSION``, the version every server's ``/version`` reports, with the git commit of the
    checkout this code runs from when it is one (an installed wheel has none): the same figures as
    every process's ``disagg_build_info``."""
    from api.process_metrics import build_commit, build_version

    commit = build_commit()
    return f"disagg {build_version()}" + ("" if commit == "unknown" else f" (commit {commit})")


class _PrintVersion(argparse.Action):
    """``--version``: computed when asked for, so no other command pays for a ``git`` run."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version (and git commit) and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        print(version_line())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description="disagg: disaggregated prefill/decode LLM serving")
    parser.add_argument("--version", action=_PrintVersion)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    tiny = sub.add_parser("make-tiny-model", help="write a deterministic random-weight checkpoint")
    tiny.add_argument("dir", help="output directory (created)")
    tiny.add_argument("--size", choices=("test", "bench"), default="test", help="Llama dimensions")
    tiny.add_argument(
        "--arch",
        choices=("llama", "deepseek_v4"),
        default="llama",
        help="deepseek_v4: every layer kind of DeepSeek-V4 at tiny dimensions (needs the dev extra)",
    )
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_make_tiny_model)

    gen = sub.add_parser("generate", help="complete prompts with the engine in this process (a local demo)")
    from disagg.generate import add_generate_arguments

    add_generate_arguments(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="run one worker: a launcher, its engine and K HTTP frontends")
    from disagg.serve import add_serve_arguments

    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)

    orch = sub.add_parser("orchestrator", help="run the orchestrator (K_o processes on one port)")
    from orchestrator.server import add_orchestrator_arguments

    add_orchestrator_arguments(orch)
    orch.set_defaults(func=_orchestrator)

    from disagg.deployment import add_deployment_commands

    add_deployment_commands(sub, _deployment)
    from disagg.live_commands import add_live_commands

    add_live_commands(sub, _live)
    render = sub.add_parser("render", help="print the sbatch script of a deployment YAML (what `up --launcher "
                                           "slurm` submits)")
    from disagg.slurm_deployment import add_render_arguments

    add_render_arguments(render)
    render.set_defaults(func=_render)
    bench = sub.add_parser("bench", help="benchmark a server with agentic multi-turn sessions (JSON + plots); "
                                         "`bench compare A.json B.json`")
    from disagg.bench.cli import add_bench_arguments

    add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    simulate = sub.add_parser("simulate", help="replay a trace on a deployment YAML in simulated time (the real "
                                               "routers, KV index and block managers; no processes)")
    from disagg.sim.replay import add_simulate_arguments

    add_simulate_arguments(simulate)
    simulate.set_defaults(func=_simulate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:
        # The reader left (`disagg logs | head`): no traceback, and none at exit when Python flushes
        # stdout again (the documented recipe: point stdout at /dev/null).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a command killed by it


if __name__ == "__main__":
    raise SystemExit(main())
