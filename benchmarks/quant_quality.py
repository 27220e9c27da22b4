"""Quality of quantized checkpoints: perplexity of ../shared/models/tinystories-656k on a
held-out text, unquantized vs each quantized checkpoint, computed through our engine (`LLM`
with prompt_logprobs=0 on the CPU), the unquantized row cross-checked against transformers'
loss.

The held-out text (benchmarks/data/tinystories_heldout.txt) is twelve short stories written
for this benchmark in the TinyStories style, never seen by the quantizers. Calibration (GPTQ's
Hessians, AWQ's activation statistics) uses the model's own kind of text: stories sampled from
the unquantized model (temperature 1, seeded), not the held-out text.

Rows (all regenerated into a temporary folder on each run):
- RTN: round-to-nearest in the GPTQ / AWQ layouts (tests/quantization/gptq_pack.py and
  awq_pack.py, the spec packers checked bit-for-bit against AutoGPTQ / AutoAWQ);
- GPTQ: GPTQModel's GPTQ (Hessian-based error correction, Frantar et al. 2022), with
  --tool-python gptqmodel=PYTHON (a venv where `gptqmodel` is installed);
- AWQ: AutoAWQ's activation-aware scaling + clipping search, with
  --tool-python autoawq=PYTHON;
- any checkpoint given as --checkpoint LABEL=PATH (e.g. an FP8 or compressed-tensors one).
Rows whose tool is not given are skipped (said in the output).

  python benchmarks/quant_quality.py --tool-python gptqmodel=/tmp/venv-q/bin/python \
      --tool-python autoawq=/tmp/venv-awq/bin/python

Prints a table (perplexity, change vs unquantized) and one JSON line per row.
"""

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import git_commit  # noqa: E402

MODEL = REPO.parent / "shared" / "models" / "tinystories-656k"
HELDOUT = REPO / "benchmarks" / "data" / "tinystories_heldout.txt"
TOOLS_SCRIPT = REPO / "benchmarks" / "quant_tools.py"


@dataclass
class Row:
    label: str
    method: str | None  # what the engine must detect: gptq, awq, "auto" (None: unquantized)
    made_by: str
    path: Path | None = None  # set once made


def gptq_jobs() -> list[dict[str, Any]]:
    """GPTQModel's rows: 4-bit g32/g64/g128 and 8-bit g128, act-order off and on."""
    jobs = []
    for bits, group_size, desc_act in (
        (4, 32, False), (4, 32, True), (4, 64, False), (4, 128, False), (4, 128, True),
        (8, 128, False), (8, 128, True),
    ):  # fmt: skip
        order = "-actorder" if desc_act else ""
        params = {"bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": True}
        jobs.append({"label": f"gptq-{bits}bit-g{group_size}{order}", "params": params})
    return jobs


def awq_jobs() -> list[dict[str, Any]]:
    """AutoAWQ's rows: 4-bit GEMM, g32/g64/g128, zero points; with its defaults, and at g128
    also with duo_scaling=False (its scale search from activations alone: on this model the
    default, which also divides by weight magnitudes, is worse than RTN)."""
    jobs = []
    for g, options in ((32, {}), (64, {}), (128, {}), (128, {"duo_scaling": False})):
        params = {"zero_point": True, "q_group_size": g, "w_bit": 4, "version": "GEMM"}
        suffix = "-noduo" if options else ""
        jobs.append(
            {"label": f"awq-4bit-g{g}{suffix}", "params": {**params, "quantize_options": options}}
        )
    return jobs


def rtn_rows(work: Path) -> list[Row]:
    """Round-to-nearest checkpoints in the GPTQ and AWQ layouts (our spec packers)."""
    from tests.quantization.awq_pack import write_awq_checkpoint
    from tests.quantization.gptq_pack import write_gptq_checkpoint

    rows = []
    for bits, group_size in ((4, 32), (4, 64), (4, 128), (8, 128)):
        label = f"rtn-gptq-{bits}bit-g{group_size}"
        path = work / label
        write_gptq_checkpoint(
            MODEL, path, work / f"{label}-dequantized", bits, group_size, False, True
        )
        rows.append(Row(label, "gptq", "RTN (tests/quantization/gptq_pack.py)", path))
    for group_size in (32, 128):
        label = f"rtn-awq-4bit-g{group_size}"
        write_awq_checkpoint(MODEL, work / label, work / f"{label}-dequantized", group_size)
        rows.append(Row(label, "awq", "RTN (tests/quantization/awq_pack.py)", work / label))
    return rows


def tool_rows(
    tool: str, python: str, jobs: list[dict[str, Any]], method: str, calib: Path, work: Path
) -> list[Row]:
    """Run benchmarks/quant_tools.py with the tool's Python; one Row per job."""
    jobs_file = work / f"{tool}-jobs.json"
    jobs_file.write_text(json.dumps(jobs))
    log = work / f"{tool}.log"
    with open(log, "w") as f:
        done = subprocess.run(
            [python, str(TOOLS_SCRIPT), tool, str(MODEL), str(calib), str(work), str(jobs_file)],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=work,  # GPTQModel writes a logs/ folder into its working directory
            check=False,
        )
    if done.returncode:
        sys.exit(f"{tool} failed ({done.returncode}); its log:\n{log.read_text()[-4000:]}")
    version = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({tool!r}))"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    name = {"gptqmodel": "GPTQModel", "autoawq": "AutoAWQ"}[tool]
    return [Row(j["label"], method, f"{name} {version}", work / j["label"]) for j in jobs]


def heldout_ids(tokenizer: Any) -> list[list[int]]:
    """Each held-out story as token ids (with the tokenizer's BOS)."""
    stories = [s.strip() for s in HELDOUT.read_text().split("\n\n") if s.strip()]
    return [tokenizer(story)["input_ids"] for story in stories]


def sample_calibration(num_samples: int, max_tokens: int, seed: int) -> list[list[int]]:
    """Stories sampled from the unquantized model through our engine: BOS + up to
    `max_tokens` tokens each, temperature 1, seeded; cut at EOS."""
    from pagedserve import LLM, SamplingParams

    with LLM(str(MODEL), device="cpu", dtype="float32", seed=seed) as llm:
        params = [
            SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=seed + i, detokenize=False)
            for i in range(num_samples)
        ]
        bos = llm.get_tokenizer().bos_token_id
        outputs = llm.generate(
            [{"prompt_token_ids": [bos]} for _ in range(num_samples)], params, use_tqdm=False
        )
    return [[bos, *o.outputs[0].token_ids] for o in outputs]


def engine_nll(path: Path, stories: list[list[int]], method: str | None) -> tuple[float, int]:
    """(summed negative log-likelihood in nats, number of predicted tokens) of `stories`
    under the checkpoint at `path`, from our engine's prompt_logprobs; checks that the
    engine detected `method`."""
    from pagedserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    with LLM(str(path), device="cpu", dtype="float32", skip_tokenizer_init=True) as llm:
        detected = llm.llm_engine.config.model_config.quantization
        assert detected == method, f"{path}: engine detected {detected!r}, expected {method!r}"
        outputs = llm.generate([{"prompt_token_ids": s} for s in stories], params, use_tqdm=False)
    nll, count = 0.0, 0
    for story, output in zip(stories, outputs, strict=True):
        logprobs = output.prompt_logprobs
        assert logprobs is not None and len(logprobs) == len(story)
        for token, position in zip(story[1:], logprobs[1:], strict=True):
            assert position is not None
            nll -= position[token].logprob
            count += 1
    return nll, count


def transformers_nll(stories: list[list[int]]) -> tuple[float, int]:
    """The same sum from transformers' cross-entropy loss on the unquantized model."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    nll, count = 0.0, 0
    with torch.no_grad():
        for story in stories:
            ids = torch.tensor([story])
            loss = model(ids, labels=ids).loss.item()  # mean over len - 1 predictions
            nll += loss * (len(story) - 1)
            count += len(story) - 1
    return nll, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tool-python",
        action="append",
        default=[],
        metavar="TOOL=PYTHON",
        help="gptqmodel=... / autoawq=...: a Python with that tool installed",
    )
    parser.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="an extra quantized checkpoint folder (auto-detected method)",
    )
    parser.add_argument("--calib-samples", type=int, default=128)
    parser.add_argument("--calib-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="keep the checkpoints here (default: a temp dir)")
    args = parser.parse_args()  # fmt: skip
    tools = dict(item.split("=", 1) for item in args.tool_python)

    from pagedserve.engine.llm_engine import load_tokenizer

    start = time.perf_counter()
    stories = heldout_ids(load_tokenizer(str(MODEL)))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        calibration = sample_calibration(args.calib_samples, args.calib_tokens, args.seed)
        calib = work / "calibration.json"
        calib.write_text(json.dumps(calibration))
        rows = [Row("unquantized", None, "-", MODEL)] + rtn_rows(work)
        makers: dict[str, tuple[Callable[[], list[dict[str, Any]]], str]] = {
            "gptqmodel": (gptq_jobs, "gptq"),
            "autoawq": (awq_jobs, "awq"),
        }
        for tool, (jobs, method) in makers.items():
            if tool in tools:
                rows += tool_rows(tool, tools[tool], jobs(), method, calib, work)
            else:
                print(f"# skipped {tool}'s rows: no --tool-python {tool}=PYTHON")
        for item in args.checkpoint:
            label, path = item.split("=", 1)
            rows.append(Row(label, "auto", "--checkpoint", Path(path)))
        results = []
        for row in rows:
            assert row.path is not None
            method = None if row.method == "auto" else row.method
            if row.method == "auto":
                from pagedserve.engine.arg_utils import EngineArgs

                method = EngineArgs(model=str(row.path), device="cpu").create_engine_config()
                method = method.model_config.quantization
            nll, count = engine_nll(row.path, stories, method)
            results.append({"label": row.label, "method": method, "made_by": row.made_by,
                            "ppl": math.exp(nll / count), "tokens": count})  # fmt: skip
    hf_nll, hf_count = transformers_nll(stories)
    hf_ppl = math.exp(hf_nll / hf_count)
    base = results[0]["ppl"]
    calib_tokens = sum(len(c) for c in calibration)
    print(f"\ntinystories-656k, held-out: {len(stories)} stories, {results[0]['tokens']} "
          f"predicted tokens; calibration: {len(calibration)} sampled stories, {calib_tokens} "
          f"tokens; commit {git_commit()}; {time.perf_counter() - start:.0f} s")  # fmt: skip
    print(f"transformers' loss on the unquantized model: ppl {hf_ppl:.4f} "
          f"(engine: {base:.4f}, |diff| {abs(hf_ppl - base):.2e})\n")  # fmt: skip
    print("| checkpoint | method | made by | perplexity | vs unquantized |")
    print("| --- | --- | --- | ---: | ---: |")
    for r in results:
        change = (r["ppl"] / base - 1) * 100
        print(f"| {r['label']} | {r['method'] or '-'} | {r['made_by']} | {r['ppl']:.3f} | "
              f"{change:+.2f}% |")  # fmt: skip
    for r in results:
        print(json.dumps({**r, "transformers_ppl_unquantized": hf_ppl}))
    assert abs(hf_ppl - base) / base < 1e-3, "engine and transformers disagree on the model"


if __name__ == "__main__":
    main()
