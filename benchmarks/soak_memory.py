"""Memory soak: many small requests with varied prompts against a real server, RSS sampled.

Starts `python -m pagedserve.entrypoints.openai.api_server` (CPU by default, the bundled
model unless --model), sends `--num-requests` non-streaming completions (each prompt a fresh
random word sequence, so that no two are alike) from `--concurrency` clients, and samples the
resident set size (RSS, from /proc/PID/status) of the API-server process and of its
engine-core child every `--sample-every` requests. Prints the samples as a table, then the
growth per request over the second half of the run (least squares), for each process, and one
JSON line. A leak shows as a steady slope; a plateau as a slope near 0.

`--tokenizer-only` runs the same prompts through the model's tokenizer in this process alone
(no server, no model; `--threads N` encodes from N threads as the server's pool does), which
is where the server's growth came from: the `tokenizers` BPE model caches the tokens of each
distinct "word" it has seen, in Rust (invisible to tracemalloc), up to 10,000 words of at most
256 bytes. Tokenizers whose pre-tokenizer does not split (Llama 2, the bundled stories260k)
make a whole prompt one word; encoded from several threads, such a tokenizer grew without
bound, so `load_tokenizer` turns that cache off (`--keep-word-cache` shows it on).

  python -m benchmarks.soak_memory --num-requests 200000 --concurrency 32
  python -m benchmarks.soak_memory --tokenizer-only --num-requests 200000 --threads 6
"""

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from benchmarks.common import git_commit

REPO = Path(__file__).resolve().parents[1]
_WORDS = (  # noqa: SIM905 (a sentence reads better than a list)
    "the a time upon once little girl boy dog cat tree sun moon happy sad big small red blue "
    "ran jumped played saw found said went home friend park ball water bird fish sky day night "
    "Lily Tom Sue Max apple cake toy box car hat shoe book king queen frog duck bear"
).split()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process in bytes (VmRSS of /proc/PID/status); 0 if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    """Direct child pids of a process (Linux /proc)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def slope_bytes_per_request(points: list[tuple[int, int]]) -> float:
    """Least-squares slope of RSS (bytes) against requests done."""
    n = len(points)
    if n < 2:
        return float("nan")
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    cov = sum((x - mean_x) * (y - mean_y) for x, y in points)
    return cov / var if var else float("nan")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "pagedserve.entrypoints.openai.api_server",
        "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
        "--disable-log-stats", "--uvicorn-log-level", "warning", *args.server_args,
    ]  # fmt: skip
    if args.model:
        command += ["--model", args.model]
    env = dict(os.environ, PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    process = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit("the server did not become healthy in 300 s")


async def soak(args: argparse.Namespace, url: str, server_pid: int) -> list[dict[str, int]]:
    rng = random.Random(args.seed)
    samples: list[dict[str, int]] = []
    done = 0
    failed = 0
    next_sample = 0
    lock = asyncio.Lock()

    def sample() -> None:
        core = children(server_pid)
        samples.append(
            {
                "requests": done,
                "server_rss": rss_bytes(server_pid),
                "core_rss": sum(rss_bytes(pid) for pid in core),
            }
        )

    deadline = time.monotonic() + args.max_seconds

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal done, failed, next_sample
        while True:
            async with lock:
                if done + failed >= args.num_requests or time.monotonic() > deadline:
                    return
                if done >= next_sample:
                    sample()
                    next_sample += args.sample_every
            body = {
                "prompt": make_prompt(rng, args),
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            try:
                response = await client.post(f"{url}/v1/completions", json=body)
                error = "" if response.status_code == 200 else f"HTTP {response.status_code}"
            except httpx.HTTPError as e:  # counted, not fatal: one dropped connection
                error = repr(e)  # must not end a run of 200,000
            if not error:
                done += 1
                continue
            failed += 1
            if failed <= 5:
                print(f"request failed after {done} done: {error}", file=sys.stderr)
            if failed > args.num_requests // 100:
                raise SystemExit(f"{failed} requests failed; the server log has the cause")

    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(args.concurrency)))
    sample()
    if failed:
        print(f"{failed} requests failed", file=sys.stderr)
    return samples


def make_prompt(rng: random.Random, args: argparse.Namespace) -> str:
    """A random word sequence of --min-words to --max-words words."""
    length = rng.randint(args.min_words, args.max_words)
    return " ".join(rng.choice(_WORDS) for _ in range(length))


def soak_tokenizer(args: argparse.Namespace) -> list[dict[str, int]]:
    """Encode the soak's prompts with the model's tokenizer here, from `--threads` threads as
    the server's pool does (0: this thread); sample this process's RSS."""
    from pagedserve.config import DEFAULT_MODEL
    from pagedserve.engine.llm_engine import load_tokenizer

    path = args.model or DEFAULT_MODEL
    if args.keep_word_cache:  # as transformers loads it, the BPE word cache on
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        tokenizer = load_tokenizer(path)
    rng = random.Random(args.seed)
    pool = ThreadPoolExecutor(args.threads) if args.threads else None
    samples = []
    for start in range(0, args.num_requests + 1, args.sample_every):
        samples.append({"requests": start, "server_rss": rss_bytes(os.getpid()), "core_rss": 0})
        count = min(args.sample_every, args.num_requests - start)
        prompts = [make_prompt(rng, args) for _ in range(count)]
        if pool is None:
            for prompt in prompts:
                tokenizer.encode(prompt)
        else:
            list(pool.map(tokenizer.encode, prompts))
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model folder (default: the bundled one)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--sample-every", type=int, default=2000)
    parser.add_argument("--min-words", type=int, default=4)
    parser.add_argument("--max-words", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-seconds", type=float, default=float("inf"), help="stop sending after this long"
    )
    parser.add_argument(
        "--tokenizer-only", action="store_true", help="only encode the prompts, in this process"
    )
    parser.add_argument("--threads", type=int, default=0, help="--tokenizer-only: encoding threads")
    parser.add_argument(
        "--keep-word-cache",
        action="store_true",
        help="--tokenizer-only: the tokenizer as transformers loads it (BPE word cache on)",
    )
    parser.add_argument(
        "server_args", nargs="*", help="extra server flags, after `--` (e.g. -- --block-size 32)"
    )
    args = parser.parse_args()
    start = time.perf_counter()
    if args.tokenizer_only:
        samples = soak_tokenizer(args)
    else:
        process, url = start_server(args)
        try:
            samples = asyncio.run(soak(args, url, process.pid))
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=30)
    elapsed = time.perf_counter() - start
    print(f"{'requests':>9} {'server RSS MiB':>15} {'core RSS MiB':>13}")
    for s in samples:
        print(f"{s['requests']:>9} {s['server_rss'] / 2**20:>15.1f} {s['core_rss'] / 2**20:>13.1f}")
    num_done = samples[-1]["requests"]
    second_half = [s for s in samples if s["requests"] >= num_done // 2]
    server_slope = slope_bytes_per_request([(s["requests"], s["server_rss"]) for s in second_half])
    core_slope = slope_bytes_per_request([(s["requests"], s["core_rss"]) for s in second_half])
    print(
        f"second-half growth: server {server_slope:.1f} B/request, core {core_slope:.1f} "
        f"B/request; {samples[-1]['requests']} requests in {elapsed:.0f} s"
    )
    print(
        json.dumps(
            {
                "benchmark": "soak_memory",
                "mode": "tokenizer-only" if args.tokenizer_only else "server",
                "commit": git_commit(),
                "num_requests": samples[-1]["requests"],
                "elapsed_s": round(elapsed, 1),
                "server_bytes_per_request": round(server_slope, 1),
                "core_bytes_per_request": round(core_slope, 1),
                "samples": samples,
            }
        )
    )


if __name__ == "__main__":
    main()
