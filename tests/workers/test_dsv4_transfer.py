"""DeepSeek-V4 sequences' state: freed with their blocks, and moved ctx -> gen block by block."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from tests.workers.dsv4_reference import prompt
from tests.workers.engine_runs import run, tokens
from workers.config import CacheConfig, EngineConfig, SchedulerConfig
from workers.engine.core import EngineCore
from workers.engine.model.deepseek_v4.block_payload import assemble_state, check_payload, decode_payload, encode_block
from workers.engine.model.deepseek_v4.model import DeepseekV4Model, SequenceBatch
from workers.engine.model.deepseek_v4.runner import DeepseekV4Runner
from workers.engine.model.deepseek_v4.state import SequenceState
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

BLOCK_SIZE = 16


def _core(model_dir: Path) -> EngineCore:
    return EngineCore(EngineConfig(
        model=str(model_dir), device="cpu",
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=120, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96),
    ))


def _runner(core: EngineCore) -> DeepseekV4Runner:
    assert isinstance(core.executor, DeepseekV4Runner)
    return core.executor


def _request(request_id: int, ids: list[int], max_tokens: int) -> EngineRequest:
    return EngineRequest(request_id, ids, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def _tensors(state: SequenceState) -> list[torch.Tensor | None]:
    out: list[torch.Tensor | None] = []
    for layer in state.layers:
        out.append(layer.window)
        for part in (layer.compressor, layer.indexer):
            if part is not None:
                out += [part.entries, part.tail_kv, part.tail_gate, part.overlap_kv, part.overlap_gate]
    return out


def test_finished_aborted_and_released_sequences_leave_no_state(tiny_dsv4_dir: Path) -> None:
    core = _core(tiny_dsv4_dir)
    runner = _runner(core)
    for round_ in range(3):  # many requests over the same blocks: nothing accumulates
        run(core, *[_request(10 * round_ + i, prompt(5 + 7 * i, seed=i).tolist(), 2) for i in range(4)])
        assert (runner.num_live_states, runner.num_tracked_blocks) == (0, 0)
    for i in range(3):
        core.add_request(_request(100 + i, prompt(40, seed=i).tolist(), 20))
    core.step()
    core.step()
    assert runner.num_live_states == 3
    for i in range(3):
        core.abort(100 + i)
    core.step()
    assert (runner.num_live_states, runner.num_tracked_blocks) == (0, 0)
    core.add_request(_request(200, prompt(30).tolist(), 1), park_kv_seconds=60.0)
    run(core)
    assert runner.num_live_states == 1  # parked for a gen engine's pull
    assert core.release_parked(200)
    assert (runner.num_live_states, runner.num_tracked_blocks) == (0, 0)
    assert core.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("length", [1, 3, 4, 16, 45, 127, 128, 131, 263])
def test_blocks_payloads_assemble_into_the_same_state(tiny_dsv4_dir: Path, length: int) -> None:
    model = DeepseekV4Model.from_dir(tiny_dsv4_dir)
    state = model.new_state()
    model.forward(prompt(length), [SequenceBatch(state, length)])
    num_blocks = -(-length // BLOCK_SIZE)
    frames = [encode_block(state, i, BLOCK_SIZE, model.config) for i in range(num_blocks)]
    for frame in frames:
        check_payload(decode_payload(frame), model.config, BLOCK_SIZE)
    assembled = assemble_state([decode_payload(f) for f in frames], model.config, BLOCK_SIZE)
    assert assembled.num_tokens == length
    for ours, theirs in zip(_tensors(assembled), _tensors(state), strict=True):
        assert (ours is None) == (theirs is None)
        if ours is not None and theirs is not None:
            assert torch.equal(ours, theirs)
    with pytest.raises(ValueError):
        assemble_state([decode_payload(f) for f in frames[:-1]], model.config, BLOCK_SIZE)


@pytest.mark.parametrize("length", [45, 126, 263])
def test_pulled_state_continues_identically_on_another_engine(tiny_dsv4_dir: Path, length: int) -> None:
    """45: inside the window; 126: its decode crosses the window and the first HCA entry (128);
    263: past the window, 2 HCA entries, a CSA tail of 3."""
    ids = prompt(length, seed=length).tolist()
    reference = tokens(run(_core(tiny_dsv4_dir), _request(0, ids, 5))[0])
    ctx = _core(tiny_dsv4_dir)
    ctx.add_request(_request(0, ids, 1), park_kv_seconds=60.0)
    (first,) = run(ctx)[0]
    assert first.new_token_ids == reference[:1]
    gen = _core(tiny_dsv4_dir)
    gen.add_remote_request(_request(0, ids, 5), output_token_ids=first.new_token_ids)
    gen.step()
    (pull,) = gen.take_kv_pulls()
    parked = ctx.parked_block_ids(0)
    assert parked is not None and pull.first_block == 0
    # In chunks as the KV server sends them, one of them in descending block order.
    for start in range(0, len(pull.block_ids), 3):
        sources, targets = parked[start:start + 3], pull.block_ids[start:start + 3]
        if start == 3:
            sources, targets = sources[::-1], targets[::-1]
        gen.import_blocks(targets, list(ctx.export_blocks(sources)))
    assert ctx.release_parked(0)
    gen.finish_remote_kv(0)
    assert tokens(run(gen)[0]) == reference[1:]
    assert (_runner(ctx).num_live_states, _runner(gen).num_live_states) == (0, 0)
    assert _runner(gen).num_tracked_blocks == 0


def test_foreign_frames_are_refused_on_arrival(tiny_dsv4_dir: Path) -> None:
    core = _core(tiny_dsv4_dir)
    config = _runner(core).model.config
    state = _runner(core).model.new_state()
    _runner(core).model.forward(prompt(40), [SequenceBatch(state, 40)])
    good = decode_payload(encode_block(state, 2, BLOCK_SIZE, config))  # the last of 3 blocks: it has the tails
    layer = good.layers[1]  # a CSA layer
    assert layer.compressor is not None and layer.indexer is not None
    foreign = [
        msgspec.structs.replace(good, block_size=32),
        msgspec.structs.replace(good, layers=good.layers[:-1]),  # a model with one layer less
        msgspec.structs.replace(good, index=3),  # past the sequence's last token
        msgspec.structs.replace(good, num_tokens=60),  # then it is not the last block: no tail belongs
        msgspec.structs.replace(good, layers=[good.layers[0], msgspec.structs.replace(layer, window=layer.window[:-4]),
                                              *good.layers[2:]]),
        msgspec.structs.replace(good, layers=[good.layers[0], msgspec.structs.replace(layer, indexer=None),
                                              *good.layers[2:]]),
    ]
    for payload in foreign:
        with pytest.raises(ValueError, match="deepseek_v4"):
            core.import_blocks([0], [msgspec.msgpack.encode(payload)])
    core.import_blocks([0], [msgspec.msgpack.encode(good)])
    assert _runner(core).num_tracked_blocks == 1
    with pytest.raises(ValueError, match="not a KV block payload"):
        core.import_blocks([0], [b"\x93\x01\x02"])
    with pytest.raises(ValueError, match="frames for"):
        core.import_blocks([0, 1], [b""])
    with pytest.raises(ValueError, match="holds no sequence"):
        core.export_blocks([5])


def test_a_gen_request_aborted_after_its_blocks_arrived_leaves_nothing(tiny_dsv4_dir: Path) -> None:
    ids = prompt(45).tolist()
    ctx, gen = _core(tiny_dsv4_dir), _core(tiny_dsv4_dir)
    ctx.add_request(_request(0, ids, 1), park_kv_seconds=60.0)
    (first,) = run(ctx)[0]
    gen.add_remote_request(_request(0, ids, 5), output_token_ids=first.new_token_ids)
    gen.step()
    (pull,) = gen.take_kv_pulls()
    parked = ctx.parked_block_ids(0)
    assert parked is not None
    gen.import_blocks(pull.block_ids, list(ctx.export_blocks(parked)))
    assert _runner(gen).num_tracked_blocks == len(pull.block_ids) == 3
    gen.abort(0)
    gen.step()
    assert (_runner(gen).num_live_states, _runner(gen).num_tracked_blocks) == (0, 0)
    assert gen.block_manager.num_used_blocks == 0
