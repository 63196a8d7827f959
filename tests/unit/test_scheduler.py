"""Scheduler: token budget with chunked prefill, batch cap, FCFS, preemption, abort."""

import pytest

from kt_cli.engine.block_manager import BlockManager
from kt_cli.engine.sampling_params import SamplingParams
from kt_cli.engine.scheduler import Scheduler, SchedulerConfig
from kt_cli.engine.sequence import SequenceStatus, Sequence
from kt_cli.errors import KtError

BS = 4


def make(num_blocks=64, max_batch=4, max_step_tokens=16):
    manager = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(max_batch, max_step_tokens), manager), manager


def add(scheduler: Scheduler, n_tokens: int, name: str) -> Sequence:
    first = 1000 * (1 + len(scheduler.waiting) + len(scheduler.running))   # no accidental prefix hits
    s = Sequence(name, list(range(first, first + n_tokens)), SamplingParams(), BS)
    scheduler.add(s)
    return s


def step(scheduler: Scheduler, token: int = 7) -> list:
    """One engine step without a model: every sampling chunk gets `token` appended."""
    chunks = scheduler.schedule()
    scheduler.on_computed(chunks)
    for chunk in chunks:
        if chunk.samples:
            chunk.seq.append_token(token)
    return [(chunk.seq.request_id, chunk.num_tokens, chunk.samples) for chunk in chunks]


def test_long_prompt_is_chunked_and_decodes_keep_flowing():
    scheduler, _ = make(max_step_tokens=16)
    add(scheduler, 5, "short")
    assert step(scheduler) == [("short", 5, True)]
    add(scheduler, 40, "long")
    assert step(scheduler) == [("short", 1, True), ("long", 15, False)]
    assert step(scheduler) == [("short", 1, True), ("long", 15, False)]
    assert step(scheduler) == [("short", 1, True), ("long", 10, True)]
    assert step(scheduler) == [("short", 1, True), ("long", 1, True)]


def test_budget_is_never_exceeded():
    scheduler, _ = make(max_step_tokens=16, max_batch=8)
    for i, n in enumerate([3, 9, 30, 2, 17, 5]):
        add(scheduler, n, f"r{i}")
    for _ in range(20):
        assert sum(n for _, n, _ in step(scheduler)) <= 16


def test_batch_cap_and_fcfs_order():
    scheduler, _ = make(max_step_tokens=100, max_batch=2)
    for name in "abc":
        add(scheduler, 3, name)
    assert [r for r, _, _ in step(scheduler)] == ["a", "b"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    scheduler.finish(scheduler.running[0], "stop")
    assert [r for r, _, _ in step(scheduler)] == ["b", "c"]


def test_a_waiting_request_that_does_not_fit_blocks_those_behind_it():
    scheduler, _ = make(num_blocks=6, max_step_tokens=100)
    add(scheduler, 12, "a")
    add(scheduler, 20, "big")
    add(scheduler, 2, "small")
    assert [r for r, _, _ in step(scheduler)] == ["a"]


def test_preemption_frees_the_newest_and_requeues_it_first():
    scheduler, manager = make(num_blocks=6, max_step_tokens=100)
    old, new = add(scheduler, 11, "old"), add(scheduler, 11, "new")
    assert len(step(scheduler)) == 2                      # 3 blocks each, pool full
    assert manager.num_free_blocks == 0
    step(scheduler)                                       # both reach 12 tokens, still 3 blocks
    assert step(scheduler) == [("old", 1, True)]          # old needs a 4th block: new is preempted
    assert new.status == SequenceStatus.WAITING and new.block_table == [] and new.num_preemptions == 1
    assert list(scheduler.waiting) == [new]
    assert scheduler.num_preemptions == 1
    scheduler.finish(old, "stop")
    chunks = scheduler.schedule()
    assert [c.seq for c in chunks] == [new]
    # new's tail block went to old; its first two full blocks were still in the prefix cache
    assert new.num_computed == 8
    assert chunks[0].num_tokens == len(new) - 8


def test_a_lone_sequence_that_cannot_grow_preempts_itself():
    scheduler, manager = make(num_blocks=2, max_step_tokens=100)
    s = add(scheduler, 8, "a")
    step(scheduler)
    assert step(scheduler) == []
    assert s.status == SequenceStatus.WAITING and manager.num_free_blocks == 2


def test_finish_frees_blocks_of_running_and_waiting_sequences():
    scheduler, manager = make(max_step_tokens=8)
    running, waiting = add(scheduler, 20, "running"), add(scheduler, 3, "waiting")
    step(scheduler)
    assert manager.num_free_blocks < 64
    scheduler.finish(scheduler.find("running"), "abort")
    scheduler.finish(scheduler.find("waiting"), "abort")
    assert manager.num_free_blocks == 64
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert not scheduler.has_unfinished()


@pytest.mark.parametrize("bad", [dict(max_batch=0), dict(max_step_tokens=0), dict(max_batch="2")])
def test_config_is_validated(bad):
    with pytest.raises(KtError):
        SchedulerConfig(**bad)
