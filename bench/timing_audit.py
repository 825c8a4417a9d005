"""Timing audit: can one client tell, by timing alone, that another's prompt is in the cache?

    python -m bench.timing_audit [--samples 250] [--prompt-tokens 512] [--model tiny|embedded|DIR]
        [--cases a,b,c,d,e,f,g,h] [--seed 0] [--json] [--out F] [--plot F.png]

The attacker's own method: published audits of commercial APIs detected global prompt caching
with a one-sided two-sample Kolmogorov-Smirnov test on 250 timings per group. Here it runs
against a real `prefixgate serve` subprocess (SQLite, tenants, keys and one public system
prompt made with the CLI) over HTTP on 127.0.0.1.

Each case runs `2 x samples` trials in a seeded shuffled order, `samples` labelled hit and
`samples` miss. A trial sends the victim's request (a fresh random prompt of L token ids,
`max_tokens` 1) and waits for it, then sends ONE attacker probe: a hit repeats the victim's
first 95% of tokens with a fresh random tail, a miss is fresh random tokens of the same length.
The victim's request is sent before a miss too, so both groups run under the same load. Probes
are `/v1/completions` with token ids (exact token control; chats in case b), non-streaming,
greedy, `max_tokens` 1, timed by the client, each with the `cached_tokens` of its usage.

    (a) same user: one key and `user` for both: sharing is allowed           -> detected
    (b) public prompt: the victim (tenant A) and the attacker (tenant B) send chats; a hit's
        system prompt is the registered public one (cut to whole KV blocks, so the user's
        text starts a block), a miss's a fresh random one of as many words; both with a
        random user message                                                  -> detected
    (c) another tenant: victim in tenant A, attacker in tenant B (same `user` string)
                                                                             -> not detected
    (d) another user: same tenant and key, another `user`                     -> not detected
    (e) another key: two keys of one tenant, no `user` field                  -> not detected
    (f) queued: the victim's request (2 L tokens) is not waited for: the probe (tenant B) is
        sent once the victim's body is on the wire, so it waits behind (or is batched with)
        the victim's prefill; `finished_after_victim` counts those that did -> not detected
    (g) the second tier, another tenant: as (c), on a server of its own with a disk tier
        (PREFIXGATE_KV_TIER=disk) and a pool one block larger than a prompt. Between the
        victim's request and the probe a third tenant (C) sends a filler prompt that takes
        every block of the pool, so at probe time the victim's blocks are in the tier and
        nowhere in the pool. After the probe, the victim's own control probe (the victim's
        first 95% and a fresh tail, after hits and misses alike) must be read back from the
        tier: it shows that the victim's blocks were there to be found      -> not detected
    (h) the second tier, same key and user: (g)'s server and trials, the victim's own probe
        in place of the attacker's: a positive control, whose hits come from the tier
                                                                             -> detected

The filler is one prompt for the whole run: after its first use it is read back from the tier,
yet it still takes a block of the pool for each of its own. In the tier cases /readyz's
`kv_tier.loaded_blocks` is read just before each probe and just after it (after the control,
where there is one); each trial's probe and control must owe every cached token to the tier.
Nothing is ever evicted from the tier in these cases: each tenant's quota and the tier hold
all the blocks the run writes (see `tier_server`).

Statistics per case: `scipy.stats.ks_2samp(hit, miss, alternative="greater")`, whose
alternative is that hits are stochastically faster (the CDF of hit latencies lies above the
misses'); median, p10 and p90 per group; cached tokens per group. The same test runs on the
engine time the server reports in `Server-Timing` (free of network noise, and readable by any
client). A case holds when: detected cases have p < 1e-6, every hit cached and no miss cached;
not-detected cases have p >= 0.01 and not one probe cached; tier cases also need every cached
token of theirs from the tier and every control probe cached. Only the client-side p decides.
Below 12 samples per group no p-value reaches 1e-6 (the smallest is 1 / C(2n, n)).

Models: `tiny` (default) is a seeded random Llama (hidden 256, 4 layers) with SmolLM2's
tokenizer and chat template, written to a temporary directory: a prefill of 512 tokens costs
clearly more than the HTTP path's noise. `embedded` is the embedded SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import random
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import torch
from scipy.stats import ks_2samp
from tqdm import tqdm
from transformers import AutoTokenizer

from bench.common import emit, fp32_kv_bytes_per_token, percentile
from bench.local_server import tiny_chat_model
from bench.peers import machine_info
from bench.served_gateway import ServedGateway, ServedTenant, served_tenants
from engine.model.loader import embedded_model_dir
from engine.precision import resolve_device, resolve_dtype
from policies.templates import system_prompt_tokens

CASES = "abcdefgh"
SHARED_FRACTION = 0.95  # of a hit probe's tokens, taken from the victim's prompt
DETECTED_P = 1e-6  # a case that must be detected: the KS p-value is below this
NOT_DETECTED_P = 0.01  # a case that must not be: the KS p-value is at least this
WARMUP_TRIALS = 4  # per case, not measured: first-use costs of its code paths
KV_CACHE_BYTES = 1 << 30
BLOCK_SIZE = 16  # the server's default
PUBLIC_PREFIX = "audit"
TIMEOUT_S = 120.0  # one request; the server answers a prompt of 2 L tokens far sooner
BODY_SENT = "http11.send_request_body.complete"  # httpcore's trace event
TIER_KIND = "disk"  # the tier cases' second tier
# What the tier charges for a block, at most, beyond its KV: token ids, the identity, the
# seal's header and tag, a slot's header and alignment (engine/cache/tier/entry.py).
TIER_ENTRY_SLACK = 4096
CALIBRATION_SAMPLES = 8  # blocks `KVTier.calibrate` stores, twice over, while the server starts


@dataclass(frozen=True, slots=True)
class Party:
    """Who sends a request: an API key, and the `user` field (None: the field is left out)."""

    key: str
    user: str | None


@dataclass(frozen=True, slots=True)
class Case:
    """Who the victim and the attacker are, how probes are made, and what must be seen."""

    letter: str
    title: str
    victim: str  # party names, see `parties`
    attacker: str
    must_detect: bool
    public: bool = False  # chats on the registered public system prompt
    queued: bool = False  # the probe is sent while the victim's request is in flight
    tier: bool = False  # the tier's server: a filler pushes the victim's blocks to the tier
    control: bool = False  # the victim's own probe follows the attacker's


CATALOGUE = {
    "a": Case("a", "same key and user", "alice", "alice", must_detect=True),
    "b": Case("b", "public system prompt, another tenant", "alice", "tenant_b",
              must_detect=True, public=True),
    "c": Case("c", "another tenant", "alice", "tenant_b", must_detect=False),
    "d": Case("d", "another user, same key", "alice", "mallory", must_detect=False),
    "e": Case("e", "another key of the tenant, no user", "key_1", "key_2", must_detect=False),
    "f": Case("f", "queued behind the victim, another tenant", "alice", "tenant_b",
              must_detect=False, queued=True),
    "g": Case("g", "another tenant, victim's blocks in the tier", "alice", "tenant_b",
              must_detect=False, tier=True, control=True),
    "h": Case("h", "same key and user, blocks in the tier", "alice", "alice",
              must_detect=True, tier=True),
}  # fmt: skip


def parties(served: ServedGateway) -> dict[str, Party]:
    """Tenant A has two keys; tenant B one. B's attacker claims A's victim's `user` string.
    The tier's server also has tenant C, whose filler requests push blocks out of the pool."""
    key_1, key_2 = served.keys["tenant-a"]
    who = {
        "alice": Party(key_1, "alice"),
        "mallory": Party(key_1, "mallory"),
        "key_1": Party(key_1, None),
        "key_2": Party(key_2, None),
        "tenant_b": Party(served.keys["tenant-b"][0], "alice"),
    }
    if "tenant-c" in served.keys:
        who["filler"] = Party(served.keys["tenant-c"][0], "filler")
    return who


@dataclass(frozen=True, slots=True)
class Probe:
    """One request as its client saw it."""

    latency_s: float
    cached_tokens: int
    prompt_tokens: int
    engine_s: float | None  # from `Server-Timing`
    finished_s: float  # perf_counter() when its answer was parsed
    after_victim: bool | None = None  # queued cases: it finished after the victim's request


@dataclass(frozen=True, slots=True)
class Bodies:
    """The request bodies of one trial: the victim's and the attacker's probe; in tier cases
    also the filler sent between them and the victim's control probe sent after them."""

    victim: dict[str, Any]
    probe: dict[str, Any]
    filler: dict[str, Any] | None = None
    control: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Sent:
    """One trial as the clients saw it: the attacker's probe; in tier cases the victim's
    control probe and how many of the two's cached tokens the tier loaded (from /readyz's
    `kv_tier.loaded_blocks`, read just before the probe and just after the last of them)."""

    probe: Probe
    control: Probe | None = None
    tier_tokens: int | None = None


# -- prompts ---------------------------------------------------------------------------------


class Prompts:
    """Seeded random prompts: token ids from the normal vocabulary, and texts of whole words
    (one token each, mostly), so a prompt's length in tokens is known in advance."""

    def __init__(self, tokenizer: Any, prompt_tokens: int, seed: int) -> None:
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self.normal = [token for token in range(tokenizer.vocab_size) if token not in special]
        pieces = tokenizer.convert_ids_to_tokens(self.normal)
        self.words = [p[1:] for p in pieces if p[:1] == "Ġ" and p[1:].isascii() and p[1:].isalpha()]
        self.length = prompt_tokens
        self.shared = round(SHARED_FRACTION * prompt_tokens)
        self.rng = random.Random(seed)
        self.public_text = self.public_prompt(tokenizer)
        self.public_words = len(self.public_text.split())

    def public_prompt(self, tokenizer: Any) -> str:
        """About `shared` random words whose registered tokens (template included) fill whole
        KV blocks: a hit reuses all of them, and the user's text starts a block of its own, so
        a hit never also reuses the attacker's own earlier probe that began with that token."""
        words = self.rng.choices(self.words, k=self.shared)
        for _ in range(BLOCK_SIZE):  # each pass drops about the tokens past a block boundary
            excess = len(system_prompt_tokens(tokenizer, " ".join(words))) % BLOCK_SIZE
            if excess == 0:
                return " ".join(words)
            words = words[:-excess]
        raise RuntimeError("no public prompt of whole blocks found")

    def tokens(self, count: int) -> list[int]:
        return self.rng.choices(self.normal, k=count)

    def text(self, words: int) -> str:
        return " ".join(self.rng.choices(self.words, k=words))

    def trial(self, case: Case, hit: bool, filler: list[int] | None = None) -> Bodies:
        """The request bodies of one trial (`filler`: the tier cases' filler prompt)."""
        if case.public:
            user_words = self.length - self.shared
            victim = chat(self.public_text, self.text(user_words))
            system = self.public_text if hit else self.text(self.public_words)
            return Bodies(victim, chat(system, self.text(user_words)))
        victim_tokens = self.tokens(self.length * (2 if case.queued else 1))
        probe = self.hit_probe(victim_tokens) if hit else self.tokens(self.length)
        if not case.tier:
            return Bodies({"prompt": victim_tokens}, {"prompt": probe})
        if filler is None:
            raise ValueError(f"case ({case.letter}) needs a filler prompt")
        control = {"prompt": self.hit_probe(victim_tokens)} if case.control else None
        return Bodies({"prompt": victim_tokens}, {"prompt": probe}, {"prompt": filler}, control)

    def hit_probe(self, victim_tokens: list[int]) -> list[int]:
        """The victim's first `shared` tokens and a fresh random tail."""
        return victim_tokens[: self.shared] + self.tokens(self.length - self.shared)


def chat(system: str, user: str) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


# -- sending ---------------------------------------------------------------------------------


def send(
    client: httpx.Client,
    party: Party,
    body: dict[str, Any],
    trace: Callable[[str, dict[str, Any]], None] | None = None,
) -> Probe:
    """One non-streaming greedy request for one token, timed from send to parsed response."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    body = {**body, "max_tokens": 1, "temperature": 0}
    if party.user is not None:
        body["user"] = party.user
    headers = {"Authorization": f"Bearer {party.key}"}
    extensions = {"trace": trace} if trace else None
    started = time.perf_counter()
    response = client.post(path, json=body, headers=headers, extensions=extensions)
    if response.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {response.status_code}: {response.text[:500]}")
    usage = response.json()["usage"]
    finished = time.perf_counter()
    return Probe(
        finished - started,
        usage["prompt_tokens_details"]["cached_tokens"],
        usage["prompt_tokens"],
        engine_seconds(response.headers.get("server-timing", "")),
        finished,
    )


def engine_seconds(server_timing: str) -> float | None:
    """The `engine;dur=` entry of a `Server-Timing` header, in seconds."""
    for entry in server_timing.split(","):
        name, _, duration = entry.strip().partition(";dur=")
        if name == "engine":
            return float(duration) / 1000
    return None


class Sender:
    """The victim's and the attacker's HTTP clients (each its own connection) and a thread
    for victim requests that are not waited for."""

    def __init__(self, url: str, model: str) -> None:
        self.model = model
        self.victim = httpx.Client(base_url=url, timeout=TIMEOUT_S)
        self.attacker = httpx.Client(base_url=url, timeout=TIMEOUT_S)
        self.background = ThreadPoolExecutor(max_workers=1)

    def close(self) -> None:
        self.background.shutdown()
        self.victim.close()
        self.attacker.close()

    def body(self, body: dict[str, Any]) -> dict[str, Any]:
        return {**body, "model": self.model}

    def trial(
        self,
        case: Case,
        who: dict[str, Party],
        bodies: Bodies,
        loaded_blocks: Callable[[], int] | None = None,
    ) -> Sent:
        """The victim's request, then the attacker's probe: after the victim's answer (and
        the filler's, in a tier case), or for a queued case once the victim's body has been
        written to its socket. A tier case reads `loaded_blocks` around the probe and the
        victim's control probe."""
        victim, attacker = who[case.victim], who[case.attacker]
        victim_body, probe_body = self.body(bodies.victim), self.body(bodies.probe)
        if not case.queued:
            send(self.victim, victim, victim_body)
            if bodies.filler is None:
                return Sent(send(self.attacker, attacker, probe_body))
            send(self.victim, who["filler"], self.body(bodies.filler))  # empties the pool
            before = loaded_blocks() if loaded_blocks else 0
            probe = send(self.attacker, attacker, probe_body)
            control = None
            if bodies.control is not None:
                control = send(self.victim, victim, self.body(bodies.control))
            if loaded_blocks is None:
                return Sent(probe, control)
            return Sent(probe, control, (loaded_blocks() - before) * BLOCK_SIZE)
        sent = threading.Event()

        def on_event(event: str, _: dict[str, Any]) -> None:
            if event == BODY_SENT:
                sent.set()

        in_flight = self.background.submit(send, self.victim, victim, victim_body, on_event)
        if not sent.wait(TIMEOUT_S):
            in_flight.result(TIMEOUT_S)  # raises what kept it from being sent
            raise RuntimeError("the victim's request was never sent")
        probe = send(self.attacker, attacker, probe_body)
        victim_finished = in_flight.result(TIMEOUT_S).finished_s
        return Sent(replace(probe, after_victim=probe.finished_s > victim_finished))


# -- statistics ------------------------------------------------------------------------------


def ks_hits_faster(hit: Sequence[float], miss: Sequence[float]) -> tuple[float, float]:
    """One-sided two-sample KS test whose alternative is that hits are stochastically faster
    (their CDF lies above the misses'): (statistic, p-value)."""
    test = ks_2samp(hit, miss, alternative="greater")
    return float(test.statistic), float(test.pvalue)


def group_stats(probes: Sequence[Probe]) -> dict[str, Any]:
    """Latency quantiles in milliseconds and the cached tokens of one group of probes."""
    latencies = [probe.latency_s * 1000 for probe in probes]
    cached = [probe.cached_tokens for probe in probes]
    return {
        "probes": len(probes),
        "median_ms": statistics.median(latencies),
        "p10_ms": percentile(latencies, 0.1),
        "p90_ms": percentile(latencies, 0.9),
        "cached_tokens_sum": sum(cached),
        "cached_tokens_min": min(cached),
        "cached_tokens_max": max(cached),
        "median_prompt_tokens": statistics.median(probe.prompt_tokens for probe in probes),
        # Queued cases: probes that waited for (or were batched with) the victim's prefill.
        "finished_after_victim": sum(probe.after_victim is True for probe in probes),
    }


def server_timing_test(hits: Sequence[Probe], misses: Sequence[Probe]) -> dict[str, Any] | None:
    """The KS test on the engine times of `Server-Timing`; None if a response had none."""
    engine_hit = [p.engine_s for p in hits if p.engine_s is not None]
    engine_miss = [p.engine_s for p in misses if p.engine_s is not None]
    if len(engine_hit) < len(hits) or len(engine_miss) < len(misses):
        return None
    statistic, p_value = ks_hits_faster(engine_hit, engine_miss)
    return {
        "ks_statistic": statistic,
        "p_value": p_value,
        "hit_median_ms": statistics.median(engine_hit) * 1000,
        "miss_median_ms": statistics.median(engine_miss) * 1000,
    }


def tier_check(trials: Sequence[Sent]) -> dict[str, Any]:
    """Whether the tier served every cached token of a tier case's probes and controls (none
    came from the pool: in each trial the blocks it loaded account for all of them), and
    every control probe was cached."""
    controls = [trial.control for trial in trials if trial.control is not None]
    cached = [
        trial.probe.cached_tokens + (trial.control.cached_tokens if trial.control else 0)
        for trial in trials
    ]
    from_tier = [trial.tier_tokens for trial in trials]
    served = sum(tokens == tier for tokens, tier in zip(cached, from_tier, strict=True))
    return {
        "cached_tokens": sum(cached),
        "tier_tokens": sum(tier or 0 for tier in from_tier),
        "trials_served_by_tier": served,
        "control": group_stats(controls) if controls else None,
        "held": served == len(trials) and all(control.cached_tokens > 0 for control in controls),
    }


def case_result(
    case: Case,
    hits: Sequence[Probe],
    misses: Sequence[Probe],
    tier: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The KS test on client timings, each group's stats, the verdict, and the KS test on
    server timings beside it; a tier case's `tier_check` too."""
    statistic, p_value = ks_hits_faster([p.latency_s for p in hits], [p.latency_s for p in misses])
    hit_stats, miss_stats = group_stats(hits), group_stats(misses)
    if case.must_detect:
        timing_held = p_value < DETECTED_P
        cache_held = hit_stats["cached_tokens_min"] > 0 and miss_stats["cached_tokens_max"] == 0
    else:
        timing_held = p_value >= NOT_DETECTED_P
        cache_held = hit_stats["cached_tokens_max"] == 0 and miss_stats["cached_tokens_max"] == 0
    verdict = {
        "expected": "detected" if case.must_detect else "not detected",
        "required": f"p < {DETECTED_P:g}" if case.must_detect else f"p >= {NOT_DETECTED_P:g}",
        "timing_held": timing_held,
        "cache_held": cache_held,
        "held": timing_held and cache_held,
    }
    if tier is not None:
        verdict["tier_held"] = tier["held"]
        verdict["held"] = verdict["held"] and tier["held"]
    return {
        **asdict(case),
        "ks_statistic": statistic,
        "p_value": p_value,
        "hit": hit_stats,
        "miss": miss_stats,
        "server_timing": server_timing_test(hits, misses),
        **({"tier_check": tier} if tier is not None else {}),
        "verdict": verdict,
        "latencies_ms": {
            "hit": [p.latency_s * 1000 for p in hits],
            "miss": [p.latency_s * 1000 for p in misses],
        },
    }


# -- the audit -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Target:
    """A served gateway as the cases see it: the clients and parties, and on the tier's
    server the filler prompt and a reading of the blocks the tier has loaded so far."""

    sender: Sender
    who: dict[str, Party]
    filler: list[int] | None = None
    loaded_blocks: Callable[[], int] | None = None


def run_case(case: Case, target: Target, prompts: Prompts, samples: int) -> dict[str, Any]:
    """Warm-up trials, then `samples` hits and `samples` misses in a shuffled order."""
    if case.tier and target.loaded_blocks is None:
        raise ValueError(f"case ({case.letter}) runs on the tier's server")
    labels = [True] * samples + [False] * samples
    prompts.rng.shuffle(labels)
    trials: dict[bool, list[Sent]] = {True: [], False: []}

    def trial(hit: bool) -> Sent:
        bodies = prompts.trial(case, hit, target.filler)
        return target.sender.trial(case, target.who, bodies, target.loaded_blocks)

    for index in range(WARMUP_TRIALS):
        trial(hit=index % 2 == 0)
    for hit in tqdm(labels, desc=f"case ({case.letter})", file=sys.stderr):
        trials[hit].append(trial(hit))
    hits = [sent.probe for sent in trials[True]]
    misses = [sent.probe for sent in trials[False]]
    tier = tier_check([*trials[True], *trials[False]]) if case.tier else None
    return case_result(case, hits, misses, tier)


def audit_model(directory: Path, tokenizer_dir: Path) -> Path:
    """A seeded random Llama whose prefill of a few hundred tokens clearly costs more than
    the HTTP path's noise, with SmolLM2's tokenizer and chat template (so chats work)."""
    return tiny_chat_model(
        directory,
        tokenizer_dir,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        max_position_embeddings=8192,
    )


@contextmanager
def model_directory(model: str) -> Iterator[Path]:
    """`tiny` (written to a temporary directory), `embedded`, or a model directory."""
    if model == "embedded":
        yield embedded_model_dir()
    elif model == "tiny":
        with tempfile.TemporaryDirectory(prefix="timing-audit-") as scratch:
            yield audit_model(Path(scratch) / "audit-tiny", embedded_model_dir())
    else:
        yield Path(model).absolute()


@contextmanager
def plain_server(model_dir: Path, prompts: Prompts) -> Iterator[ServedGateway]:
    """The server of cases (a)-(f): a pool that never fills, and the public system prompt."""
    # Each tenant's quota is a quarter of the pool (counted in fp32, the largest KV):
    # quotas never refuse a request, and the pool itself never fills.
    quota = KV_CACHE_BYTES // (BLOCK_SIZE * fp32_kv_bytes_per_token(model_dir)) // 4
    tenants = [ServedTenant("tenant-a", keys=2), ServedTenant("tenant-b")]
    settings = {"KV_CACHE_BYTES": str(KV_CACHE_BYTES)}
    public = {PUBLIC_PREFIX: prompts.public_text}
    with served_tenants(model_dir, settings, tenants, quota, public) as served:
        yield served


@contextmanager
def tier_server(
    model_dir: Path, prompt_tokens: int, trials: int, metrics_token: str
) -> Iterator[ServedGateway]:
    """The server of the tier cases: a second tier (`TIER_KIND`), a pool of one block more
    than a prompt and its answer take, and tenant C for the fillers.

    Only the filler evicts, and only from the pool: in the `trials` to come nothing leaves
    the tier. Each tenant's quota (in the pool, and so in the tier) holds two prompts' blocks
    per trial (a victim's and a probe's), and the tier all tenants' quotas at once. Eviction
    from the tier would make the audit test less than it says: eviction by value drops a
    fresh prompt's first blocks (the cheapest to compute) before older prompts' later ones,
    and a chain whose first block is gone is never read back.
    """
    kv_dtype = resolve_dtype("auto", resolve_device("auto"))  # what the server will choose
    block_bytes = BLOCK_SIZE * fp32_kv_bytes_per_token(model_dir) * kv_dtype.itemsize // 4
    pool_blocks = -(-(prompt_tokens + 1) // BLOCK_SIZE) + 1
    quota_blocks = 2 * trials * pool_blocks
    tenants = [
        ServedTenant("tenant-a", keys=2), ServedTenant("tenant-b"), ServedTenant("tenant-c")
    ]  # fmt: skip
    tier_blocks = len(tenants) * quota_blocks + 2 * CALIBRATION_SAMPLES
    settings = {
        "KV_CACHE_BYTES": str(pool_blocks * block_bytes),
        "KV_TIER": TIER_KIND,
        "KV_TIER_CAPACITY_BYTES": str(tier_blocks * (block_bytes + TIER_ENTRY_SLACK)),
        "METRICS_TOKEN": metrics_token,
    }
    with served_tenants(model_dir, settings, tenants, quota_blocks) as served:
        yield served


def engine_now(url: str, metrics_token: str) -> dict[str, Any]:
    """The engine's description in /readyz, as the metrics scraper reads it now."""
    headers = {"Authorization": f"Bearer {metrics_token}"}
    ready = httpx.get(f"{url}/readyz", headers=headers, timeout=30).json()
    engine: dict[str, Any] = ready["engine"]
    return engine


def run_cases(
    letters: str,
    served: ServedGateway,
    model_name: str,
    prompts: Prompts,
    samples: int,
    metrics_token: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Run cases against one server; with `metrics_token` it is the tier's server, whose
    filler takes every block of its pool."""
    sender = Sender(served.url, model_name)
    target = Target(sender, parties(served))
    if metrics_token is not None:
        token = metrics_token

        def loaded_blocks() -> int:
            return int(engine_now(served.url, token)["kv_tier"]["loaded_blocks"])

        # One filler prompt for the whole run: read back from the tier after its first use,
        # it still takes a block of the pool for each of its own.
        filler = prompts.tokens(served.ready["engine"]["kv_blocks"] * BLOCK_SIZE)
        target = replace(target, filler=filler, loaded_blocks=loaded_blocks)
    try:
        return {letter: run_case(CATALOGUE[letter], target, prompts, samples) for letter in letters}
    finally:
        sender.close()


def audit(model: str, samples: int, prompt_tokens: int, cases: str, seed: int) -> dict[str, Any]:
    """Run the cases against a fresh `prefixgate serve`, the tier cases against one of their
    own after the others, and return the result object."""
    started = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    engines: dict[str, dict[str, Any]] = {}
    plain = "".join(letter for letter in cases if not CATALOGUE[letter].tier)
    tiered = "".join(letter for letter in cases if CATALOGUE[letter].tier)
    with model_directory(model) as model_dir:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        prompts = Prompts(tokenizer, prompt_tokens, seed)
        if plain:
            with plain_server(model_dir, prompts) as served:
                engines["engine"] = served.ready.get("engine", {})
                results |= run_cases(plain, served, model_dir.name, prompts, samples)
        if tiered:
            metrics_token = secrets.token_urlsafe(24)
            trials = len(tiered) * (WARMUP_TRIALS + 2 * samples)
            with tier_server(model_dir, prompt_tokens, trials, metrics_token) as served:
                engines.setdefault("engine", served.ready.get("engine", {}))
                results |= run_cases(
                    tiered, served, model_dir.name, prompts, samples, metrics_token
                )
                # Read at the end: what the cost rule loaded and recomputed in all.
                engines["tier_engine"] = engine_now(served.url, metrics_token)
    return {
        "benchmark": "timing_audit",
        "machine": machine_info(),
        "model": model,
        "model_name": model_dir.name,
        **engines,
        "prompt_tokens": prompt_tokens,
        "samples_per_group": samples,
        "seed": seed,
        "thresholds": {"detected_p": DETECTED_P, "not_detected_p": NOT_DETECTED_P},
        "cases": {letter: results[letter] for letter in cases},
        "all_held": all(result["verdict"]["held"] for result in results.values()),
        "wall_s": time.perf_counter() - started,
    }


# -- output ----------------------------------------------------------------------------------


def print_table(result: dict[str, Any]) -> None:
    """One line per case on stderr: p-values, medians, cached tokens, verdict."""
    lines = [
        f"{'case':<46}{'p (client)':>11}{'p (server)':>11}{'hit ms':>9}{'miss ms':>9}"
        f"{'cached hit/miss':>17}  verdict"
    ]
    for letter, case in result["cases"].items():
        server = case["server_timing"]
        server_p = "-" if server is None else f"{server['p_value']:.2g}"
        cached = f"{case['hit']['cached_tokens_sum']}/{case['miss']['cached_tokens_sum']}"
        verdict = case["verdict"]
        held = "held" if verdict["held"] else "DID NOT HOLD"
        lines.append(
            f"({letter}) {case['title']:<42}{case['p_value']:>11.2g}{server_p:>11}"
            f"{case['hit']['median_ms']:>9.1f}{case['miss']['median_ms']:>9.1f}{cached:>17}"
            f"  {verdict['expected']}: {held}"
        )
        if "tier_check" in case:
            lines.append(f"    {tier_line(case['tier_check'])}")
    lines.append(f"wall time {result['wall_s']:.0f} s")
    print("\n".join(lines), file=sys.stderr)


def tier_line(tier: dict[str, Any]) -> str:
    """A tier case's check in words: trials whose cached tokens all came from the tier, and
    the control probes."""
    line = (
        f"tier: {tier['tier_tokens']} of {tier['cached_tokens']} cached tokens loaded from "
        f"the tier, all of them in {tier['trials_served_by_tier']} trials"
    )
    control = tier["control"]
    if control is not None:
        line += (
            f"; {control['probes']} control probes, cached min {control['cached_tokens_min']}, "
            f"median {control['median_ms']:.1f} ms"
        )
    return line + ("" if tier["held"] else ": DID NOT HOLD")


def plot_cdfs(path: str, result: dict[str, Any]) -> None:
    """The empirical CDFs of hit and miss latencies, one panel per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(result["cases"].values())
    columns = min(3, len(cases))
    rows = -(-len(cases) // columns)
    figure, grid = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.2 * rows), squeeze=False)
    for axes, case in zip(grid.flat, cases, strict=False):
        for label, color in (("hit", "#cc3311"), ("miss", "#0077bb")):
            axes.ecdf(case["latencies_ms"][label], label=label, color=color)
        axes.set_title(f"({case['letter']}) {case['title']}\np = {case['p_value']:.2g}", fontsize=9)
        axes.set_xlabel("probe latency (ms)")
        axes.legend(fontsize=8)
    for axes in list(grid.flat)[len(cases) :]:
        axes.axis("off")
    figure.suptitle(
        f"{result['model_name']}, {result['prompt_tokens']} tokens, "
        f"{result['samples_per_group']} probes per group"
    )
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=250, help="probes per group")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="L, a probe's length")
    parser.add_argument("--model", default="tiny", help="tiny, embedded or a model directory")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of a-h")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", help="also write the JSON result to this file")
    parser.add_argument("--plot", help="draw each case's latency CDFs to this PNG")
    args = parser.parse_args(argv)
    cases = "".join(args.cases.split(","))
    if not cases or not set(cases) <= set(CASES) or len(set(cases)) != len(cases):
        parser.error(f"--cases takes distinct letters of {','.join(CASES)}")
    if args.samples < 2:
        parser.error("--samples must be at least 2")
    if not 128 <= args.prompt_tokens <= 2048:  # a public prompt must span 4 whole blocks
        parser.error("--prompt-tokens must be 128-2048")
    torch.set_grad_enabled(False)
    result = audit(args.model, args.samples, args.prompt_tokens, cases, args.seed)
    emit(result, args.json, args.out)
    print_table(result)
    if args.plot:
        plot_cdfs(args.plot, result)
    return result


if __name__ == "__main__":
    main()
