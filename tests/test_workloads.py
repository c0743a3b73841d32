"""Workload generators: determinism, prompt structure per workload, infinite-cache hit ratio;
arrival processes (closed loop, Poisson, Mooncake trace timestamps)."""

import itertools
import os

import numpy as np
import pytest

from hicache_jax.engine.workloads import (
    WORKLOADS,
    ClosedLoop,
    PoissonArrivals,
    Session,
    TraceArrivals,
    Workload,
    agent_loop,
    document_qa,
    multiturn_chat,
)


def _echo(prompts):
    """Answers derived from the prompt, so a run is deterministic and answer-dependent."""
    return [np.array([len(p) % 7 + 1, 3], np.int32) for p in prompts]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_seeded_and_deterministic(name):
    a, b, c = WORKLOADS[name](seed=1), WORKLOADS[name](seed=1), WORKLOADS[name](seed=2)
    ra, rb, rc = a.run(_echo), b.run(_echo), c.run(_echo)
    assert all(np.array_equal(x.prompt, y.prompt) for (x, _), (y, _) in zip(ra, rb))
    assert not all(np.array_equal(x.prompt, y.prompt) for (x, _), (y, _) in zip(ra, rc))
    for req, _ in ra:
        assert req.prompt.dtype == np.int32 and req.prompt.min() >= 1


def test_chat_prompt_is_history_plus_answer_plus_question():
    wl = multiturn_chat(
        num_clients=3,
        num_turns=3,
        system_tokens=20,
        question_tokens=6,
        max_new_tokens=2,
        vocab_size=50,
    )
    served = wl.run(_echo)
    assert [(r.session, r.turn) for r, _ in served] == [(s, t) for t in range(3) for s in range(3)]
    system = served[0][0].prompt[:20]
    by_session = {}
    for req, out in served:
        np.testing.assert_array_equal(req.prompt[:20], system)  # shared system prompt
        if req.session in by_session:
            prev = by_session[req.session]
            np.testing.assert_array_equal(req.prompt[: len(prev)], prev)
        by_session[req.session] = np.concatenate([req.prompt, out])


def test_docqa_prompts_are_document_plus_question():
    wl = document_qa(
        num_documents=2,
        questions_per_document=3,
        document_tokens=30,
        question_tokens=4,
        vocab_size=50,
    )
    served = wl.run(_echo)
    assert wl.num_rounds == 1 and len(served) == 6
    docs = {r.prompt[:30].tobytes() for r, _ in served}
    assert len(docs) == 2  # answers are not carried over: every prompt starts with a document


def test_agent_context_grows_every_step():
    wl = agent_loop(
        num_agents=2,
        num_steps=4,
        prompt_tokens=10,
        observation_tokens=5,
        max_new_tokens=3,
        vocab_size=50,
    )
    lengths = {}
    for req, _out in wl.run(_echo):
        lengths.setdefault(req.session, []).append(len(req.prompt))
    for seq in lengths.values():
        assert all(b > a + 3 for a, b in itertools.pairwise(seq))


def test_infinite_cache_hit_ratio_by_hand():
    # One session, two turns, page 1: turn 1 matches turn 0's prompt + answer minus its last
    # token (whose K/V is never computed); the last prompt token is never matched.
    base = np.array([5, 6, 7, 8], np.int32)
    wl = Workload(
        "t",
        (Session(base, (np.array([9], np.int32), np.array([10, 11], np.int32)), True),),
        max_new_tokens=2,
    )
    served = wl.run(lambda ps: [np.array([20, 21], np.int32)])
    # prompts: [5 6 7 8 9] (5 tokens, 0 hit), [5 6 7 8 9 20 21 10 11] (9 tokens; cached
    # 5 6 7 8 9 20 -> 6 hit)
    assert wl.infinite_cache_hit_ratio(1, served) == pytest.approx(6 / 14)
    assert wl.infinite_cache_hit_ratio(4, served) == pytest.approx(4 / 14)
    assert wl.working_set_tokens(1, served) == 6 + 4  # distinct token prefixes cached


def test_placeholder_ratio_close_to_real_answers():
    wl = multiturn_chat(
        num_clients=2,
        num_turns=3,
        system_tokens=32,
        question_tokens=8,
        max_new_tokens=4,
        vocab_size=64,
    )
    real = wl.run(lambda ps: [np.arange(1, 5, dtype=np.int32) + len(p) for p in ps])
    assert wl.infinite_cache_hit_ratio(1, real) == pytest.approx(wl.infinite_cache_hit_ratio(1))
    assert 0.4 < wl.infinite_cache_hit_ratio(16) <= wl.infinite_cache_hit_ratio(1) < 1


def test_bad_sizes_and_serve():
    with pytest.raises(ValueError, match="num_clients=0"):
        multiturn_chat(num_clients=0)
    with pytest.raises(ValueError, match="document_tokens"):
        document_qa(document_tokens=-1)
    with pytest.raises(ValueError, match="num_steps=True"):
        agent_loop(num_steps=True)
    wl = multiturn_chat(num_clients=2, num_turns=1)
    with pytest.raises(ValueError, match="1 outputs for 2 prompts"):
        wl.run(lambda ps: ps[:1])


# -- arrival processes (BatchedEngine.serve) ---------------------------------------------------


def _play(process, answer):
    """Drive an arrival process as the engine does, answering at once (time = arrival)."""
    import heapq

    heap = [(a.at, a.key, a) for a in process.initial()]
    heapq.heapify(heap)
    served = []
    while heap:
        at, _, a = heapq.heappop(heap)
        out = answer(a.prompt)
        served.append((a, out))
        for b in process.on_done(a.key, out, at + 0.5):
            heapq.heappush(heap, (b.at, b.key, b))
    return served


def test_closed_loop_prompts_equal_the_rounds():
    wl = multiturn_chat(
        num_clients=3,
        num_turns=3,
        system_tokens=20,
        question_tokens=6,
        max_new_tokens=2,
        vocab_size=50,
    )
    rounds = {(r.session, r.turn): r.prompt for r, _ in wl.run(_echo)}
    served = _play(ClosedLoop(wl), lambda p: _echo([p])[0])
    assert {a.key for a, _ in served} == set(rounds)
    for a, _ in served:
        np.testing.assert_array_equal(a.prompt, rounds[a.key])
        assert a.max_new_tokens == 2
    # turn t+1 of a client arrives when its answer to turn t is back (0.5 s later here)
    at = {a.key: a.at for a, _ in served}
    assert all(at[(i, t + 1)] == at[(i, t)] + 0.5 for i in range(3) for t in range(2))


def test_poisson_schedule_respects_answers():
    wl = multiturn_chat(
        num_clients=2,
        num_turns=3,
        system_tokens=8,
        question_tokens=4,
        max_new_tokens=2,
        vocab_size=50,
    )
    p = PoissonArrivals(wl, rate=100.0, seed=3)
    again = PoissonArrivals(wl, rate=100.0, seed=3)
    assert p.schedule == again.schedule and min(p.schedule.values()) == 0.0
    gaps = np.diff(sorted(p.schedule.values()))
    assert 0.001 < gaps.mean() < 0.05  # about 1 / rate
    served = _play(p, lambda prompt: _echo([prompt])[0])
    at = {a.key: a.at for a, _ in served}
    for (i, t), when in at.items():
        assert when >= p.schedule[(i, t)]
        if t:
            assert when >= at[(i, t - 1)] + 0.5  # never before the previous answer is back
    with pytest.raises(ValueError, match="rate=0"):
        PoissonArrivals(wl, rate=0)


def test_trace_arrivals_scale_time_and_share_blocks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 30, '
        '"hash_ids": [1, 2]}\n\n'
        '{"timestamp": 2000, "input_length": 1000, "output_length": 2, '
        '"hash_ids": [1, 3]}\n'
    )
    tr = TraceArrivals(str(path), time_scale=0.5, block_tokens=8, max_new_tokens=4, vocab_size=50)
    a, b = tr.initial()
    assert (a.at, b.at) == (0.0, 1.0) and (a.max_new_tokens, b.max_new_tokens) == (4, 2)
    assert a.prompt.size == 16 and b.prompt.size == 16  # 1000 * 8 / 512 rounds up to 16
    np.testing.assert_array_equal(a.prompt[:8], b.prompt[:8])  # hash id 1: same tokens
    assert not np.array_equal(a.prompt[8:], b.prompt[8:])
    assert tr.on_done(a.key, np.zeros(2, np.int32), 0.0) == []
    shipped = os.path.join(
        os.path.dirname(__file__), "..", "benchmarks", "data", "mooncake_synthetic_1000.jsonl"
    )
    assert len(TraceArrivals(shipped, limit=5).initial()) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(ValueError, match="line 1: not a Mooncake record"):
        TraceArrivals(str(bad))
