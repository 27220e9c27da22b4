"""Structured outputs: the host time of one engine step's grammar work, on the CPU.

Issue 17's loss is host work per step (BENCHMARKS.md, "Issue 17"): for each constrained
request that samples, xgrammar's bitmask fill before sampling, the mask applied to the logits,
and the accept of the sampled token after. This times those three pieces through the engine's
own calls (`StructuredOutputManager.grammar_bitmask`, `apply_grammar_bitmask`,
`StructuredOutputManager.accept_tokens`) for N requests that all carry the typical JSON schema
of `benchmarks/structured_outputs.py`, compiled against the real Qwen3 tokenizer. Each request
starts from `--prefix` (default: inside the first string); each step's tokens are the argmax
of random logits under the mask (as random weights sample: strings grow until max_tokens), so
every matcher advances by valid tokens; a request whose grammar ends is replaced by a new one
(untimed). Logits are float32 [rows, 151936] on the CPU.

  python benchmarks/grammar_host.py --num-requests 256 --steps 32
  python benchmarks/grammar_host.py --num-requests 256 --unconstrained 256  # mixed batch

Prints a table of milliseconds per step (median and mean over the timed steps) and one JSON
line.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import git_commit  # noqa: E402
from benchmarks.structured_outputs import DEFAULT_TOKENIZER, SCHEMA  # noqa: E402

VOCAB_SIZE = 151936  # Qwen3's logits width (the tokenizer has 151669 tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER))
    parser.add_argument("--num-requests", type=int, default=256,
                        help="constrained requests sampling each step")  # fmt: skip
    parser.add_argument("--unconstrained", type=int, default=0,
                        help="unconstrained rows interleaved with them (mixed batch)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=32, help="timed steps")
    parser.add_argument("--warmup", type=int, default=4, help="untimed steps first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int,
                        help="host threads of the fill and the accept (default: the engine's "
                        "choice, structured_output.batch_matcher.fill_threads())")  # fmt: skip
    parser.add_argument(
        "--prefix",
        default='{"name": "',
        help="JSON each request starts from (default: inside a string, where the GPU "
        "benchmark's requests spend most tokens and the fill is slowest; '' starts at the "
        "schema's beginning, in JSON whitespace)",
    )
    args = parser.parse_args()

    import torch
    import transformers

    from pagedserve import SamplingParams
    from pagedserve.request import Request
    from pagedserve.sampling_params import StructuredOutputsParams
    from pagedserve.step import GrammarOutput
    from pagedserve.structured_output.manager import StructuredOutputManager
    from pagedserve.worker.grammar_bitmask import apply_grammar_bitmask

    tokenizer = transformers.AutoTokenizer.from_pretrained(args.tokenizer)
    manager = StructuredOutputManager(lambda: tokenizer, VOCAB_SIZE, [tokenizer.eos_token_id])
    params = SamplingParams(
        max_tokens=1 << 20, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    if args.threads is not None:
        from pagedserve.structured_output.batch_matcher import BatchMatcher

        manager._batch_matcher = BatchMatcher(args.threads)
    counter = [0]
    prefix = tokenizer.encode(args.prefix, add_special_tokens=False)

    def new_request() -> Request:
        counter[0] += 1
        request = Request(f"c{counter[0]}", [1, 2, 3], params)
        manager.init_request(request)
        request.structured_output.compiled.result(timeout=600)  # type: ignore[union-attr]
        assert manager.is_ready(request)
        for token in prefix:  # untimed
            request.append_output_token_ids([token])
            assert not manager.accept_tokens([(request, token, None)])
        return request

    constrained = [new_request() for _ in range(args.num_requests)]
    # Row order of the batch: constrained and unconstrained rows alternate while both last.
    num_rows = args.num_requests + args.unconstrained
    is_constrained, left = [], [args.num_requests, args.unconstrained]
    for slot in range(num_rows):
        is_constrained.append(left[1] == 0 or (left[0] > 0 and slot % 2 == 0))
        left[0 if is_constrained[-1] else 1] -= 1
    torch.manual_seed(args.seed)
    base = torch.randn(num_rows, VOCAB_SIZE)
    times: dict[str, list[float]] = {"fill": [], "apply": [], "accept": []}
    num_ended = 0
    for step in range(args.warmup + args.steps):
        ids, it = [], iter(constrained)
        for slot in range(num_rows):
            ids.append(next(it).request_id if is_constrained[slot] else f"u{slot}")
        logits = base.roll(step * 7919, dims=1)  # fresh logits, untimed
        t0 = time.perf_counter()
        bitmask = manager.grammar_bitmask(constrained)
        t1 = time.perf_counter()
        grammar = GrammarOutput([r.request_id for r in constrained], bitmask)
        apply_grammar_bitmask(logits, grammar, ids)
        t2 = time.perf_counter()
        tokens = logits.argmax(dim=1).tolist()
        rows = [slot for slot in range(num_rows) if is_constrained[slot]]
        applied = []
        for request, slot in zip(constrained, rows, strict=True):
            request.append_output_token_ids([tokens[slot]])
            applied.append((request, tokens[slot], None))
        t3 = time.perf_counter()
        ended = manager.accept_tokens(applied)
        t4 = time.perf_counter()
        if step >= args.warmup:
            times["fill"].append(t1 - t0)
            times["apply"].append(t2 - t1)
            times["accept"].append(t4 - t3)
        for i, request in enumerate(constrained):
            if request.request_id in ended:
                manager.free_request(request)
                constrained[i] = new_request()
                num_ended += 1
    batch = getattr(manager, "_batch_matcher", None)  # BatchMatcher; xgrammar's before it
    grammar_threads = getattr(batch, "threads", "xgrammar auto")
    manager.shutdown()

    print(
        f"{args.num_requests} constrained + {args.unconstrained} unconstrained rows, "
        f"{args.steps} steps (+{args.warmup} warm-up), vocab {VOCAB_SIZE}, "
        f"torch threads {torch.get_num_threads()}, grammar threads {grammar_threads}; "
        f"{git_commit()}"
    )
    print(f"{'phase':>7} {'median ms':>10} {'mean ms':>9}")
    result: dict[str, Any] = {"num_requests": args.num_requests, "steps": args.steps}
    for phase, values in times.items():
        median, mean = statistics.median(values) * 1e3, statistics.fmean(values) * 1e3
        print(f"{phase:>7} {median:10.2f} {mean:9.2f}")
        result[f"{phase}_ms"] = round(median, 3)
    total = sum(result[f"{p}_ms"] for p in times)
    print(f"{'total':>7} {total:10.2f}   (grammars ended and replaced: {num_ended})")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
