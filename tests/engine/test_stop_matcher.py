"""Stop strings: the automaton against a naive reference, the limits (issue 13, item 12)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import SamplingParams
from pagedserve.engine.stop_matcher import AutomatonCache, StopMatcher, stop_automaton


def naive_match(text: str, num_chars_before: int, stop: list[str]) -> tuple[int, int] | None:
    """The stop string that starts earliest among those ending after `num_chars_before`,
    the first in `stop` on a tie (the rule of the former per-string str.find loop)."""
    best = None
    for index, stop_str in enumerate(stop):
        position = text.find(stop_str, max(num_chars_before - len(stop_str) + 1, 0))
        if position != -1 and (best is None or position < best[0]):
            best = (position, index)
    return best


def run_both(
    chunks: list[str], stop: list[str], num_silent: int
) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
    """Feed `chunks` one by one, the first `num_silent` without reporting (min_tokens); the
    first match found by the automaton and by the reference."""
    matcher = StopMatcher(stop)
    text = ""
    for i, chunk in enumerate(chunks):
        before, text = len(text), text + chunk
        report = i >= num_silent
        found = matcher.feed(chunk, report=report)
        expected = naive_match(text, before, stop) if report and chunk else None
        if found is not None or expected is not None:
            return found, expected
    return None, None


@settings(max_examples=400, deadline=None)
@given(
    chunks=st.lists(st.text(alphabet="abc", max_size=6), max_size=12),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=5), min_size=1, max_size=8),
    num_silent=st.integers(0, 4),
)
def test_automaton_finds_the_same_stop_as_the_reference(
    chunks: list[str], stop: list[str], num_silent: int
) -> None:
    found, expected = run_both(chunks, stop, num_silent)
    assert found == expected


@pytest.mark.parametrize(
    ("chunks", "stop", "expected"),
    [
        (["xxabcd"], ["cd", "abc"], (2, 1)),  # the earliest start wins, not the earliest end
        (["xab"], ["ab", "a", "xab"], (0, 2)),
        (["xxab"], ["ab", "abc"], (2, 0)),  # a tie: the first in the list
        (["a", "b", "c"], ["abc"], (0, 0)),  # spanning three chunks
        (["aaa", "b"], ["aab", "ab"], (1, 0)),  # starts in earlier text
        (["ab", "ab"], ["ab", "ab"], (0, 0)),  # duplicates: the first index
    ],
)
def test_examples(chunks: list[str], stop: list[str], expected: tuple[int, int]) -> None:
    found, reference = run_both(chunks, stop, 0)
    assert found == reference == expected


def test_one_automaton_per_distinct_stop_list() -> None:
    stop_automaton.cache_clear()
    StopMatcher(["x", "yz"])
    StopMatcher(["x", "yz"])
    assert stop_automaton.cache_info().misses == 1


def test_the_automaton_cache_is_bounded_by_states_not_lists() -> None:
    """Distinct stop lists of the largest size allowed (128 strings, 8192 characters: about
    2 MiB of automaton each) must not pile up: 256 of them once kept 0.5 GB alive."""
    stop_automaton.cache_clear()
    for i in range(12):
        StopMatcher([f"{i:04d}{j:03d}{'x' * 57}" for j in range(128)])
    info = stop_automaton.cache_info()
    assert info.misses == 12
    assert 0 < info.num_states <= stop_automaton.max_states
    assert info.currsize < 12  # the oldest were evicted
    # Least recently used out; an automaton bigger than the budget is built, not cached.
    cache = AutomatonCache(max_states=10)
    first, second = cache(("abcd",)), cache(("efgh",))  # 5 states each
    assert cache(("abcd",)) is first and cache.cache_info().num_states == 10
    cache(("ijkl",))
    assert cache(("abcd",)) is first and cache(("efgh",)) is not second
    assert cache(("a" * 20,)).num_states == 21 and cache.cache_info().num_states <= 10


def test_the_limit_is_the_longest_match_not_the_number_of_strings() -> None:
    """128 stop strings of 64 characters that all share one prefix: every character is a step
    in one automaton, not 128 searches."""
    stop = [f"{'a' * 56}{i:08d}" for i in range(128)]
    matcher = StopMatcher(stop)
    assert matcher.feed("a" * 10_000) is None
    assert matcher.feed(f"{'a' * 56}00000127") == (10_000, 127)


def test_stop_limits_name_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 100,000 stop strings of the report are refused at once, naming the limit."""
    with pytest.raises(ValueError, match=r"stop must hold at most 128 strings.*got 100000"):
        SamplingParams(stop=[f"s{i}" for i in range(100_000)])
    assert len(SamplingParams(stop=[f"s{i}" for i in range(128)]).stop_strings) == 128
    with pytest.raises(ValueError, match=r"at most 8192 characters .*STOP_STRING_CHARS.*8193"):
        SamplingParams(stop=["a" * 8000, "b" * 193])
    monkeypatch.setenv("PAGEDSERVE_MAX_STOP_STRINGS", "2")
    monkeypatch.setenv("PAGEDSERVE_MAX_STOP_STRING_CHARS", "10")
    SamplingParams(stop=["abcde", "fghij"])
    with pytest.raises(ValueError, match=r"at most 2 strings \(PAGEDSERVE_MAX_STOP_STRINGS\)"):
        SamplingParams(stop=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"at most 10 characters"):
        SamplingParams(stop=["abcdef", "ghijk"])
    monkeypatch.setenv("PAGEDSERVE_MAX_STOP_STRINGS", "none")
    with pytest.raises(ValueError, match="PAGEDSERVE_MAX_STOP_STRINGS must be a positive"):
        SamplingParams()
