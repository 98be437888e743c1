"""How many times a disaggregated request does each step, per process: body parses, chat template
renders, tokenizations, validations, sampling-parameter builds, detokenizations, Python calls.

Starts a ctx and a gen synthetic worker (one frontend each, a cluster key) and an orchestrator
(one process, conditional disaggregation off: every request takes both legs), each with
``benchmarks/step_count_hook.py`` as its ``sitecustomize``, sends ``--warmup`` requests, reads the
counts, sends ``--requests`` more (one at a time), reads them again: the difference over
``--requests`` is one request's count. A body parse is a JSON decode of a body holding the
request's marker text (the client's body, a leg's body, a leg's answer). Run it with
PYTHONPATH on each tree to compare commits::

    PYTHONPATH=<tree> python benchmarks/disagg_steps.py [--api chat,messages,completions] [--stream]
        [--requests 20] [--warmup 3] [--max-tokens 8]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontend_scaling import free_port
from orchestrator_overhead import HOST, start_orchestrator, start_worker

MARKER = "onepass-step-marker"
STEPS = ("body_parses", "template_renders", "tokenizations", "backend_encodes", "validations",
         "sampling_params_builds", "detokenizers", "detokenizer_steps", "backend_decodes", "python_calls")
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "completions": "/v1/completions"}


def request_body(api: str, max_tokens: int, stream: bool) -> bytes:
    text = f"Tell me a story about a dragon ({MARKER})."
    body: dict = {"model": "tiny-test", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
                  "stream": stream}
    if api == "completions":
        body["prompt"] = text
    else:
        body["messages"] = [{"role": "user", "content": text}]
    return json.dumps(body).encode()


def send(port: int, api: str, body: bytes) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection(HOST, port, timeout=30)
    conn.request("POST", PATHS[api], body, {"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}


def snapshot(count_dir: Path) -> dict[str, dict]:
    """pid -> {"argv", "counts"} as the processes last wrote them."""
    time.sleep(0.6)  # three dump periods: every process has written what it did
    found = {}
    for path in count_dir.glob("*.json"):
        try:
            found[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def role(argv: list[str], ports: dict[int, str]) -> str:
    text = " ".join(argv)
    if "orchestrator" in text:
        return "orchestrator"
    if "engine_proc" in text or "multiprocessing" in text:
        return "engine/other"
    for port, name in ports.items():
        if str(port) in text:
            return f"{name} worker frontend"
    return "worker frontend"


def measure(args: argparse.Namespace, api: str, model_dir: Path, work: Path) -> dict[str, dict[str, float]]:
    count_dir = work / f"counts-{api}"
    count_dir.mkdir()
    hook_dir = work / "hook"
    hook_dir.mkdir(exist_ok=True)
    shutil.copy(Path(__file__).with_name("step_count_hook.py"), hook_dir / "sitecustomize.py")
    os.environ["DISAGG_STEP_COUNT_DIR"] = str(count_dir)
    os.environ["DISAGG_STEP_COUNT_MARKER"] = MARKER
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(hook_dir)) if p)
    key_file = work / "cluster.key"
    key_file.write_bytes(secrets.token_hex(32).encode())
    key_file.chmod(0o600)
    worker_args = argparse.Namespace(num_frontends=1, concurrency=[4], decode_step_seconds=0.0)
    ctx_port, gen_port, port = free_port(), free_port(), free_port()
    servers = []
    try:
        servers.append(start_worker(worker_args, model_dir, "ctx", ctx_port, work, key_file))
        servers.append(start_worker(worker_args, model_dir, "gen", gen_port, work, key_file))
        servers.append(start_orchestrator(model_dir, 1, port, [
            {"role": "ctx", "url": f"http://{HOST}:{ctx_port}"}, {"role": "gen", "url": f"http://{HOST}:{gen_port}"}],
            work))
        body = request_body(api, args.max_tokens, args.stream)
        for _ in range(args.warmup):
            send(port, api, body)
        before = snapshot(count_dir)
        modes = set()
        for _ in range(args.requests):
            status, headers = send(port, api, body)
            if status != 200:
                raise RuntimeError(f"{api}: the orchestrator answered {status}")
            modes.add(headers.get("x-disagg-mode"))
        after = snapshot(count_dir)
    finally:
        for server in reversed(servers):
            server.stop()
        os.environ.pop("DISAGG_STEP_COUNT_DIR")
    if modes != {"disagg"}:
        raise RuntimeError(f"{api}: expected every request disaggregated, got modes {modes}")
    ports = {ctx_port: "ctx", gen_port: "gen"}
    per_role: dict[str, dict[str, float]] = {}
    for pid, now in after.items():
        then = before.get(pid, {"counts": {}})["counts"]
        delta = {step: (now["counts"].get(step, 0) - then.get(step, 0)) / args.requests for step in STEPS}
        if not any(delta.values()):
            continue
        totals = per_role.setdefault(role(now["argv"], ports), dict.fromkeys(STEPS, 0.0))
        for step, value in delta.items():
            totals[step] += value
    return per_role


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--api", default="chat,messages,completions")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="also write the counts here as JSON")
    args = parser.parse_args(argv)
    from workers.engine.model.tiny import make_tiny_model  # torch-free

    work = Path(tempfile.mkdtemp(prefix="disagg-steps-"))
    model_dir = make_tiny_model(work / "tiny-test", size="test")
    report = {}
    for api in args.api.split(","):
        per_role = report[api] = measure(args, api, model_dir, work)
        print(f"\n{api} ({'streamed' if args.stream else 'non-streamed'}), per disaggregated request:")
        print(f"  {'process':<22}" + "".join(f"{step.replace('_', ' '):>14.14}" for step in STEPS))
        total = dict.fromkeys(STEPS, 0.0)
        for name in sorted(per_role):
            print(f"  {name:<22}" + "".join(f"{per_role[name][step]:>14.2f}" for step in STEPS))
            for step in STEPS:
                total[step] += per_role[name][step]
        print(f"  {'all':<22}" + "".join(f"{total[step]:>14.2f}" for step in STEPS))
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
