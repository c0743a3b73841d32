"""Seeded request workloads with a prefix structure, and their infinite-cache hit ratio.

A workload is a set of sessions played in rounds: round ``t`` sends turn ``t`` of every session
that has one (like the concurrent clients of SGLang's ``bench_multiturn``), and the serving
function returns each request's generated tokens before the next round starts. A session's
prompt for turn ``t`` is its history followed by that turn's new segment; whether the answer
is appended to the history depends on the workload:

* :func:`multiturn_chat` — N clients x M turns over one shared system prompt; each turn is the
  whole conversation so far plus a new question, and the answer is appended.
* :func:`document_qa` — many questions over a few long shared documents; each prompt is one
  document plus one question (answers are not carried over).
* :func:`agent_loop` — a few agents whose context grows every step by a tool observation and
  the model's own action.

Everything is numpy and pure Python; prompts depend only on the seed and the answers served.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Protocol

import numpy as np

from hicache_jax.validation import is_int

#: Token id 0 is never drawn, so a padded bucket of zeros cannot look like a prompt.
_LOW = 1

Serve = Callable[[list[np.ndarray]], Sequence[np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Session:
    """One client / document reader / agent.

    Attributes:
        base: int32 tokens every prompt of the session starts with (system prompt, document).
        segments: int32 tokens appended at each turn (question, observation).
        keep_answers: the answer of turn t becomes part of the history of turn t+1.
    """

    base: np.ndarray
    segments: tuple[np.ndarray, ...]
    keep_answers: bool


@dataclasses.dataclass(frozen=True)
class Request:
    """One prompt of a round: session index, turn index, int32 prompt tokens."""

    session: int
    turn: int
    prompt: np.ndarray


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named set of sessions played in rounds, with ``max_new_tokens`` per request."""

    name: str
    sessions: tuple[Session, ...]
    max_new_tokens: int

    @property
    def num_rounds(self) -> int:
        return max(len(s.segments) for s in self.sessions)

    @property
    def num_requests(self) -> int:
        return sum(len(s.segments) for s in self.sessions)

    def run(self, serve: Serve) -> list[tuple[Request, np.ndarray]]:
        """Play every round through ``serve`` (prompts -> generated tokens, same order).

        Returns:
            ``(request, output tokens)`` for every request, in the order served.

        Raises:
            ValueError: ``serve`` returned the wrong number of outputs.
        """
        history = [s.base.copy() for s in self.sessions]
        served: list[tuple[Request, np.ndarray]] = []
        for t in range(self.num_rounds):
            batch = [
                Request(i, t, np.concatenate([history[i], s.segments[t]]))
                for i, s in enumerate(self.sessions)
                if t < len(s.segments)
            ]
            outputs = serve([r.prompt for r in batch])
            if len(outputs) != len(batch):
                raise ValueError(f"serve returned {len(outputs)} outputs for {len(batch)} prompts")
            for req, out in zip(batch, outputs):
                out = np.asarray(out, np.int32)
                if self.sessions[req.session].keep_answers:
                    history[req.session] = np.concatenate([req.prompt, out])
                served.append((req, out))
        return served

    def placeholder_run(self) -> list[tuple[Request, np.ndarray]]:
        """A run whose answers are distinct placeholder tokens (ids >= 2**30, never in a prompt
        segment), for structure-only figures such as the infinite-cache hit ratio."""
        counter = iter(range(2**30, 2**31))

        def serve(prompts: list[np.ndarray]) -> list[np.ndarray]:
            return [
                np.fromiter(
                    (next(counter) for _ in range(self.max_new_tokens)),
                    np.int32,
                    count=self.max_new_tokens,
                )
                for _ in prompts
            ]

        return self.run(serve)

    def infinite_cache_hit_ratio(
        self, page_size: int = 1, served: list[tuple[Request, np.ndarray]] | None = None
    ) -> float:
        """Fraction of prompt tokens an unbounded page cache would serve from cache.

        Counted as the engine does: a prompt is matched on all but its last token (the last
        token is always computed, for its logits), only whole pages hit, and after each request
        the whole pages of prompt + answer minus its last token (whose K/V is never computed)
        are cached. Uses the given ``served`` run (real answers) or :meth:`placeholder_run`.
        """
        served = self.placeholder_run() if served is None else served
        cached: set[int] = set()
        hits = total = 0
        for req, out in served:
            hits += _match_pages(cached, req.prompt[:-1], page_size) * page_size
            total += len(req.prompt)
            _insert_pages(cached, np.concatenate([req.prompt, out])[:-1], page_size)
        return hits / total if total else 0.0

    def working_set_tokens(
        self, page_size: int = 1, served: list[tuple[Request, np.ndarray]] | None = None
    ) -> int:
        """Distinct tokens (whole pages) an unbounded cache ends up holding for the workload."""
        served = self.placeholder_run() if served is None else served
        cached: set[int] = set()
        for req, out in served:
            _insert_pages(cached, np.concatenate([req.prompt, out])[:-1], page_size)
        return len(cached) * page_size

    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt) for r, _ in self.placeholder_run())


def _page_keys(tokens: np.ndarray, page_size: int):
    """Chained hashes of the whole pages of tokens (hash of page i covers pages 0..i)."""
    h = 0
    for i in range(len(tokens) // page_size):
        h = hash((h, tokens[i * page_size : (i + 1) * page_size].tobytes()))
        yield h


def _match_pages(cached: set[int], tokens: np.ndarray, page_size: int) -> int:
    n = 0
    for key in _page_keys(np.asarray(tokens, np.int64), page_size):
        if key not in cached:
            break
        n += 1
    return n


def _insert_pages(cached: set[int], tokens: np.ndarray, page_size: int) -> None:
    cached.update(_page_keys(np.asarray(tokens, np.int64), page_size))


def _tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(_LOW, vocab_size, size=int(n), dtype=np.int32)


def _lengths(rng: np.random.Generator, mean: int, n: int) -> list[int]:
    """Lengths around ``mean`` (uniform in [mean/2, 3*mean/2]), at least 1."""
    lo, hi = max(1, mean // 2), max(1, mean + mean // 2)
    return [int(x) for x in rng.integers(lo, hi + 1, size=n)]


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} must be an int >= 1")


def multiturn_chat(
    *,
    num_clients: int = 8,
    num_turns: int = 4,
    system_tokens: int = 256,
    question_tokens: int = 48,
    max_new_tokens: int = 16,
    vocab_size: int = 512,
    seed: int = 0,
) -> Workload:
    """N clients x M turns sharing one system prompt (SGLang ``bench_multiturn`` shape).

    Turn t of client c: system prompt + every earlier question and answer + a new question of
    about ``question_tokens`` tokens (lengths vary by +-50%).
    """
    _check_sizes(
        num_clients=num_clients,
        num_turns=num_turns,
        system_tokens=system_tokens,
        question_tokens=question_tokens,
        max_new_tokens=max_new_tokens,
        vocab_size=vocab_size,
    )
    rng = np.random.default_rng(seed)
    system = _tokens(rng, system_tokens, vocab_size)
    sessions = tuple(
        Session(
            system,
            tuple(_tokens(rng, n, vocab_size) for n in _lengths(rng, question_tokens, num_turns)),
            True,
        )
        for _ in range(num_clients)
    )
    return Workload("chat", sessions, max_new_tokens)


def document_qa(
    *,
    num_documents: int = 2,
    questions_per_document: int = 8,
    document_tokens: int = 1024,
    question_tokens: int = 32,
    max_new_tokens: int = 8,
    vocab_size: int = 512,
    seed: int = 0,
) -> Workload:
    """Many questions over a few long documents: each prompt = one document + one question.

    Every question is its own one-turn session (answers are not carried over), and the
    questions arrive in a seeded random order over the documents, so the reuse distance of a
    document varies (a strict round robin would make LRU thrash whenever the pool holds fewer
    documents than there are).
    """
    _check_sizes(
        num_documents=num_documents,
        questions_per_document=questions_per_document,
        document_tokens=document_tokens,
        question_tokens=question_tokens,
        max_new_tokens=max_new_tokens,
        vocab_size=vocab_size,
    )
    rng = np.random.default_rng(seed)
    docs = [_tokens(rng, document_tokens, vocab_size) for _ in range(num_documents)]
    sessions = [
        Session(doc, (_tokens(rng, n, vocab_size),), False)
        for doc in docs
        for n in _lengths(rng, question_tokens, questions_per_document)
    ]
    order = rng.permutation(len(sessions))
    return Workload("docqa", tuple(sessions[i] for i in order), max_new_tokens)


def agent_loop(
    *,
    num_agents: int = 2,
    num_steps: int = 12,
    prompt_tokens: int = 256,
    observation_tokens: int = 96,
    max_new_tokens: int = 16,
    vocab_size: int = 512,
    seed: int = 0,
) -> Workload:
    """Agents whose context grows every step by a tool observation and their own action.

    Each agent starts from its own task prompt (agents share nothing); step t's prompt is the
    whole trajectory so far plus a new observation of about ``observation_tokens`` tokens.
    """
    _check_sizes(
        num_agents=num_agents,
        num_steps=num_steps,
        prompt_tokens=prompt_tokens,
        observation_tokens=observation_tokens,
        max_new_tokens=max_new_tokens,
        vocab_size=vocab_size,
    )
    rng = np.random.default_rng(seed)
    sessions = tuple(
        Session(
            _tokens(rng, prompt_tokens, vocab_size),
            tuple(
                _tokens(rng, n, vocab_size) for n in _lengths(rng, observation_tokens, num_steps)
            ),
            True,
        )
        for _ in range(num_agents)
    )
    return Workload("agent", sessions, max_new_tokens)


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "chat": multiturn_chat,
    "docqa": document_qa,
    "agent": agent_loop,
}


# ---------------------------------------------------------------------------------------------
# Arrival processes for the batched engine (``BatchedEngine.serve``): each gives the requests
# that arrive at the start and those that a finished request lets arrive.


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A request arriving ``at`` seconds after the start of the run; ``key`` names it."""

    at: float
    key: tuple
    prompt: np.ndarray
    max_new_tokens: int


class ArrivalProcess(Protocol):
    """Where ``BatchedEngine.serve`` gets its requests (:class:`ClosedLoop`,
    :class:`PoissonArrivals`, :class:`TraceArrivals`): those arriving at the start, and those a
    finished request lets arrive (a client's next turn)."""

    def initial(self) -> Iterable[Arrival]: ...

    def on_done(self, key: Hashable, tokens: np.ndarray, now: float) -> Iterable[Arrival]: ...


class ClosedLoop:
    """Multi-turn clients (SGLang ``bench_multiturn``): every session sends turn 0 at the start
    and turn t+1 as soon as the answer of turn t is back (``think_s`` later). Keys are
    ``(session, turn)``; prompts equal those of :meth:`Workload.run` for the same answers."""

    def __init__(self, workload: Workload, think_s: float = 0.0) -> None:
        if not (np.isfinite(think_s) and think_s >= 0):
            raise ValueError(f"think_s={think_s!r} must be a finite number >= 0")
        self.workload, self.think_s = workload, float(think_s)
        self._history = [s.base for s in workload.sessions]
        self._prompts: dict[tuple, np.ndarray] = {}  # (session, turn) -> prompt sent

    def _turn(self, i: int, t: int, at: float) -> Arrival:
        prompt = np.concatenate([self._history[i], self.workload.sessions[i].segments[t]])
        self._prompts[(i, t)] = prompt
        return Arrival(at, (i, t), prompt, self.workload.max_new_tokens)

    def initial(self) -> list[Arrival]:
        self._history = [s.base for s in self.workload.sessions]
        self._prompts = {}
        return [self._turn(i, 0, 0.0) for i in range(len(self.workload.sessions))]

    def on_done(self, key: tuple, tokens: np.ndarray, now: float) -> list[Arrival]:
        i, t = key
        session = self.workload.sessions[i]
        if session.keep_answers:
            self._history[i] = np.concatenate([self._prompts[(i, t)], np.asarray(tokens, np.int32)])
        if t + 1 >= len(session.segments):
            return []
        return [self._turn(i, t + 1, self._arrive(i, t + 1, now))]

    def _arrive(self, i: int, t: int, now: float) -> float:
        return now + self.think_s


class PoissonArrivals(ClosedLoop):
    """Open-loop arrivals at ``rate`` requests/s (exponential gaps, seeded): the k-th arrival
    time goes to the k-th request in round order; a turn whose previous answer is not back by
    then is sent when it is (its prompt needs the answer)."""

    def __init__(self, workload: Workload, rate: float, seed: int = 0) -> None:
        if not (np.isfinite(rate) and rate > 0):
            raise ValueError(f"rate={rate!r} must be a finite number > 0 (requests/s)")
        super().__init__(workload)
        self.rate = float(rate)
        order = [
            (i, t)
            for t in range(workload.num_rounds)
            for i, s in enumerate(workload.sessions)
            if t < len(s.segments)
        ]
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(order))
        self.schedule = dict(zip(order, np.cumsum(gaps) - gaps[0]))

    def initial(self) -> list[Arrival]:
        first = super().initial()
        return [dataclasses.replace(a, at=float(self.schedule[a.key])) for a in first]

    def _arrive(self, i: int, t: int, now: float) -> float:
        return max(now, float(self.schedule[(i, t)]))


class TraceArrivals:
    """The timestamps of a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids``), scaled: request i arrives at ``timestamp * time_scale``
    and its prompt is ``input_length * block_tokens / block_size`` tokens, ``block_tokens``
    seeded tokens per hash id (equal ids, equal tokens: the trace's prefix sharing).
    ``max_new_tokens`` caps ``output_length``. Keys are ``(line index,)``."""

    def __init__(
        self,
        path: str,
        *,
        time_scale: float = 1.0,
        block_tokens: int = 16,
        block_size: int = 512,
        max_new_tokens: int = 16,
        vocab_size: int = 512,
        limit: int | None = None,
        seed: int = 0,
    ) -> None:
        import json

        _check_sizes(
            block_tokens=block_tokens,
            block_size=block_size,
            max_new_tokens=max_new_tokens,
            vocab_size=vocab_size,
        )
        if not (np.isfinite(time_scale) and time_scale >= 0):
            raise ValueError(f"time_scale={time_scale!r} must be a finite number >= 0")
        if limit is not None:
            _check_sizes(limit=limit)
        self.arrivals: list[Arrival] = []
        blocks: dict[int, np.ndarray] = {}
        with open(path) as f:
            for lineno, text in enumerate(f, 1):
                if limit is not None and len(self.arrivals) >= limit:
                    break
                if not text.strip():
                    continue
                try:
                    rec = json.loads(text)
                    ids = [int(h) for h in rec["hash_ids"]]
                    n = max(1, -(-int(rec["input_length"]) * block_tokens // block_size))
                    at = float(rec.get("timestamp", 0)) / 1e3 * time_scale
                    out = max(1, min(max_new_tokens, int(rec.get("output_length", 1))))
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"{path}, line {lineno}: not a Mooncake record ({exc!r})"
                    ) from None
                if not ids:
                    raise ValueError(f"{path}, line {lineno}: empty hash_ids")
                for h in ids:
                    if h not in blocks:
                        blocks[h] = _tokens(
                            np.random.default_rng([seed, h & 0x7FFFFFFF]), block_tokens, vocab_size
                        )
                prompt = np.concatenate([blocks[h] for h in ids])[:n]
                self.arrivals.append(Arrival(at, (len(self.arrivals),), prompt, out))
        if not self.arrivals:
            raise ValueError(f"{path}: no requests in the trace")

    def initial(self) -> list[Arrival]:
        return list(self.arrivals)

    def on_done(self, key: tuple, tokens: np.ndarray, now: float) -> list[Arrival]:
        return []


ARRIVALS = ("closed", "poisson", "trace")
