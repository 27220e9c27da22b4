"""The offline API on the bundled model: inputs, sampling options, stop rules and bad input."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM, SamplingParams
from pagedserve.config import DEFAULT_MODEL
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.prompt_bound import token_bound
from pagedserve.errors import InvalidRequestError, UnsupportedModelError

SHARED = Path(__file__).resolve().parents[3] / "shared"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", device="cpu", max_model_len=512, kv_cache_memory_bytes=16 << 20)


def test_prompt_forms_and_input_order(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=8)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("The little dog")
    single = llm.generate("Once upon a time", params, use_tqdm=False)
    batch = llm.generate(
        ["Once upon a time", {"prompt_token_ids": ids}, {"prompt": "Mom said"}],
        params,
        use_tqdm=False,
    )
    assert len(single) == 1 and [o.prompt for o in batch] == ["Once upon a time", None, "Mom said"]
    assert batch[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    assert batch[1].prompt_token_ids == ids
    out = batch[0]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].index == 0


def test_one_sampling_params_per_prompt(llm: LLM) -> None:
    outs = llm.generate(
        ["Once upon a time", "Once upon a time"],
        [SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=0, max_tokens=5)],
        use_tqdm=False,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5]
    with pytest.raises(ValueError, match="2 SamplingParams for 1 prompts"):
        llm.generate(["a"], [SamplingParams(), SamplingParams()], use_tqdm=False)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=n) for n in (5, 13, 21)]
    batch = llm.generate(
        ["The cat", "Once upon a time", "A big tree", "Lily"],
        [others[0], seeded, others[1], others[2]],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, seed=99)
    assert (
        llm.generate("Once upon a time", unseeded, use_tqdm=False)[0].outputs[0].token_ids != alone
    )


def test_top_k_1_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=15), use_tqdm=False
    )
    top1 = llm.generate(
        "Once upon a time", SamplingParams(temperature=1.5, top_k=1, max_tokens=15), use_tqdm=False
    )
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_stop_strings_and_stop_token_ids(llm: LLM) -> None:
    base = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )[0].outputs[0]
    assert "Lily" in base.text  # ", there was a little girl named Lily. She loved ..."
    stopped = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=40, stop=["Lily", "zzz"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.text == base.text[: base.text.index("Lily")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Lily"
    kept = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=40, stop="Lily", include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == base.text[: base.text.index("Lily") + 4]
    stop_id = base.token_ids[5]
    by_id = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == base.token_ids[: base.token_ids.index(stop_id) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id


def test_min_tokens_and_eos(llm: LLM) -> None:
    # stories260k ends a story with BOS (id 1); make it a stop token and see min_tokens hold it.
    params = SamplingParams(temperature=0, max_tokens=400, stop_token_ids=[1])
    first = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert first.finish_reason == "stop" and first.token_ids[-1] == 1
    n = len(first.token_ids)
    longer = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=400, stop_token_ids=[1], min_tokens=n + 5),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(longer.token_ids) > n + 5 and 1 not in longer.token_ids[: n + 5]


def test_logprobs_match_log_softmax(llm: LLM) -> None:
    out = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=5, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    engine = llm.llm_engine
    model = engine.engine_core.executor.worker.runner.model
    tokens = out.logprobs
    prompt = llm.get_tokenizer().encode("Once upon a time")
    # Recompute with a plain full forward of transformers for the reference.
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
    ref = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    total = 0.0
    for pos, (token_id, entry) in enumerate(zip(out.token_ids, tokens, strict=True)):
        assert entry[token_id].rank == 1  # greedy
        assert abs(entry[token_id].logprob - ref[pos, token_id].item()) < 1e-4
        top = ref[pos].topk(3)
        assert set(top.indices.tolist()) <= set(entry)
        assert entry[token_id].decoded_token is not None
        total += entry[token_id].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert model is not None


def test_n_returns_n_sequences(llm: LLM) -> None:
    out = llm.generate(
        "Once upon a time",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate(
        "Once upon a time",
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10),
        use_tqdm=False,
    )[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_skip_special_tokens(llm: LLM) -> None:
    # stories260k emits BOS ("<s>") at the end of its story, after about 340 tokens.
    ids = {"prompt_token_ids": [1, 403, 407, 261, 378]}
    skipped = llm.generate(ids, SamplingParams(temperature=0, max_tokens=360), use_tqdm=False)[
        0
    ].outputs[0]
    assert 1 in skipped.token_ids and "<s>" not in skipped.text
    kept = llm.generate(
        ids,
        SamplingParams(temperature=0, max_tokens=360, skip_special_tokens=False),
        use_tqdm=False,
    )[0].outputs[0]
    assert "<s>" in kept.text
    # The stop token that ends a request is not part of the text, as in vLLM.
    stopped = llm.generate(
        ids,
        SamplingParams(
            temperature=0, max_tokens=360, stop_token_ids=[1], skip_special_tokens=False
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids[-1] == 1 and "<s>" not in stopped.text


def test_bad_input_raises_value_error_naming_limits(llm: LLM) -> None:
    long_prompt = {"prompt_token_ids": [5] * 512}
    with pytest.raises(ValueError, match=r"512 tokens.*max_model_len \(512\)"):
        llm.generate(long_prompt, use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompt \(400 tokens\) \+ max_tokens \(200\).*512"):
        llm.generate(
            {"prompt_token_ids": [5] * 400}, SamplingParams(max_tokens=200), use_tqdm=False
        )
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [1, 99999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="chat template"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    # A failing batch leaves nothing behind; the engine still works.
    with pytest.raises(ValueError):
        llm.generate(["fine", {"prompt_token_ids": []}], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.generate("Once", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_p": 2.0}, "min_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": -1}, "logprobs"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"stop": [""]}, "stop"),
        ({"n": 10**9}, "n"),  # PAGEDSERVE_MAX_N_SEQUENCES (16384), as vLLM's limit
        ({"n": 2, "best_of": 16385}, "best_of"),
        ({"output_kind": "delta"}, "output_kind"),
    ],
)
def test_invalid_sampling_params(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}"):
        SamplingParams(**kwargs)
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kwargs)


def test_max_n_sequences_is_configurable(monkeypatch: pytest.MonkeyPatch) -> None:
    assert SamplingParams(n=16384).n == 16384
    monkeypatch.setenv("PAGEDSERVE_MAX_N_SEQUENCES", "4")
    assert SamplingParams(n=4).n == 4
    with pytest.raises(ValueError, match=r"n must be at most 4 \(PAGEDSERVE_MAX_N_SEQUENCES\)"):
        SamplingParams(n=5)
    monkeypatch.setenv("PAGEDSERVE_MAX_N_SEQUENCES", "many")
    with pytest.raises(ValueError, match="PAGEDSERVE_MAX_N_SEQUENCES must be a positive"):
        SamplingParams()


def test_missing_and_unsupported_models(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="does not exist.*LlamaForCausalLM"):
        LLM(str(tmp_path / "nope"))
    folder = tmp_path / "weird"
    shutil.copytree(DEFAULT_MODEL, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        LLM(str(folder), device="cpu")
    with pytest.raises(ValueError, match="unknown LLM option"):
        LLM(DEFAULT_MODEL, not_an_option=1)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(DEFAULT_MODEL, max_model_len=4096, device="cpu")
    with pytest.raises(ValueError, match="needs 32"):
        LLM(DEFAULT_MODEL, num_gpu_blocks_override=4, device="cpu")


def test_chat_applies_template_once(tmp_path: Path) -> None:
    template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    llm = LLM(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory_bytes=4 << 20)
    out = llm.chat(
        [{"role": "user", "content": "Tell me a story"}],
        chat_template=template,
        sampling_params=SamplingParams(temperature=0, max_tokens=5),
        use_tqdm=False,
    )[0]
    tokenizer = llm.get_tokenizer()
    text = "<s>user: Tell me a story\nassistant:"
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert out.prompt_token_ids.count(tokenizer.bos_token_id) == 1


def test_stop_string_does_not_count_before_min_tokens(llm: LLM) -> None:
    base = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=40), use_tqdm=False
    )[0].outputs[0]
    first = base.text.index("Lily")  # "..., there was a little girl named Lily. She ..."
    params = SamplingParams(temperature=0, max_tokens=40, stop=["Lily"], min_tokens=30)
    out = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > 30 and len(out.text) > first + 4
    assert out.text.startswith(base.text[: first + 4])


def test_a_failed_step_leaves_the_engine_usable(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    executor = llm.llm_engine.engine_core.executor
    original = executor.execute_model
    calls = {"n": 0}

    def fail_on_third_step(scheduler_output):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected step failure")
        return original(scheduler_output)

    monkeypatch.setattr(executor, "execute_model", fail_on_third_step)
    with pytest.raises(RuntimeError, match="injected"):
        llm.generate(["Once upon a time", "The dog"], SamplingParams(max_tokens=8), use_tqdm=False)
    monkeypatch.setattr(executor, "execute_model", original)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.kv_cache.usage == 0.0
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 5


class _FakeProps:
    def __init__(self, name: str, gib: int) -> None:
        self.name, self.total_memory = name, gib << 30


@pytest.mark.parametrize(
    ("name", "gib", "usage_context", "expected"),
    [
        ("NVIDIA H200", 141, "llm_class", 16384),
        ("NVIDIA H100 80GB HBM3", 80, "llm_class", 16384),
        ("NVIDIA A100-SXM4-80GB", 80, "llm_class", 8192),  # vLLM: larger budgets slow A100
        ("NVIDIA L4", 24, "llm_class", 8192),
        ("NVIDIA H200", 141, "openai_api_server", 8192),
        ("NVIDIA H200", 141, "engine_context", 8192),
    ],
)
def test_default_token_budget_follows_vllm(
    monkeypatch: pytest.MonkeyPatch, name: str, gib: int, usage_context: str, expected: int
) -> None:
    from pagedserve.engine import arg_utils

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _FakeProps(name, gib))
    assert arg_utils.default_max_num_batched_tokens(usage_context, "auto") == expected
    assert arg_utils.default_max_num_batched_tokens(usage_context, "cpu") == 8192
    args = arg_utils.EngineArgs(max_num_seqs=20000)
    config = args.create_engine_config(usage_context)
    assert config.scheduler_config.max_num_batched_tokens == 20000  # never below max_num_seqs
    config = arg_utils.EngineArgs(max_num_batched_tokens=100).create_engine_config(usage_context)
    assert config.scheduler_config.max_num_batched_tokens == 100  # an explicit value wins
    with pytest.raises(ValueError, match="usage_context"):
        args.create_engine_config("server")


def test_llm_class_on_cpu_keeps_8192(llm: LLM) -> None:
    assert llm.llm_engine.config.scheduler_config.max_num_batched_tokens == 8192


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_num_batched_tokens": "8"}, "max_num_batched_tokens must be int or None"),
        ({"block_size": 16.0}, "block_size must be int"),
        ({"max_num_seqs": True}, "max_num_seqs must be int"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be bool"),
        ({"device": "meta"}, "device must be auto, cpu, cuda or cuda:N"),
        ({"max_model_len": 0}, "max_model_len must be positive"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be positive"),
        ({"kv_cache_memory_bytes": 10**18}, "does not fit on cpu"),
    ],
)
def test_engine_options_fail_at_start_naming_the_option(kwargs: dict, words: str) -> None:
    """Each was accepted (a 0 meant "default") or failed deep inside with a TypeError."""
    with pytest.raises(ValueError, match=words):
        LLM(device=kwargs.pop("device", "cpu"), **kwargs)


def test_a_path_object_names_the_model() -> None:
    llm = LLM(Path(DEFAULT_MODEL), device="cpu", kv_cache_memory_bytes=1 << 20)
    assert llm.generate("Once", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished


def test_megabyte_prompts_are_refused_before_tokenizing() -> None:
    """A 20 MB prompt used to be tokenized in full (17 s, +1.7 GB on the server) before the
    length check; no token is longer than the vocabulary's longest entry, so the character
    count alone proves it too long."""
    gpt2 = transformers.AutoTokenizer.from_pretrained(SHARED / "tokenizers" / "gpt2")
    bound = token_bound(gpt2)
    assert bound is not None and bound[0] >= 2
    longest = bound[0]
    processor = InputProcessor(gpt2, max_model_len=512, vocab_size=50257, eos_token_ids=())
    too_long = "ab" * (512 * longest)
    with pytest.raises(ValueError, match=r"\(\d+ characters\) is too long") as error:
        processor.process(too_long, SamplingParams(max_tokens=2))
    assert error.value.param == "prompt"  # type: ignore[attr-defined]
    # Under the bound the exact count decides, as before; a prompt to truncate may be long.
    with pytest.raises(ValueError, match=r"tokens\) is too long"):
        processor.process("ab " * 600, SamplingParams(max_tokens=2))  # 600 tokens
    kept = processor.process(too_long, SamplingParams(max_tokens=2, truncate_prompt_tokens=8))
    assert len(kept.prompt_token_ids) == 8


def test_a_run_of_unknown_characters_counts_as_one_token_in_the_bound() -> None:
    """A BPE with fuse_unk and no byte for a character (tinystories-656k) turns a run of
    unknown characters into one token: 40,000 CJK characters are a handful of tokens there,
    and must not be refused; known characters still count, so megabytes are refused."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(SHARED / "models" / "tinystories-656k")
    processor = InputProcessor(tokenizer, max_model_len=512, vocab_size=2048, eos_token_ids=())
    processed = processor.process("中" * 40000 + " Once", SamplingParams(max_tokens=2))
    assert len(processed.prompt_token_ids) < 20
    with pytest.raises(ValueError, match=r"characters\) is too long"):
        processor.process("hello " * 1_000_000, SamplingParams(max_tokens=2))


@pytest.mark.parametrize(
    ("prompts", "params", "words"),
    [
        (None, None, "prompts must be a string, a dict or a list"),
        (123, None, "got int"),
        (b"abc", None, "got bytes"),
        (["Once"], {"temperature": 0}, "sampling_params must be a SamplingParams or a list"),
        (["Once"], [None], "must be SamplingParams objects, got NoneType"),
    ],
)
def test_wrong_argument_types_are_value_errors(
    llm: LLM, prompts: object, params: object, words: str
) -> None:
    """They were TypeErrors from inside (`not iterable`, `replace() should be called on
    dataclass instances`), and bytes were iterated as ints."""
    with pytest.raises(ValueError, match=words):
        llm.generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    assert not llm.llm_engine.has_unfinished_requests()


def test_numbers_of_any_kind_and_iterables_are_accepted() -> None:
    """numpy scalars, 0/1 for flags, cpu:0 and generators all ran before the type checks and
    must keep running; they are normalised to Python's types."""
    import numpy as np

    llm = LLM(
        device="cpu:0", max_model_len=np.int64(256), seed=np.int64(3),
        gpu_memory_utilization=np.float32(0.5), enable_prefix_caching=0, enforce_eager=1,
        kv_cache_memory_bytes=np.int64(1 << 20),
    )  # fmt: skip
    config = llm.llm_engine.config
    assert type(config.model_config.max_model_len) is int
    assert config.cache_config.enable_prefix_caching is False
    prompts = (p for p in ["Once", "The dog"])
    params = (SamplingParams(max_tokens=2) for _ in range(2))
    assert len(llm.generate(prompts, params, use_tqdm=False)) == 2
    assert len(llm.generate(np.array(["Once", "Hi"]), use_tqdm=False)) == 2


def test_an_empty_max_n_sequences_variable_means_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_MAX_N_SEQUENCES", "")
    assert SamplingParams(n=16384).n == 16384


def test_logprob_tokens_are_spelled_in_context(llm: LLM) -> None:
    """Issue 13 item 3 offline: Logprob.decoded_token is the text the token adds (" there",
    not "there"), for sampled tokens, top alternatives and prompt tokens, as on the server."""
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=1
    )
    output = llm.generate("Once upon a time", params, use_tqdm=False)[0]
    completion = output.outputs[0]
    entries = completion.logprobs or []
    tokens = [
        entry[t].decoded_token for t, entry in zip(completion.token_ids, entries, strict=True)
    ]
    assert tokens == [",", " there", " was", " a", " little", " g", "ir", "l"]
    assert "".join(tokens) == completion.text  # type: ignore[arg-type]
    alternatives = [lp.decoded_token for entry in entries for lp in entry.values()]
    assert all(text is not None and "▁" not in text for text in alternatives)
    prompt = output.prompt_logprobs or []
    prompt_ids = output.prompt_token_ids
    assert prompt[0] is None
    texts = [entry[t].decoded_token for t, entry in zip(prompt_ids[1:], prompt[1:], strict=True)]  # type: ignore[index]
    assert texts == ["Once", " upon", " a", " time"]


def test_progress_bar_shows_input_and_output_speeds(
    llm: LLM, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's generate bar: "Processed prompts" with the finished requests' input and output
    tokens per second."""
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    llm.generate(["Once upon a time", "The dog"], params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    assert re.search(r"est\. speed input: [0-9.]+ toks/s, output: [0-9.]+ toks/s", err), err
    llm.generate(["Once upon a time"], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err
