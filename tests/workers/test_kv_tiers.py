"""Host and disk tiers under the block pool: eviction down, hits back up, checks on the way.

The payloads are the synthetic executor's real KV (a running hash per slot), moved only through
its ``export_blocks`` / ``import_blocks``, as any cache's would be.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_runs import run, tokens

from common.block_hash import compute_block_hashes
from workers.config import CacheConfig, ConfigError, EngineConfig, SyntheticConfig
from workers.engine.block_manager import BlockManager
from workers.engine.core import EngineCore
from workers.engine.executor import ScheduledRequest, SchedulerOutput
from workers.engine.kv_events import BlockRemoved, BlockStored, KVEventQueue, Tier
from workers.engine.kv_tiers import KVTiers
from workers.engine.request import Request, RequestStatus
from workers.engine.synthetic import SyntheticExecutor, step_seconds
from workers.protocol import EngineRequest
from workers.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 4


class Pool:
    """A block manager over the synthetic executor's KV, with tiers (inline copies: exact tests)."""

    def __init__(self, tmp_path: Path, host_blocks: int, disk_blocks: int = 0, inline: bool = True) -> None:
        config = EngineConfig(kind="synthetic", cache=CacheConfig(block_size=BS, num_blocks=NUM_BLOCKS))
        self.executor = SyntheticExecutor(config)
        self.events = KVEventQueue()
        per_block = self.executor.kv_bytes_per_block
        self.tiers = KVTiers(block_bytes=per_block, block_size=BS, host_bytes=host_blocks * per_block,
                             disk_path=str(tmp_path / "disk") if disk_blocks else None,
                             disk_bytes=disk_blocks * per_block, export_blocks=self.executor.export_blocks,
                             import_blocks=self.executor.import_blocks, events=self.events, inline=inline)
        self.blocks = BlockManager(NUM_BLOCKS, BS, events=self.events, tiers=self.tiers)

    def compute(self, request_id: int, prompt: list[int]) -> Request:
        """Admit and prefill ``prompt`` (its KV written by the executor), then free it: its full blocks stay cached."""
        request = Request(request_id, prompt, SamplingParams(max_tokens=1))
        hits = self.blocks.get_computed_blocks(request)
        start = len(hits) * BS
        self.blocks.allocate(request, len(prompt) - start, hits)
        self.executor.execute(SchedulerOutput([ScheduledRequest(
            request_id, prompt[start:], start, request.block_ids, False, request.sampling_params, 0)]))
        request.num_computed_tokens = len(prompt)
        self.blocks.cache_full_blocks(request)
        self.blocks.free(request)
        self.blocks.check_integrity()
        return request

    def payloads(self, prompt: list[int]) -> list[bytes]:
        """The KV of the prompt's cached full blocks in the pool, block by block."""
        request = Request(99, prompt, SamplingParams(max_tokens=1))
        return [bytes(self.executor.export_blocks([b])[0]) for b in self.blocks.get_computed_blocks(request)]

    def onboard(self, request_id: int, prompt: list[int]) -> tuple[Request, int]:
        """What the scheduler does for a prompt whose prefix is below the pool: (it, blocks copied in)."""
        request = Request(request_id, prompt, SamplingParams(max_tokens=1))
        hits = self.blocks.get_computed_blocks(request)
        lower = self.blocks.lower_tier_hits(request, hits)
        taken = self.tiers.take(lower)
        assert self.blocks.try_allocate(request, len(lower) * BS, hits)
        self.tiers.onboard(request_id, request.block_ids[len(hits):], taken)
        ((done_id, num_loaded),) = self.tiers.collect()
        assert done_id == request_id
        self.blocks.keep_blocks(request, len(hits) + num_loaded)
        request.num_computed_tokens = len(request.block_ids) * BS
        self.blocks.cache_full_blocks(request)
        return request, num_loaded


A = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # two full blocks and one token
B = [20 + i for i in range(13)]  # three full blocks and one token: with A's partial block, the pool


def tier_events(events: KVEventQueue) -> list[tuple[str, Tier, list[int]]]:
    return [(type(e.event).__name__, e.event.tier, e.event.block_hashes) for e in events.drain()
            if isinstance(e.event, (BlockStored, BlockRemoved))]


def test_an_evicted_block_goes_to_the_host_tier_and_comes_back_identical(tmp_path):
    pool = Pool(tmp_path, host_blocks=4)
    pool.compute(0, A)
    kv = pool.payloads(A)
    a_hashes = compute_block_hashes(A, BS, 0)
    pool.events.drain()
    pool.compute(1, B)  # evicts A's two cached blocks, oldest (A's tail) first
    events = tier_events(pool.events)
    assert ("BlockStored", Tier.HOST, [a_hashes[1]]) in events and ("BlockStored", Tier.HOST, [a_hashes[0]]) in events
    assert ("BlockRemoved", Tier.POOL, [a_hashes[1], a_hashes[0]]) in events
    assert pool.tiers.stats().host_blocks == 2
    request, num_loaded = pool.onboard(2, A)
    assert num_loaded == 2
    assert [bytes(pool.executor.export_blocks([b])[0]) for b in request.block_ids] == kv
    stats = pool.tiers.stats()
    # A's two left the host tier; the block of B evicted to make room for them came in.
    assert (stats.host_hits, stats.disk_hits, stats.host_blocks, stats.misses) == (2, 0, 1, 0)
    assert stats.bytes_onboarded == 2 * pool.executor.kv_bytes_per_block
    assert ("BlockRemoved", Tier.HOST, [a_hashes[0]]) in tier_events(pool.events)
    assert pool.blocks.get_computed_blocks(Request(3, A, SamplingParams())) == request.block_ids  # cached again
    pool.blocks.free(request)
    pool.blocks.check_integrity()


def test_a_full_host_tier_moves_its_oldest_block_to_disk_checked_by_its_digest(tmp_path):
    pool = Pool(tmp_path, host_blocks=1, disk_blocks=4)
    pool.compute(0, A)
    kv = pool.payloads(A)
    pool.compute(1, B)
    pool.tiers.disk_files.flush()
    a_hashes = compute_block_hashes(A, BS, 0)
    events = tier_events(pool.events)
    assert ("BlockRemoved", Tier.HOST, [a_hashes[1]]) in events and ("BlockStored", Tier.DISK, [a_hashes[1]]) in events
    files = list(pool.tiers.disk_files.directory.iterdir())
    assert [f.name for f in files] == [f"{a_hashes[1]:016x}.kv"]
    assert files[0].read_bytes()[32:] == kv[1]  # after the 32-byte BLAKE2b digest
    request, num_loaded = pool.onboard(2, A)
    assert num_loaded == 2
    assert [bytes(pool.executor.export_blocks([b])[0]) for b in request.block_ids] == kv
    stats = pool.tiers.stats()
    # Taken out of their tiers before the pool made room for them (its evictions then come down freely).
    assert (stats.host_hits, stats.disk_hits, stats.disk_failures) == (1, 1, 0)
    pool.tiers.disk_files.flush()
    assert list(pool.tiers.disk_files.directory.iterdir()) == []  # moved up: its file is gone
    pool.tiers.close()


@pytest.mark.parametrize("damage", ["corrupt", "missing", "truncated"])
def test_a_damaged_disk_file_is_a_miss_never_wrong_kv(tmp_path, damage):
    pool = Pool(tmp_path, host_blocks=1, disk_blocks=4)
    pool.compute(0, A)
    kv = pool.payloads(A)
    pool.compute(1, B)  # A's second block on disk, its first in the host tier
    pool.tiers.disk_files.flush()
    (path,) = pool.tiers.disk_files.directory.iterdir()
    data = bytearray(path.read_bytes())
    if damage == "corrupt":
        data[40] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "missing":
        path.unlink()
    else:
        path.write_bytes(bytes(data[:-3]))
    request, num_loaded = pool.onboard(2, A)
    assert num_loaded == 1  # the host block, not the damaged one after it
    assert len(request.block_ids) == 1 and bytes(pool.executor.export_blocks(request.block_ids)[0]) == kv[0]
    stats = pool.tiers.stats()
    assert (stats.disk_failures, stats.misses, stats.disk_blocks) == (1, 1, 0)
    pool.blocks.free(request)
    pool.blocks.check_integrity()
    pool.tiers.close()


def test_a_full_disk_tier_deletes_its_oldest_file(tmp_path):
    pool = Pool(tmp_path, host_blocks=1, disk_blocks=1)
    pool.compute(0, A)
    pool.compute(1, B)  # A: one block on host, one on disk
    pool.compute(2, A)  # recomputed (compute never onboards): B's blocks go down, pushing A's off the disk
    pool.tiers.disk_files.flush()
    stats = pool.tiers.stats()
    assert stats.disk_blocks == 1 and stats.disk_evictions >= 1
    assert len(list(pool.tiers.disk_files.directory.iterdir())) == 1
    assert any(name == "BlockRemoved" and tier is Tier.DISK for name, tier, _ in tier_events(pool.events))
    pool.tiers.close()


def test_a_hash_collision_in_a_tier_is_a_miss(tmp_path):
    pool = Pool(tmp_path, host_blocks=4)
    pool.compute(0, A)
    pool.compute(1, B)
    first = compute_block_hashes(A, BS, 0)[0]
    assert pool.tiers.find(first, None, tuple(A[:4]))
    assert not pool.tiers.find(first, None, (9, 9, 9, 9))  # same hash, other tokens: never its KV


def test_tier_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="engine.cache.disk_tier_path"):
        EngineConfig(kind="synthetic", cache=CacheConfig(host_tier_bytes=1 << 20, disk_tier_bytes=1 << 20)).validate()
    with pytest.raises(ConfigError, match="engine.cache.disk_tier_bytes"):
        EngineConfig(kind="synthetic", cache=CacheConfig(disk_tier_path="/tmp/x", disk_tier_bytes=1 << 20)).validate()
    with pytest.raises(ConfigError, match="engine.cache.host_tier_bytes"):
        EngineConfig(kind="synthetic", cache=CacheConfig(host_tier_bytes=-1)).validate()


# ---- the engine: scheduler, onboarding thread, outputs -----------------------------------


def make_core(tmp_path: Path, host_bytes: int, disk_bytes: int = 0, inline: bool = False, **timing) -> EngineCore:
    cache = CacheConfig(block_size=16, num_blocks=8, host_tier_bytes=host_bytes, disk_tier_bytes=disk_bytes,
                        disk_tier_path=str(tmp_path / "disk") if disk_bytes else None)
    return EngineCore(EngineConfig(kind="synthetic", cache=cache, synthetic=SyntheticConfig(**timing)),
                      inline_onboarding=inline)


def make_request(request_id: int, prompt: list[int]) -> EngineRequest:
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=6, temperature=0.0))


LONG = list(range(100, 181))  # five full blocks of 16 and one token
OTHER = list(range(300, 381))


@pytest.mark.parametrize("host_blocks,disk_blocks", [(8, 0), (1, 8)])
def test_a_prompt_evicted_from_the_pool_is_served_from_the_tiers_with_identical_tokens(tmp_path, host_blocks,
                                                                                          disk_blocks):
    per_block = 8 * 16  # the synthetic executor's
    expected = tokens(run(make_core(tmp_path, 0), make_request(0, LONG))[0])
    core = make_core(tmp_path, host_blocks * per_block, disk_blocks * per_block)
    run(core, make_request(0, LONG))
    run(core, make_request(1, OTHER))  # evicts LONG's last three full blocks from the pool of 8
    assert len(core.block_manager.get_computed_blocks(Request(9, LONG, SamplingParams()))) == 2
    again = run(core, make_request(2, LONG))[2]
    assert tokens(again) == expected
    assert again[0].num_cached_tokens == 5 * 16  # every full block but the last token's came back
    stats = core.tiers.stats()
    assert stats.host_hits + stats.disk_hits == 3 and stats.disk_failures == 0
    assert (stats.disk_hits > 0) == (disk_blocks > 0)
    core.check_integrity()
    core.close()


def test_an_abort_while_onboarding_frees_the_blocks_once_the_copy_is_done(tmp_path):
    core = make_core(tmp_path, 8 * 8 * 16)
    run(core, make_request(0, LONG))
    run(core, make_request(1, OTHER))
    core.add_request(make_request(2, LONG))
    core.step()  # starts the copy on the onboarding thread
    assert core.scheduler.requests[2].status == RequestStatus.ONBOARDING
    core.abort(2)
    outputs = core.step()
    assert [o.finish_reason for o in outputs] == ["abort"]
    while core.onboarding:
        core.step()
    assert core.scheduler.is_idle and core.block_manager.num_used_blocks == 0
    core.check_integrity()
    core.close()


def test_the_timing_model_charges_onboarding_per_block(tmp_path):
    core = make_core(tmp_path, 8 * 8 * 16, inline=True, onboard_seconds_per_block=0.5)
    run(core, make_request(0, LONG))
    run(core, make_request(1, OTHER))
    core.add_request(make_request(2, LONG))
    batch = core.scheduler.schedule()
    assert batch.num_onboarded_blocks == 3 and batch.num_prefill_tokens == 1  # two pool hits, the last token
    assert step_seconds(core.config.synthetic, batch) == 1.5
    core.close()


def test_a_gen_side_request_copies_its_tier_hits_in_and_pulls_only_the_rest(tmp_path):
    ctx = make_core(tmp_path, 0)
    ctx.add_request(EngineRequest(7, LONG, SamplingParams(max_tokens=1, temperature=0.0)), park_kv_seconds=60)
    first = tokens(run(ctx)[7])
    parked = ctx.parked_block_ids(7)
    expected = tokens(run(make_core(tmp_path, 0), make_request(0, LONG))[0])
    gen = make_core(tmp_path, 8 * 8 * 16)
    run(gen, make_request(0, LONG))
    run(gen, make_request(1, OTHER))  # LONG: two full blocks left in the pool, three in the host tier
    gen.add_remote_request(make_request(2, LONG), first)
    pulls = []
    while not pulls:
        gen.step()
        pulls = gen.take_kv_pulls()
    (pull,) = pulls
    assert (pull.first_block, len(pull.block_ids)) == (5, 1)  # only the last, partial block is pulled
    gen.import_blocks(pull.block_ids, list(ctx.export_blocks(parked[5:])))
    gen.finish_remote_kv(2)
    outputs = run(gen)[2]
    assert first + tokens(outputs) == expected
    assert gen.tiers.stats().host_hits == 3 and gen.scheduler.num_waiting_for_remote_kv == 0
    gen.check_integrity()
    gen.close()


def test_a_block_evicted_while_every_host_slot_is_being_copied_from_is_dropped(tmp_path):
    pool = Pool(tmp_path, host_blocks=2, inline=False)
    pool.compute(0, A)
    pool.compute(1, B)  # A's two blocks fill the host tier
    request = Request(2, A, SamplingParams(max_tokens=1))
    lower = pool.blocks.lower_tier_hits(request, [])
    pool.tiers.onboarder.close()  # (no thread: the copy stays in flight, its slots taken)
    taken = pool.tiers.take(lower)
    assert pool.blocks.try_allocate(request, len(lower) * BS)  # evicts one of B's blocks: no slot for it
    pool.tiers.onboard(2, request.block_ids, taken)
    stats = pool.tiers.stats()
    assert stats.host_blocks == 0 and stats.host_evictions >= 1
    pool.blocks.check_integrity()


def test_the_deployment_yaml_checks_the_tier_keys_by_their_names(tmp_path):
    from disagg.deploy_config import EngineSettings

    with pytest.raises(ConfigError, match="engine.disk_tier_path"):
        EngineSettings(host_tier_bytes=1 << 20, disk_tier_bytes=1 << 20).validate("engine")
    with pytest.raises(ConfigError, match="engine.disk_tier_bytes"):
        EngineSettings(disk_tier_path=str(tmp_path), disk_tier_bytes=1 << 20).validate("engine")
    EngineSettings(host_tier_bytes=1 << 20, disk_tier_path=str(tmp_path), disk_tier_bytes=1 << 20).validate("engine")
