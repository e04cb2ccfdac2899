"""Which decode step is launched ahead (Scheduler.reserve_next_decode, app/engine/run_ahead.py),
and when the engine takes it: the rules on host state alone, with a stand-in for the tokens
drawn on the device."""

from app.engine.config import EngineConfig
from app.engine.kv_cache import BlockAllocator
from app.engine.run_ahead import DecodeAhead
from app.engine.scheduler import Scheduler
from app.engine.sequence import Sequence
from app.engine.step_tokens import StepTokens
from app.protocol import GenerateRequest, SamplingParams

BS = 4


class _Drawn:
    """DrawnRows' host side: token, finite flag and logprobs per row."""

    def __init__(self, values):
        self.tokens, self.values = None, values

    def read(self):
        return self.values, [1] * len(self.values), [None] * len(self.values)


def _setup(lengths, max_tokens=10, waiting=0, max_batch=4, **params):
    params.setdefault("temperature", 0.0)
    sched = Scheduler(EngineConfig(max_num_seqs=max_batch, num_kv_blocks=64, block_size=BS), BlockAllocator(64), None)
    seqs = []
    for i, n in enumerate(lengths):
        seq = Sequence(
            GenerateRequest(f"r{i}", tuple(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, **params)), 0, i
        )
        seq.block_table = sched.allocator.allocate(-(-n // BS))
        seq.num_computed = n  # step N computed the prompt; its token is not appended yet
        seqs.append(seq)
    sched.running = list(seqs)
    for i in range(waiting):
        sched.waiting.append(Sequence(GenerateRequest(f"w{i}", (1, 2), SamplingParams()), 0, 100 + i))
    return sched, seqs, StepTokens(seqs, _Drawn([100 + i for i in range(len(seqs))]))


def _after_step(seqs, out):
    for seq, token in zip(seqs, out.drawn.values):
        seq.output_ids.append(token)


def test_next_step_covers_every_request_and_gives_blocks_where_a_token_starts_one():
    sched, seqs, out = _setup([3, 4, 6])
    free = sched.allocator.num_free
    order, src = sched.reserve_next_decode(out, max_batch=8)
    assert order == seqs and src == [0, 1, 2]
    assert [len(s.block_table) for s in seqs] == [1, 2, 2]  # position 4 starts a second block
    assert sched.allocator.num_free == free - 1


def test_requests_ending_by_length_are_left_out():
    sched, seqs, out = _setup([3, 5])
    seqs[1].output_ids = list(range(9))  # step N's token is its 10th of 10: it ends there
    assert sched.reserve_next_decode(out, max_batch=8) == ([seqs[0]], [0])


def test_no_step_ahead_when_it_is_not_certain():
    sched, seqs, out = _setup([3, 5], waiting=1)
    assert sched.reserve_next_decode(out, max_batch=8) is None  # a waiting request would join
    sched, seqs, out = _setup([3, 5])
    sched.running.append(Sequence(GenerateRequest("p", (1,) * 9, SamplingParams()), 0, 9))
    assert sched.reserve_next_decode(out, max_batch=8) is None  # a request still in prefill
    sched, seqs, out = _setup([4, 8])
    sched.allocator.allocate(sched.allocator.num_free - 1)
    assert sched.reserve_next_decode(out, max_batch=8) is None  # two need a block, one is free
    assert [len(s.block_table) for s in seqs] == [1, 2]


def test_sampled_rows_go_ahead_like_greedy_ones():
    """Their tokens are drawn on the device too, and the next step's parameters are known."""
    for params in ({"temperature": 0.7, "top_p": 0.9, "seed": 3}, {"min_tokens": 8}, {"logprobs": 2}):
        sched, seqs, out = _setup([3, 5], **params)
        assert sched.reserve_next_decode(out, max_batch=8) == (seqs, [0, 1]), params


def test_a_full_batch_with_waiting_requests_goes_ahead():
    sched, seqs, out = _setup([3, 5], waiting=2, max_batch=2)
    assert sched.reserve_next_decode(out, max_batch=8) is not None


def test_the_engine_takes_the_step_for_a_subset_with_the_tokens_it_ran_on():
    sched, seqs, out = _setup([3, 5, 6])
    order, src = sched.reserve_next_decode(out, max_batch=8)
    ahead = DecodeAhead(order, [s.num_computed for s in order], src, out, StepTokens(order, _Drawn([7, 8, 9])))
    _after_step(seqs, out)
    taken = ahead.take([(seqs[2], 1), (seqs[0], 1)])  # seqs[1] ended meanwhile
    assert taken.sampled == [seqs[0], seqs[2]] and taken.rows == [0, 2]
    assert taken.sample()[0] == [7, 9]
    assert ahead.take([(seqs[0], 2)]) is None  # not a decode step
    seqs[0].output_ids[-1] = 5  # sampled otherwise than the argmax the step ran on
    assert ahead.take([(seqs[0], 1)]) is None
