"""The router's own rules, without processes: scoped keys, ranking, the key log, the wire."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from engine import errors
from engine.cache.block_hash import BlockHasher
from engine.cache.budget import PUBLIC_OWNER, TenantBudget
from engine.cache.quotas import OwnerCounters
from engine.cache.scope import Public, Segment, Tenant, User
from engine.cache.stats import CacheStats, OwnerStats
from engine.request import GenerationDelta, GenerationRequest, Timings, Usage
from engine.sampling.sampler import SamplingParams, TokenLogprobs
from gateway.workers import routing, wire
from gateway.workers.addresses import WorkerSpecError, parse_worker_spec, resolve
from gateway.workers.key_log import KEY_PREFIX_BYTES, KeyDigest, KeyLog
from gateway.workers.remote_engine import _agreed, total_stats

BLOCK = 4
ROOT = BlockHasher(BLOCK).root("model", "", "float32")
DIGEST = KeyDigest("the gateways' signing key, 32+ characters")


def request(tenant: str, user: str, tokens: list[int], public: int = 0) -> GenerationRequest:
    segments = []
    if public:
        segments.append(Segment(0, public, Public("default")))
    segments.append(Segment(public, len(tokens), User(tenant, user)))
    return GenerationRequest(f"r-{tenant}-{user}", tenant, tokens, segments=segments)


def test_keys_follow_scope_not_text() -> None:
    tokens = list(range(100, 117))  # 17 tokens: 4 full blocks before the last token
    alice = routing.request_keys(request("acme", "alice", tokens), ROOT, BLOCK, DIGEST)
    assert len(alice) == 4
    assert alice == routing.request_keys(request("acme", "alice", tokens), ROOT, BLOCK, DIGEST)
    # The same tokens under another tenant, or another user, share no key at all.
    other_tenant = routing.request_keys(request("globex", "alice", tokens), ROOT, BLOCK, DIGEST)
    other_user = routing.request_keys(request("acme", "bob", tokens), ROOT, BLOCK, DIGEST)
    assert not set(alice) & set(other_tenant)
    assert not set(alice) & set(other_user)
    # A public prefix is the same key for every tenant; what follows it is not.
    a = routing.request_keys(request("acme", "alice", tokens, public=8), ROOT, BLOCK, DIGEST)
    b = routing.request_keys(request("globex", "gina", tokens, public=8), ROOT, BLOCK, DIGEST)
    assert a[:2] == b[:2] and not set(a[2:]) & set(b[2:])


def test_keys_match_what_the_worker_caches() -> None:
    """The router's chain is the cache's chain (engine/cache/block_hash.py), shortened."""
    tokens = list(range(9))
    scopes = [Tenant("acme")] * 2
    from engine.cache.block_hash import encode_token_ids

    chain = BlockHasher(BLOCK).chain(ROOT, encode_token_ids(tokens), scopes)
    wanted = [DIGEST(key) for key in chain]
    segments = [Segment(0, len(tokens), Tenant("acme"))]
    asked = GenerationRequest("r", "acme", tokens, segments=segments)
    assert routing.request_keys(asked, ROOT, BLOCK, DIGEST) == wanted


def test_published_keys_confirm_no_guess_without_the_signing_key() -> None:
    """Whoever reads a worker's published keys without the signing key (a stolen gateway
    certificate and worker secret) cannot check a guessed prompt against them: neither the
    plain block keys nor their digests under another key are what is published."""
    from engine.cache.block_hash import encode_token_ids

    tokens = list(range(9))
    chain = BlockHasher(BLOCK).chain(ROOT, encode_token_ids(tokens), [Tenant("acme")] * 2)
    published = {DIGEST(key) for key in chain}
    plain = {key[:KEY_PREFIX_BYTES].hex() for key in chain}
    guessed = {KeyDigest("an attacker's own key, 32+ characters")(key) for key in chain}
    assert len(published) == 2 and all(len(key) == 2 * KEY_PREFIX_BYTES for key in published)
    assert not published & plain and not published & guessed
    # The same signing key on another process (a gateway, a worker) gives the same digests.
    assert {KeyDigest("the gateways' signing key, 32+ characters")(key) for key in chain} == (
        published
    )


def test_prompt_logprobs_and_short_prompts_have_no_keys() -> None:
    tokens = list(range(20))
    scored = GenerationRequest("r", "t", tokens, tail_scope=User("t", "u"), prompt_logprobs=1)
    assert routing.request_keys(scored, ROOT, BLOCK, DIGEST) == []
    short = GenerationRequest("r", "t", [1, 2, 3, 4], tail_scope=User("t", "u"))
    assert routing.request_keys(short, ROOT, BLOCK, DIGEST) == []


def candidate(
    name: str, keys: list[str], in_flight: int = 0, free: int = 1000
) -> routing.Candidate:
    return routing.Candidate(name, set(keys), in_flight, free)


def rank(candidates: list[routing.Candidate], keys: list[str], **options: int) -> list[str]:
    settings = {"prompt_tokens": 64, "load_tokens": 8, "max_imbalance": 4, **options}
    asking = [replace(candidate, request_keys=keys) for candidate in candidates]
    ranked = routing.rank(
        asking, settings["prompt_tokens"], BLOCK, settings["load_tokens"],
        settings["max_imbalance"], sticky="s",
    )  # fmt: skip
    return [choice.name for choice in ranked]


def test_the_longest_cached_prefix_wins_until_load_outweighs_it() -> None:
    keys = ["k1", "k2", "k3", "k4"]
    holder, other = candidate("a", keys[:3]), candidate("b", keys[:1])
    assert rank([other, holder], keys) == ["a", "b"]
    # Two blocks more cached saves 8 tokens; one request in flight costs 8, two cost 16.
    assert rank([other, candidate("a", keys[:3], in_flight=2)], keys) == ["b", "a"]
    # A match must start at the first block: holding later blocks only is worth nothing.
    assert rank([candidate("a", keys[1:]), candidate("b", keys[:1])], keys)[0] == "b"


def test_imbalance_sends_the_request_to_the_least_loaded() -> None:
    keys = ["k1", "k2", "k3", "k4"]
    hot = candidate("hot", keys, in_flight=5)
    idle = candidate("idle", [], in_flight=0)
    assert rank([hot, idle], keys, load_tokens=0) == ["idle", "hot"]
    assert rank([hot, idle], keys, load_tokens=0, max_imbalance=6) == ["hot", "idle"]


def test_eviction_counts_against_a_full_worker() -> None:
    keys = ["k1"]
    full = candidate("full", keys, free=0)
    roomy = candidate("roomy", [], free=100)
    # 64 tokens = 16 blocks; "full" holds one and must evict 15 more (60 tokens) to start.
    assert rank([full, roomy], keys) == ["roomy", "full"]


def test_ties_stick_to_one_worker_per_prefix() -> None:
    workers = [candidate(name, []) for name in ("a", "b", "c", "d")]
    chosen = {
        sticky: routing.rank(workers, 64, BLOCK, 8, 4, sticky)[0].name
        for sticky in ("p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8")
    }
    # The same prefix always picks the same worker, whatever order the workers come in...
    for sticky, name in chosen.items():
        assert routing.rank(workers[::-1], 64, BLOCK, 8, 4, sticky)[0].name == name
    # ...and different prefixes spread over the workers.
    assert len(set(chosen.values())) >= 2


def test_round_robin_rotates() -> None:
    workers = [candidate(name, []) for name in ("a", "b", "c")]
    firsts = [routing.rotate(workers, turn)[0].name for turn in range(4)]
    assert firsts == ["a", "b", "c", "a"]


def test_key_log_sends_changes_then_everything_to_a_stranger() -> None:
    held: list[bytes] = [b"\x01" * 32, b"\x02" * 32]
    log = KeyLog(lambda: list(held), DIGEST, min_interval_s=0)
    first = log.update(None, 0, now=0)
    assert first.full and set(first.added) == {DIGEST(k) for k in held}
    held.remove(b"\x01" * 32)
    held.append(b"\x03" * 32)
    change = log.update(first.epoch, first.seq, now=1)
    assert not change.full and change.seq == first.seq + 1
    assert change.added == [DIGEST(b"\x03" * 32)]
    assert change.removed == [DIGEST(b"\x01" * 32)]
    # Nothing new: no changes, same sequence number.
    same = log.update(first.epoch, change.seq, now=2)
    assert (same.added, same.removed, same.seq, same.full) == ([], [], change.seq, False)
    # Another process's epoch, or a sequence number from the future: the whole set.
    assert log.update("another-epoch", change.seq, now=3).full
    assert log.update(first.epoch, change.seq + 5, now=4).full


def test_worker_addresses() -> None:
    assert parse_worker_spec("http://10.0.0.5:8001") == ("http", "10.0.0.5", 8001)
    assert parse_worker_spec("dns://workers.ns.svc:8001") == ("dns", "workers.ns.svc", 8001)
    for bad in ("10.0.0.5:8001", "http://host", "ftp://host:1", "http://host:1/path"):
        with pytest.raises(WorkerSpecError):
            parse_worker_spec(bad)
    assert resolve("http://10.0.0.5:8001") == ["http://10.0.0.5:8001"]
    assert resolve("dns://localhost:8001") == ["http://127.0.0.1:8001"]
    assert resolve("dns://no-such-name.invalid:8001") == []  # no ready worker behind it yet


def test_requests_and_deltas_cross_the_wire_unchanged() -> None:
    original = GenerationRequest(
        "r1", "acme", [5, 6, 7, 8, 9],
        SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=("x",),
                       stop_token_ids=(2,), logit_bias=((5, -1.5),), logprobs=2),
        segments=[Segment(0, 2, Public("default")), Segment(2, 5, User("acme", "u"))],
        tail_scope=User("acme", "u"), budget=TenantBudget(40, 4), n=2, prompt_logprobs=1,
    )  # fmt: skip
    assert wire.read_request(wire.request_json(original), compile_grammar=None) == original
    delta = GenerationDelta(
        "hi", [1, 2], "stop",
        logprobs=[TokenLogprobs(1, -0.5, ((1, -0.5), (3, -math.inf)))],
        prompt_logprobs=[TokenLogprobs(6, -2.0, ())], index=1,
        usage=Usage(5, 4, 2), timings=Timings(1.0, 2.0, 3.0, 4.0),
    )  # fmt: skip
    import json

    assert wire.read_delta(json.loads(json.dumps(wire.delta_json(delta)))) == delta


def test_malformed_requests_are_refused_by_name() -> None:
    good = wire.request_json(GenerationRequest("r", "t", [1, 2, 3]))
    for broken in (
        {**good, "prompt_token_ids": "123"},
        {**good, "prompt_token_ids": [1, "2"]},
        {**good, "n": "2"},
        {**good, "tail_scope": {"kind": "everyone"}},
        {**good, "budget": {"quota_blocks": -1, "reserved_blocks": 0}},
        {**good, "prompt_logprobs": "x"},
        {**good, "segments": [{"start": 0, "end": 1000, "scope": {"kind": "none"}}]},
        {**good, "segments": [{"start": 1, "end": 3, "scope": {"kind": "none"}}]},
        {k: v for k, v in good.items() if k != "sampling"},
    ):
        with pytest.raises(wire.WireError):
            wire.read_request(broken, compile_grammar=None)


def test_engine_errors_keep_their_kind() -> None:
    for error in (
        errors.ContextTooLong("too long"),
        errors.ExceedsCacheQuota("too big", 64, 32, "max_tokens"),
        errors.InvalidRequest("bad", "tools"),
        errors.EngineOverloaded("busy"),
        errors.CacheQuotaTimeout("full"),
        errors.RequestFailed("nan"),
    ):
        back = wire.read_error(wire.error_json(error))
        assert type(back) is type(error) and str(back) == str(error)
        assert getattr(back, "param", None) == getattr(error, "param", None)
    assert type(wire.read_error({"type": "SomethingNew", "message": "m"})) is errors.EngineError


def stats(blocks: int, owners: dict[object, OwnerStats]) -> CacheStats:
    return CacheStats(blocks, blocks // 2, 3, 1, 1, 0, 5, owners)  # type: ignore[arg-type]


def test_totals_add_up_every_worker() -> None:
    acme = OwnerStats(2, 3, 1, 10, OwnerCounters(prompt_tokens=100, cached_tokens=40))
    public = OwnerStats(0, 4, 0, 50)
    a = stats(100, {"acme": acme, PUBLIC_OWNER: public})
    b = stats(60, {"acme": acme})
    total = total_stats([a, b])
    assert (total.num_blocks, total.free_blocks, total.cached_keys) == (160, 80, 6)
    both = total.owners["acme"]
    assert (both.active_blocks, both.cached_blocks, both.quota_blocks) == (4, 6, 20)
    assert (both.counters.prompt_tokens, both.counters.cached_tokens) == (200, 80)
    assert total.owners[PUBLIC_OWNER] == public
    assert wire.read_stats(wire.stats_json(a)) == a


def test_each_worker_is_matched_on_its_own_chain() -> None:
    """Workers of another KV dtype or block size chain from another root: a request's keys
    are computed for each, and a worker is matched only on its own."""
    bf16 = routing.Candidate("bf16", {"x1", "x2"}, 0, 100, request_keys=["x1", "x2", "x3"])
    fp32 = routing.Candidate("fp32", {"x1", "x2", "x3"}, 0, 100, request_keys=["y1", "y2"])
    ranked = routing.rank([fp32, bf16], 64, BLOCK, 8, 4, "s")
    assert [(c.name, c.cached_blocks) for c in ranked] == [("bf16", 2), ("fp32", 0)]


def test_keys_just_sent_count_until_they_expire() -> None:
    from gateway.workers.worker import Worker

    worker = Worker("http://w:1", keys={"a"})
    worker.pending = {"b": 10.0}
    assert "a" in worker.held(5.0) and "b" in worker.held(5.0)
    assert "b" not in worker.held(11.0) and "c" not in worker.held(5.0)
    worker.forget_pending(11.0)
    assert worker.pending == {}


def test_a_choice_the_workers_disagree_on_reads_mixed() -> None:
    assert _agreed(["matrix", "matrix"]) == "matrix"
    assert _agreed(["matrix", "library"]) == "mixed"
    assert _agreed([None, "bfloat16"]) == "mixed"  # a worker that has not said yet
    assert _agreed([]) is None
