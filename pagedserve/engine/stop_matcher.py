"""Stop-string matching with one Aho-Corasick automaton per stop list.

Each generated character costs O(1) amortised, however many stop strings a request has: the
automaton is built once per distinct stop list (cached) and fed only the new characters.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import NamedTuple


class StopAutomaton:
    """An Aho-Corasick automaton over a tuple of stop strings; immutable, shared by requests.

    States are ints (0 is the root, the empty string); state s stands for the string spelled
    from the root, which is the longest suffix of the text read so far that is a prefix of
    some stop string. `longest[s]` is (length, index in the stop tuple) of the longest stop
    string that is a suffix of that string (the earliest-starting match ending at the current
    character), or None; of duplicate stop strings the first index is kept.
    """

    __slots__ = ("_goto", "_fail", "longest")

    def __init__(self, stop: tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        terminal: list[tuple[int, int] | None] = [None]
        for index, stop_str in enumerate(stop):
            state = 0
            for char in stop_str:
                child = goto[state].get(char)
                if child is None:
                    child = len(goto)
                    goto[state][char] = child
                    goto.append({})
                    terminal.append(None)
                state = child
            if terminal[state] is None:
                terminal[state] = (len(stop_str), index)
        fail = [0] * len(goto)
        longest = list(terminal)
        queue = list(goto[0].values())  # breadth first: a state's fail state comes before it
        for state in queue:
            for char, child in goto[state].items():
                target = fail[state]
                while target and char not in goto[target]:
                    target = fail[target]
                fail[child] = goto[target].get(char, 0)  # a shallower state: not child
                # Terminal here: the whole state string, the longest suffix there is.
                longest[child] = terminal[child] or longest[fail[child]]
                queue.append(child)
        self._goto = goto
        self._fail = fail
        self.longest = longest

    @property
    def num_states(self) -> int:
        """Its number of states (one per distinct prefix of the stop strings, and the root)."""
        return len(self._goto)

    def step(self, state: int, char: str) -> int:
        """The state after reading `char` in `state`."""
        goto, fail = self._goto, self._fail
        while True:
            child = goto[state].get(char)
            if child is not None:
                return child
            if state == 0:
                return 0
            state = fail[state]


class CacheInfo(NamedTuple):
    """Counters of an AutomatonCache, as functools' `cache_info()`; `num_states` is the sum of
    the cached automata's states (their memory: about 230 bytes a state)."""

    hits: int
    misses: int
    currsize: int
    num_states: int


class AutomatonCache:
    """The automata of recent stop lists, least recently used first out, bounded by their
    total number of states (not their number): one automaton of the largest stop list allowed
    (8192 characters) holds about 2 MiB, so 256 of them, distinct lists sent by clients, would
    keep 0.5 GB alive. An automaton bigger than the whole budget is built and not cached.
    Thread-safe (LLM instances may run in several threads)."""

    def __init__(self, max_states: int) -> None:
        self.max_states = max_states
        self._entries: OrderedDict[tuple[str, ...], StopAutomaton] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._num_states = 0

    def __call__(self, stop: tuple[str, ...]) -> StopAutomaton:
        """The automaton of `stop`, built once while it stays cached."""
        with self._lock:
            automaton = self._entries.get(stop)
            if automaton is not None:
                self._hits += 1
                self._entries.move_to_end(stop)
                return automaton
            self._misses += 1
        automaton = StopAutomaton(stop)  # outside the lock: building may take milliseconds
        num_states = automaton.num_states
        with self._lock:
            if num_states <= self.max_states and stop not in self._entries:
                self._entries[stop] = automaton
                self._num_states += num_states
                while self._num_states > self.max_states:
                    _, evicted = self._entries.popitem(last=False)
                    self._num_states -= evicted.num_states
        return automaton

    def cache_info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self._hits, self._misses, len(self._entries), self._num_states)

    def cache_clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._hits = self._misses = self._num_states = 0


# The automaton of a stop list, built once per distinct list (requests of one client usually
# repeat theirs). 65,536 states: about 15 MiB, eight automata of the largest stop lists allowed.
stop_automaton = AutomatonCache(max_states=1 << 16)


class StopMatcher:
    """Finds stop strings in a text that grows at its end (one request's output).

    `feed(new_text)` returns the match that starts earliest among those ending in `new_text`,
    the first in `stop` on a tie, as (start, index in `stop`); `start` counts characters from
    the beginning of everything fed. Matches may start in earlier text. After a match the
    text is over (the request stops there): feed nothing more.
    """

    def __init__(self, stop: list[str]) -> None:
        if any(not stop_str for stop_str in stop):
            raise ValueError(f"stop strings must not be empty, got {stop!r}")
        self._automaton = stop_automaton(tuple(stop))
        self._max_len = max((len(stop_str) for stop_str in stop), default=0)
        self._state = 0
        self._num_fed = 0  # characters fed so far

    def feed(self, new_text: str, report: bool = True) -> tuple[int, int] | None:
        """Read `new_text`; return the earliest-starting match ending in it (see the class),
        or None. With `report=False` the text is only read (stop strings do not count yet,
        e.g. before min_tokens), so that later matches may start in it."""
        automaton, longest = self._automaton, self._automaton.longest
        state, end = self._state, self._num_fed
        best: tuple[int, int] | None = None
        for char in new_text:
            state = automaton.step(state, char)
            end += 1
            match = longest[state]
            if report and match is not None:
                candidate = (end - match[0], match[1])
                if best is None or candidate < best:
                    best = candidate
            if best is not None and end - self._max_len > best[0]:
                break  # no match ending later can start as early
        self._state, self._num_fed = state, self._num_fed + len(new_text)
        return best
