"""End to end: two ``kvtier serve`` replicas of the default model behind a router.

``tools/cluster/launch.py``'s :class:`Cluster` starts the replicas (own
ports, SSD directories and KV-event ports); the same replicas are then
put behind ``sglang-router --policy cache_aware`` and behind the
KV-event router (``tools/cluster/event_router.py``). Two conversations run
at once (concurrency 2, so the router has a choice), each with its own long
system prompt and three turns: every later turn must find the previous
prompt cached on the replica it lands on (affinity). A greedy answer
through the router equals the answer of a replica asked directly.
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tools.cluster.launch import Cluster

pytestmark = [pytest.mark.e2e, pytest.mark.model, pytest.mark.slow, pytest.mark.timeout(1500)]

TOPICS = ("a lighthouse keeper's evening log", "an orchard's spring pruning plan")


def _system(topic: str, policy: str) -> str:
    return (f"[{policy}] You help with {topic}. Answer in short, plain sentences, naming the "
            "entries one by one and never inventing facts that are not in the notes. ") * 6


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int = 6) -> httpx.Response:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return r


def _conversation(url: str, topic: str, policy: str, out: list[dict[str, Any]]) -> None:
    messages = [{"role": "system", "content": _system(topic, policy)}]
    for turn in range(3):
        messages.append({"role": "user", "content": f"Question {turn}: what comes next in {topic}?"})
        r = _chat(url, messages)
        usage = r.json()["usage"]
        out.append({"turn": turn, "prompt": usage["prompt_tokens"],
                    "cached": usage["prompt_tokens_details"]["cached_tokens"],
                    "replica": r.headers.get("x-kvtier-replica")})
        messages.append({"role": "assistant", "content": f"Step {turn} is noted."})


def _run_pair(url: str, policy: str) -> list[list[dict[str, Any]]]:
    results: list[list[dict[str, Any]]] = [[], []]
    threads = [threading.Thread(target=_conversation, args=(url, TOPICS[k], policy, results[k]))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert all(len(r) == 3 for r in results), results
    return results


def _served(url: str) -> int:
    eng = httpx.get(f"{url}/stats", timeout=30).json()["engine"]
    batch = eng.get("batch", {}).get("batch", {}).get("requests", {}).get("admitted", 0)
    return int(eng["gateway"]["token"]["requests"]["admitted"]) + int(batch)


def test_replicas_behind_cache_aware_and_event_routers_keep_affinity_and_answer_right(
        tmp_path: Path) -> None:
    """Through sglang-router cache_aware and through the KV-event router, turns 2 and 3 of each of
    two concurrent conversations find >= 90 % of the previous prompt cached (they landed on the
    replica holding it; the event router's header names one replica per conversation); every
    request reached a replica (per-replica /stats); a greedy answer through each router equals a
    replica's direct answer; the cluster stops with every replica exiting 0."""
    with Cluster(2, tmp_path, policy=None) as cluster:
        urls = [r.url for r in cluster.replicas]
        question = [{"role": "user", "content": "Name three birds that nest on sea cliffs."}]
        direct = _chat(urls[1], question, max_tokens=16).json()["choices"][0]["message"]["content"]
        for policy in ("cache_aware", "events"):
            before = sum(_served(u) for u in urls)
            router = cluster.route(policy)
            results = _run_pair(router.url, policy)
            for conv in results:
                for prev, turn in itertools.pairwise(conv):
                    assert turn["cached"] >= 0.9 * prev["prompt"], (policy, conv)
                if policy == "events":
                    assert len({t["replica"] for t in conv}) == 1, conv
            routed = _chat(router.url, question, max_tokens=16)
            assert routed.json()["choices"][0]["message"]["content"] == direct, policy
            assert sum(_served(u) for u in urls) - before == 7, policy
    assert cluster.exit_codes == [0, 0]
