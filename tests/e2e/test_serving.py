"""The default profile served for real: endpoints, speculation counters, acceptance, and exactness."""


from __future__ import annotations

import json
import re
from collections import Counter

import numpy as np
import pytest
import requests
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from kimi_eagle.cpu_kernels import expected_build, this_cpu
from kimi_eagle.fixtures.pair_spec import HELDOUT_PROMPTS_FILE
from kimi_eagle.fixtures.train_target import distinct_bigram_ratio
from tests.helpers.chi_square import chi_square_p_value
from tests.helpers.server import Server

pytestmark = pytest.mark.e2e


HELDOUT = json.loads(HELDOUT_PROMPTS_FILE.read_text())


K = 3  # num_speculative_tokens of the tiny-cpu profile


def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=600)


def spec_counters(server: Server) -> dict[str, float]:
    """vLLM's speculative-decoding counters: drafts, draft tokens, accepted tokens, accepted per position."""
    out: dict[str, float] = {}
    text = requests.get(f"{server.url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:spec_decode_") and sample.name.endswith("_total"):
                key = sample.name.removeprefix("vllm:spec_decode_").removesuffix("_total")
                if "position" in sample.labels:
                    key += f"[{sample.labels['position']}]"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def acceptance_between(before: dict[str, float], after: dict[str, float]) -> tuple[float, list[float]]:
    drafts = after["num_drafts"] - before["num_drafts"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    per_position = [(after[f"num_accepted_tokens_per_pos[{i}]"] - before[f"num_accepted_tokens_per_pos[{i}]"]) / drafts
                    for i in range(K)]
    return 1 + accepted / drafts, per_position


def complete(server: Server, prompts: list[str], max_tokens: int, temperature: float, seed: int | None = None,
             n: int = 1, **sampling: float) -> list[list[int]]:
    """Token ids of each completion, in prompt order (and sample order within a prompt); `sampling`: vLLM's own
    sampling parameters (min_p, top_k, ...)."""
    response = client(server).completions.create(
        model=server.model, prompt=prompts, max_tokens=max_tokens, temperature=temperature, seed=seed, n=n,
        extra_body={"ignore_eos": True, "return_token_ids": True, **sampling})
    choices = sorted(response.choices, key=lambda c: c.index)
    return [c.model_extra["token_ids"] for c in choices]


def test_engine_starts_with_draft_and_aux_layers(spec_server: Server) -> None:
    log = spec_server.log.read_text()
    assert "Using auxiliary layers from speculative config: (2, 4, 6)" in log, "no aux layers 2, 4, 6 captured"
    assert "EAGLE drafter KV cache initialized" in log, "the draft got no KV cache: is it loaded?"
    isa = this_cpu()  # the plugin names the ISA and the kernel build the engine runs, in every server's log
    said = f"kimi-eagle: CPU {isa.model}: {isa.name}; vLLM CPU kernels {expected_build(isa)} (built for"
    assert said in log, f"the log does not say which ISA and kernel build served: expected {said!r}"
    print(f"spec server healthy after {spec_server.ready_s:.0f}s")


def test_kv_cache_capacity_is_the_profiles_on_any_machine(spec_server: Server) -> None:
    """512 MiB stated in bytes, whatever the machine's memory: at least the 16 x 2,048 tokens the profile admits, at
    most 512 MiB / 14,848 bytes a token of target + draft (vLLM logged 36,096 tokens on an Intel Xeon with AMX,
    36,144 on an AMD EPYC with AVX-512 and no AMX: the count differs by ISA, the bounds hold on each)."""
    log = spec_server.log.read_text()
    assert "Explicitly set (0.5/" in log, "the KV cache was not sized by --kv-cache-memory-bytes (0.5 GiB)"
    found = re.search(r"CPU KV cache size: ([\d,]+) tokens", log)
    assert found, "vLLM logged no KV cache size"
    tokens = int(found.group(1).replace(",", ""))
    assert 16 * 2048 <= tokens <= (512 << 20) // 14_848, f"KV cache of {tokens} tokens, outside the profile's bounds"


def test_models_endpoint(spec_server: Server) -> None:
    served = [m.id for m in client(spec_server).models.list()]
    assert served == [spec_server.model], f"/v1/models lists {served}, not the profile's {spec_server.model}"


@pytest.mark.parametrize("stream", [False, True])
def test_completions(spec_server: Server, stream: bool) -> None:
    kwargs = dict(model=spec_server.model, prompt=HELDOUT[0], max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client(spec_server).completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        response = client(spec_server).completions.create(**kwargs)
        text, usage = response.choices[0].text, response.usage
    assert text.strip(), "an empty completion"
    assert usage.completion_tokens == 24, f"usage says {usage.completion_tokens} tokens, 24 asked for (ignore_eos)"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_completions(spec_server: Server, stream: bool) -> None:
    kwargs = dict(model=spec_server.model, max_tokens=24, temperature=0,
                  messages=[{"role": "user", "content": "Describe what the find command does."}],
                  extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client(spec_server).chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
    else:
        response = client(spec_server).chat.completions.create(**kwargs)
        text, usage = response.choices[0].message.content, response.usage
    assert text.strip(), "an empty chat answer"
    assert usage.completion_tokens == 24, f"usage says {usage.completion_tokens} tokens, 24 asked for (ignore_eos)"


def test_metrics_show_drafted_and_accepted_tokens(spec_server: Server) -> None:
    complete(spec_server, HELDOUT[:2], max_tokens=32, temperature=0)
    counters = spec_counters(spec_server)
    assert counters["num_draft_tokens"] > 0, f"no drafted tokens on /metrics: {counters}"
    assert counters["num_accepted_tokens"] > 0, f"no accepted tokens on /metrics: {counters}"


def test_greedy_acceptance_and_text_diversity_on_heldout_prompts(spec_server: Server) -> None:
    before = spec_counters(spec_server)
    outputs = complete(spec_server, HELDOUT, max_tokens=128, temperature=0)
    mean_length, per_position = acceptance_between(before, spec_counters(spec_server))
    diversity = float(np.mean([distinct_bigram_ratio(o) for o in outputs]))
    print(f"T=0, k={K}, {len(HELDOUT)} held-out prompts x 128 tokens: mean acceptance length {mean_length:.2f}, "
          f"per position {[round(p, 3) for p in per_position]}; distinct-bigram ratio {diversity:.3f}")
    assert mean_length >= 2.5, f"greedy mean acceptance length {mean_length:.2f}, expected >= 2.5"
    # loops would make speculation look better than it is
    assert diversity >= 0.4, f"distinct-bigram ratio {diversity:.3f}: the output loops"


def test_speculation_does_not_change_greedy_output(spec_server: Server, plain_server: Server) -> None:
    with_draft = complete(spec_server, HELDOUT, max_tokens=64, temperature=0)
    without = complete(plain_server, HELDOUT, max_tokens=64, temperature=0)
    same_prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                   for x, y in zip(with_draft, without)]
    print(f"identical leading tokens per prompt (of 64): {same_prefix}")
    assert min(same_prefix) >= 32, f"greedy output parts from the target alone's before token 32: {same_prefix}"


def test_low_temperature_acceptance_matches_greedy(spec_server: Server) -> None:
    before = spec_counters(spec_server)
    complete(spec_server, HELDOUT, max_tokens=128, temperature=0)
    greedy, _ = acceptance_between(before, middle := spec_counters(spec_server))
    complete(spec_server, HELDOUT, max_tokens=128, temperature=0.01, seed=7)
    cold, _ = acceptance_between(middle, spec_counters(spec_server))
    print(f"mean acceptance length: T=0 {greedy:.2f}, T=0.01 {cold:.2f}")
    assert abs(cold - greedy) <= 0.10 * greedy, f"acceptance at T=0.01 {cold:.2f} is not T=0's {greedy:.2f}"


def test_t1_acceptance_follows_target_probabilities_and_pays(spec_server: Server) -> None:
    """At T=1 each position should be accepted at the rate the target's own probabilities predict, and the pair is
    peaked enough there for the draft to pay (pair_spec.TARGET_LOGIT_SCALE)."""
    from kimi_eagle.fixtures.acceptance_model import predicted_acceptance
    from kimi_eagle.fixtures.pair_spec import AUX_LAYER_IDS, DRAFT_DIR, TARGET_DIR
    from kimi_eagle.fixtures.tokenizer import load_tokenizer
    from kimi_eagle.torch_pair import load_draft_model, load_target_model

    prompts = HELDOUT[:8]
    before = spec_counters(spec_server)
    outputs = complete(spec_server, prompts, max_tokens=128, temperature=1.0, seed=11, n=4)
    after = spec_counters(spec_server)
    # Drafting all the way: every step drafts, and a step gives at most K + 1 tokens.
    drafts = after["num_drafts"] - before["num_drafts"]
    assert drafts >= 4 * 8 * 128 / (K + 1), f"only {drafts:.0f} drafts at T=1: the draft was not run throughout"
    measured_length, measured = acceptance_between(before, after)
    diversity = float(np.mean([distinct_bigram_ratio(o) for o in outputs]))
    tokenizer = load_tokenizer(TARGET_DIR)
    prompt_ids = [tokenizer.encode(p).ids for p in prompts for _ in range(4)]
    sequences = [p + o for p, o in zip(prompt_ids, outputs)]
    target = load_target_model(TARGET_DIR)
    predicted = predicted_acceptance(target, load_draft_model(DRAFT_DIR, target)[0],
                                     AUX_LAYER_IDS, sequences, [len(p) for p in prompt_ids], temperature=1.0,
                                     steps=K, anchors=384)
    print(f"T=1 per-position acceptance: measured {[round(x, 3) for x in measured]} "
          f"(mean length {measured_length:.2f}), predicted {[round(x, 3) for x in predicted]}; distinct-bigram "
          f"ratio {diversity:.3f}")
    for position, (got, want) in enumerate(zip(measured, predicted), start=1):
        # The CPU expand fault accepted nothing. The prediction averages 384 anchors of acceptance 0.4-0.8: its own
        # standard error is up to 0.025, so 0.06 is about two and a half of them.
        assert abs(got - want) <= 0.06, f"T=1 acceptance at position {position}: {got:.3f}, predicted {want:.3f}"
    assert measured_length >= 2.5, f"T=1 mean acceptance length {measured_length:.2f}, expected >= 2.5 at k={K}"
    assert diversity >= 0.4, f"distinct-bigram ratio {diversity:.3f} at T=1: the output loops"


@pytest.mark.parametrize("filtering", [{}, {"min_p": 0.05}], ids=["plain-sampling", "min_p"])
def test_t1_samples_follow_the_target_distribution(spec_server: Server, plain_server: Server,
                                                   filtering: dict[str, float]) -> None:
    """Chi-square two-sample test on the 2nd..4th generated tokens (the ones speculation decides); with `min_p`,
    which vLLM 0.32 refuses under speculation and the plugin applies to every verified position."""
    prompt = [HELDOUT[1]]
    samples = {name: [] for name in ("spec", "plain")}
    before = spec_counters(spec_server)
    for name, server in (("spec", spec_server), ("plain", plain_server)):
        for seed in range(6):
            samples[name] += [tuple(o[1:4]) for o in complete(server, prompt, max_tokens=4, temperature=1.0,
                                                              seed=1000 * seed, n=64, **filtering)]
    # 384 samples, each drafted at least once after its first token: else this compares the target with itself.
    drafts = spec_counters(spec_server)["num_drafts"] - before["num_drafts"]
    assert drafts >= 384, f"only {drafts:.0f} drafts for 384 samples: the target was compared with itself"
    kinds = [len({s[position] for s in samples["plain"]}) for position in range(3)]
    # With one or two tokens left at every position, any engine would pass: the comparison would test nothing.
    assert max(kinds) >= 3, f"distinct tokens per position {kinds}: too few to compare distributions"
    for position in range(3):
        counts = {name: Counter(s[position] for s in rows) for name, rows in samples.items()}
        common = [t for t, _ in (counts["spec"] + counts["plain"]).most_common(12)]
        table = [[counts[name][t] for t in common] + [sum(counts[name].values()) - sum(counts[name][t] for t in common)]
                 for name in ("spec", "plain")]
        table = np.array(table)
        p_value = chi_square_p_value(table[:, table.sum(axis=0) > 0])  # a peaked target may leave no "other"
        print(f"generated token {position + 2} ({kinds[position]} distinct): chi-square p = {p_value:.3f}")
        assert p_value > 0.001, (f"token {position + 2} sampled with the draft {filtering or ''} does not follow the "
                                 f"target alone's distribution (chi-square p = {p_value:.2g})")

