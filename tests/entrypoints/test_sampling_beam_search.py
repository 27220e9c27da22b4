"""LLM.beam_search against transformers' beam search on a tiny random float32 model."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from pagedserve import LLM
from pagedserve.config import DEFAULT_MODEL
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import BeamSearchParams

TOKENIZER = Path(DEFAULT_MODEL)  # stories260k's: ids < 512
EOS_IDS = [268, 124]  # frequent tokens of this model: beams end early, at different lengths
PROMPTS = [
    [1, 50, 60, 70],
    [1, *range(200, 218)],  # longer than a block: beams share it through the prefix cache
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny_beam")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        initializer_range=0.1,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=EOS_IDS,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(TOKENIZER / name, path / name)
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == EOS_IDS
    return path


@pytest.fixture(scope="module")
def llm(model_path: Path) -> LLM:
    return LLM(
        str(model_path),
        dtype="float32",
        device="cpu",
        max_model_len=128,
        block_size=4,
        kv_cache_memory_bytes=4 << 20,
    )


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)


def hf_beam_search(
    model: transformers.PreTrainedModel,
    prompt: list[int],
    params: BeamSearchParams,
    eos_token_ids: list[int] | None,
) -> tuple[list[list[int]], list[float]]:
    """transformers' generated tokens and scores of the num_beams returned sequences."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        num_beams=params.beam_width,
        num_return_sequences=params.beam_width,
        length_penalty=params.length_penalty,
        early_stopping="never",
        max_new_tokens=params.max_tokens,
        eos_token_id=eos_token_ids,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_scores=True,
    )
    lengths = (out.beam_indices >= 0).sum(dim=-1).tolist()
    sequences = [
        out.sequences[i, len(prompt) : len(prompt) + n].tolist() for i, n in enumerate(lengths)
    ]
    return sequences, out.sequences_scores.tolist()


@pytest.mark.parametrize(
    ("beam_width", "length_penalty"), [(2, 1.0), (4, 0.0), (3, 2.0), (4, -1.0), (5, 1.0)]
)
def test_beam_search_equals_transformers(
    llm: LLM, hf_model: transformers.PreTrainedModel, beam_width: int, length_penalty: float
) -> None:
    params = BeamSearchParams(beam_width=beam_width, max_tokens=10, length_penalty=length_penalty)
    eos_token_ids = [*EOS_IDS, llm.get_tokenizer().eos_token_id]
    engine = llm.llm_engine
    hits_before = engine.kv_cache.num_hit_tokens
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    assert engine.kv_cache.num_hit_tokens > hits_before  # beams share their prefix's blocks
    assert not engine.has_unfinished_requests()
    engine.kv_cache.check_invariants()
    num_ended = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected, scores = hf_beam_search(hf_model, prompt, params, eos_token_ids)
        sequences = output.sequences
        assert [s.tokens[len(prompt) :] for s in sequences] == expected
        for sequence, score in zip(sequences, scores, strict=True):
            num_generated = len(sequence.tokens) - len(prompt)
            ours = sequence.cum_logprob / num_generated**length_penalty
            assert ours == pytest.approx(score, abs=1e-4)
            assert len(sequence.logprobs) == num_generated
            ended = sequence.tokens[-1] in eos_token_ids
            assert sequence.finish_reason == ("stop" if ended else "length")
            num_ended += ended
            assert sequence.text == llm.get_tokenizer().decode(sequence.tokens)
    if length_penalty <= 1.0:
        assert num_ended > 0  # the EOS path was exercised


def test_ignore_eos_runs_every_beam_to_max_tokens(
    llm: LLM, hf_model: transformers.PreTrainedModel
) -> None:
    params = BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True)
    outputs = llm.beam_search([{"prompt_token_ids": PROMPTS[1]}], params)
    expected, _ = hf_beam_search(hf_model, PROMPTS[1], params, None)
    assert [s.tokens[len(PROMPTS[1]) :] for s in outputs[0].sequences] == expected
    assert all(len(s.tokens) == len(PROMPTS[1]) + 8 for s in outputs[0].sequences)


def test_beam_width_needs_room_in_max_logprobs(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError, match=r"2 \* beam_width = 22.*max_logprobs \(20\)"):
        llm.beam_search(["Once"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(InvalidRequestError, match=r"BeamSearchParams\.beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)


def test_empty_prompts_are_treated_as_generate_treats_them(llm: LLM) -> None:
    """An empty text is the tokenizer's BOS alone (as vLLM); no token ids at all is refused."""
    params = BeamSearchParams(beam_width=2, max_tokens=2)
    outputs = llm.beam_search(["", {"prompt": ""}], params)
    assert all(s.tokens[0] == 1 and 1 < len(s.tokens) <= 3 for o in outputs for s in o.sequences)
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.beam_search([{"prompt_token_ids": []}], params)
