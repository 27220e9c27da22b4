"""The experiment this project started from: a Flask server around transformers `generate`
versus our server, on the same model, with the same 50 requests sent the same way.

The baseline is the classic one: Flask with `threaded=False` (one request at a time), each
request tokenized and run through `model.generate(**inputs, max_new_tokens=50)` (fp16 on GPU,
fp32 on CPU). Ours is `python -m pagedserve.entrypoints.openai.api_server` on the same
weights, asked for `max_tokens=50` greedily through /v1/completions. Both stop at EOS. All
requests are sent at once from a thread pool; the time is until the last answer arrives. Each
server first answers a few untimed warm-up requests (first-use compilation stays out).

  pip install flask
  python benchmarks/seed_baseline.py --model ../shared/models/tinystories-656k --device cpu
  python benchmarks/seed_baseline.py --preset gpt2-large --tokenizer ../shared/tokenizers/gpt2 \
      --device cuda      # random weights of the gpt2-large architecture, saved once
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
MAX_NEW_TOKENS = 50
_SUBJECTS = ["a little girl", "a brave dog", "an old man", "a tiny bird", "two friends"]
_OPENINGS = [
    "Once upon a time, there was {}",
    "One day, {} went to the park and",
    "In a small town lived {} who",
    "Every morning, {} liked to",
    "Long ago, {} found a box that",
    "It was a sunny day and {}",
    "At night, {} looked at the stars and",
    "By the river, {} saw",
    "On a rainy day, {} wanted to",
    "Near the big tree, {} met",
]


def make_prompts(num: int) -> list[str]:
    prompts = [opening.format(subject) for opening in _OPENINGS for subject in _SUBJECTS]
    return [prompts[i % len(prompts)] for i in range(num)]


def flask_worker(args: argparse.Namespace) -> None:
    """The baseline server (run in its own process by this script)."""
    try:
        from flask import Flask, jsonify, request
    except ImportError:
        sys.exit("the baseline needs Flask: pip install flask")
    import torch
    import transformers

    device = args.device
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    model = model.to(device).eval()
    app = Flask(__name__)

    @app.route("/health")
    def health() -> Any:
        return "ok"

    @app.route("/generate", methods=["POST"])
    def generate() -> Any:
        inputs = tokenizer(request.json["prompt"], return_tensors="pt").to(device)
        with torch.no_grad():
            outputs = model.generate(
                **inputs, max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.eos_token_id
            )
        new_tokens = outputs[0][inputs["input_ids"].shape[1] :]
        text = tokenizer.decode(outputs[0], skip_special_tokens=True)
        return jsonify({"text": text, "num_output_tokens": len(new_tokens)})

    app.run(host="127.0.0.1", port=args.port, threaded=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def start(command: list[str], url: str, log_path: Path, timeout_s: float = 600) -> Any:
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    log = open(log_path, "w")  # noqa: SIM115 (the process writes to it until stop())
    process = subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            sys.exit(f"{command[:4]} exited; log:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stop(process)
    sys.exit(f"{command[:4]} did not start in {timeout_s} s")


def stop(process: Any) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


# Set by --client-per-request: each request makes its own httpx client, as this script did
# before 2026-12-02. A client builds a TLS context (~26 ms of CPU, under the GIL) even for
# http://, so 50 of them cost the burst ~1 s of client time before any server work.
CLIENT_PER_REQUEST = False


def send_all(url: str, bodies: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    """POST every body at once (one thread each, one shared connection pool with a
    connection per request); seconds until the last reply, the replies."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=len(bodies))
    client = httpx.Client(timeout=3600, limits=limits)  # made before the clock starts

    def post(body: dict[str, Any]) -> dict[str, Any]:
        if CLIENT_PER_REQUEST:
            response = httpx.post(url, json=body, timeout=3600)
        else:
            response = client.post(url, json=body)
        response.raise_for_status()
        reply: dict[str, Any] = response.json()
        return reply

    with client, ThreadPoolExecutor(max_workers=len(bodies)) as pool:
        begin = time.perf_counter()
        replies = list(pool.map(post, bodies))
        return time.perf_counter() - begin, replies


_BREAKDOWN = ("time_to_first_token_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds",
              "e2e_request_latency_seconds", "iteration_tokens_total")  # fmt: skip


def server_sums(url: str) -> dict[str, float]:
    """The server's histogram `_sum` and `_count` samples of `_BREAKDOWN`, from /metrics."""
    sums: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ") if "{" not in line else line.partition("} ")
        name = name.split("{")[0].removeprefix("pagedserve:")
        if name.removesuffix("_sum").removesuffix("_count") in _BREAKDOWN:
            sums[name] = sums.get(name, 0.0) + float(value)
    return sums


def print_breakdown(
    seconds: float, before: dict[str, float], after: dict[str, float], num: int
) -> None:
    """One burst as the server saw it: mean seconds per request of each phase, and the
    engine steps it took (iteration_tokens_total's count)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = delta.get("iteration_tokens_total_count", 0.0)
    phases = "  ".join(
        f"{name.split('_seconds')[0].removeprefix('request_')} "
        f"{1000 * delta.get(name + '_sum', 0.0) / max(delta.get(name + '_count', 0.0), 1):.1f}"
        for name in _BREAKDOWN[:-1]
    )
    per_step = 1000 * seconds / max(steps, 1)
    print(f"burst {seconds:.3f} s, {num} requests, {steps:.0f} steps ({per_step:.1f} ms/step); "
          f"server means (ms): {phases}")  # fmt: skip


def resolve_model(args: argparse.Namespace, workdir: Path) -> str:
    """The model folder; for a preset, random weights saved once so both servers load them."""
    if args.preset is None:
        return str(args.model)
    import torch
    import transformers

    sys.path.insert(0, str(REPO))
    from benchmarks.presets import materialize

    folder = materialize(args.preset, workdir)
    if args.tokenizer is None:
        sys.exit("--preset needs --tokenizer DIR (a tokenizer for the architecture's vocabulary)")
    for name in os.listdir(args.tokenizer):
        shutil.copy(Path(args.tokenizer) / name, folder / name)
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "float16" if args.device.startswith("cuda") else "float32"  # as the baseline
    workdir = Path(tempfile.mkdtemp(prefix="seed-baseline-"))
    model = resolve_model(args, workdir)
    prompts = make_prompts(args.num_requests)
    results: dict[str, Any] = {}

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if args.skip_baseline:
        return _run_ours(args, model, dtype, prompts, workdir, results)
    flask_cmd = [sys.executable, __file__, "--flask-worker", "--model", model,
                 "--port", str(port), "--device", args.device]  # fmt: skip
    process = start(flask_cmd, url, workdir / "flask.log")
    try:
        send_all(f"{url}/generate", [{"prompt": p} for p in prompts[:2]])  # warm-up, untimed
        seconds, replies = send_all(f"{url}/generate", [{"prompt": p} for p in prompts])
    finally:
        stop(process)
    results["flask_transformers"] = (seconds, sum(r["num_output_tokens"] for r in replies))
    return _run_ours(args, model, dtype, prompts, workdir, results)


def _run_ours(
    args: argparse.Namespace,
    model: str,
    dtype: str,
    prompts: list[str],
    workdir: Path,
    results: dict[str, Any],
) -> dict[str, Any]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours_cmd = [sys.executable, "-m", "pagedserve.entrypoints.openai.api_server",
                "--model", model, "--port", str(port), "--host", "127.0.0.1",
                "--device", args.device, "--dtype", dtype, "--disable-log-requests",
                *args.server_args]  # fmt: skip
    process = start(ours_cmd, url, workdir / "pagedserve.log")
    try:
        bodies = [{"prompt": p, "max_tokens": MAX_NEW_TOKENS, "temperature": 0.0} for p in prompts]
        # Warm-up, untimed: Triton compiles a kernel variant the first time a batch shape
        # needs it (prefill next to decodes, split-KV), which would otherwise land in the run.
        send_all(f"{url}/v1/completions", bodies[:8])
        runs = []
        for _ in range(args.repeat):
            before = server_sums(url)
            seconds, replies = send_all(f"{url}/v1/completions", bodies)
            runs.append(seconds)
            print_breakdown(seconds, before, server_sums(url), len(bodies))
    finally:
        stop(process)
    seconds = sorted(runs)[len(runs) // 2]  # the median run
    results["pagedserve"] = (seconds, sum(r["usage"]["completion_tokens"] for r in replies))
    shutil.rmtree(workdir, ignore_errors=True)

    print(f"{'server':<22}{'seconds':>10}{'req/s':>10}{'out tokens':>12}")
    for name, (seconds, num_tokens) in results.items():
        print(f"{name:<22}{seconds:>10.2f}{len(prompts) / seconds:>10.2f}{num_tokens:>12}")
    speedup = None
    if "flask_transformers" in results:
        speedup = results["flask_transformers"][0] / results["pagedserve"][0]
        print(f"speed-up: {speedup:.1f}x")
    return {
        "benchmark": "seed_baseline",
        "model": args.preset or str(args.model),
        "device": args.device,
        "dtype": dtype,
        "num_requests": len(prompts),
        "max_new_tokens": MAX_NEW_TOKENS,
        **{f"{name}_seconds": seconds for name, (seconds, _) in results.items()},
        **{f"{name}_output_tokens": tokens for name, (_, tokens) in results.items()},
        "speedup": speedup,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(REPO / "pagedserve" / "assets" / "stories260k"))
    parser.add_argument("--preset", default=None, help="a benchmarks/presets.py architecture")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder for --preset")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--client-per-request", action="store_true",
                        help="one httpx client per request (see CLIENT_PER_REQUEST)")  # fmt: skip
    parser.add_argument("--skip-baseline", action="store_true",
                        help="run only our server (no Flask baseline, no speed-up)")  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1,
                        help="timed bursts on our server; the median is reported")  # fmt: skip
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                        help="extra flags for our server (put last)")  # fmt: skip
    parser.add_argument("--flask-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.flask_worker:
        flask_worker(args)
        return
    global CLIENT_PER_REQUEST
    CLIENT_PER_REQUEST = args.client_per_request
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
