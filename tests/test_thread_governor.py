"""specdecode.engine.threads.ThreadGovernor: fewer compute threads while other processes keep the
cores busy (libgomp's barriers make a region as slow as its slowest thread), the thread count back
when they stop, and no change to a batch-invariant target's tokens."""

import itertools

import pytest
import torch

from helpers import PROMPT
from specdecode import native
from specdecode.engine.driver import Driver, run
from specdecode.engine.engine import Engine
from specdecode.engine.request import DecodeConfig, Request
from specdecode.engine.threads import ThreadGovernor
from specdecode.proposers import DraftModelProposer
from specdecode.sampling import SamplingParams


class Load:
    """Other processes' cores, as the governor's `others` reads them, and a clock moved by hand."""

    def __init__(self):
        self.cores, self.now = 0.0, 0.0

    def others(self) -> float:
        return self.cores

    def clock(self) -> float:
        return self.now


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_follow_the_cores_others_leave(threads):
    load = Load()
    torch.set_num_threads(4)
    governor = ThreadGovernor(max_threads=4, cores=4, interval=1.0, others=load.others, clock=load.clock)
    steps = [(0.0, 0.3, 4), (1.0, 1.2, 3), (0.5, 2.0, 3),  # a tick within the interval changes nothing
             (0.5, 2.0, 2), (1.0, 3.8, 1), (1.0, 9.0, 1),  # never below 1
             (1.0, 0.4, 4)]                                # back to the cap once they stop
    for advance, cores, expected in steps:
        load.now += advance
        load.cores = cores
        governor.tick()
        assert torch.get_num_threads() == expected, (load.now, cores)
    assert governor.changes == 4


def test_never_above_the_cap_and_a_cap_of_one_stays(threads):
    load = Load()
    governor = ThreadGovernor(max_threads=2, cores=8, interval=0.5, others=load.others, clock=load.clock)
    for cores in (0.0, 5.0, 7.0, 0.0):
        load.now += 1
        load.cores = cores
        governor.tick()
        assert torch.get_num_threads() == (2 if cores <= 6 else 1)
    torch.set_num_threads(1)
    single = ThreadGovernor(max_threads=1, cores=2, interval=0.5, others=load.others, clock=load.clock)
    load.now += 1
    single.tick()
    assert torch.get_num_threads() == 1 and single.changes == 0


def test_while_a_governor_computes_on_fewer_threads_the_machine_is_still_planned_for_the_count_asked(threads):
    # a second decoder built then (its prior, its choice's key, its own governor's cap) must see
    # the count the user asked for, not the one other processes' load left for a moment
    from specdecode.engine.threads import requested_threads
    from specdecode.tune.hardware import cpu_report

    load = Load()
    torch.set_num_threads(2)
    governor = ThreadGovernor(cores=2, interval=0.5, others=load.others, clock=load.clock)
    load.now, load.cores = 1.0, 1.2
    governor.tick()
    assert torch.get_num_threads() == 1
    assert requested_threads() == 2 and cpu_report()["threads"] == 2
    assert ThreadGovernor(cores=2, others=load.others, clock=load.clock).max_threads == 2
    governor.release()  # the engine is idle: the application's torch gets its count back
    assert torch.get_num_threads() == 2 == requested_threads()
    load.now += 1
    governor.tick()
    torch.set_num_threads(3)  # the user asks again: that count it is
    assert requested_threads() == 3


def test_the_default_reads_this_machines_counters(threads):
    governor = ThreadGovernor()
    assert 1 <= governor.max_threads == torch.get_num_threads()
    governor.tick()  # reads /proc/stat where it exists; never raises
    assert 1 <= torch.get_num_threads() <= governor.max_threads


@pytest.mark.skipif(not native.available(), reason="no C++ compiler for specdecode.native")
def test_a_batch_invariant_target_gives_the_same_tokens_whatever_the_thread_count(threads):
    """The engine ticks its governor every step; on the batch-invariant kernels the thread count
    changes no bit, so output stays plain greedy's while the count changes every step."""
    from test_invariant import MODELS, invariant_backend
    from specdecode.models import HFCausalLM

    model = MODELS["qwen2"]()
    target, draft = invariant_backend(model), HFCausalLM(model, lean=True)
    config = DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0), num_speculative_tokens=4)
    torch.set_num_threads(2)
    plain = run(target, None, PROMPT, DecodeConfig(max_new_tokens=40, sampling=SamplingParams(temperature=0)))
    ticks = []

    def busy() -> float:  # one look in two: 1.5 cores taken, then none
        ticks.append(len(ticks) % 2 * 1.5)
        return ticks[-1]

    governor = ThreadGovernor(max_threads=2, cores=2, interval=0.5, others=busy, clock=itertools.count().__next__)  # every tick looks
    driver = Driver(Engine(target, DraftModelProposer(draft), threads=governor))
    spec = driver.result(driver.submit(Request(PROMPT, config)))
    assert spec.token_ids == plain.token_ids
    assert governor.changes >= 4
