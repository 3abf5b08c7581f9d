"""What trees, a target-candidate fallback and confidence-gated drafting could give, on
recorded greedy outputs (greedy_outputs.py), without running the model again.

Greedy acceptance is a function of the target's greedy continuation alone: a cycle accepts
the longest drafted path that matches it. So replaying each question's output cycle by
cycle with a drafter gives its exact mean acceptance length, for any tree, and with a cost
line T(n) = a + b·(n − 1) for a forward over n tokens its speedup over plain decoding.

The drafter is SuffixDecoding's scoring as exactspec's SuffixProposer has it (the longest
earlier n-gram of 1..8 tokens; a continuation's score = its frequency × n/(n+1)), grown
best-first into a tree of at most k nodes with at most `branches` children per node (path
probability = product of scores, stopping below a threshold); optionally Token Recycling's
fallback (Luo et al. 2024): the target's own top-8 candidates the last time it scored each
token, scored by their probability (within the request, or kept across requests).

    python simulate.py outputs.json trees      # mean acceptance length, chains vs trees
    python simulate.py outputs.json gating A B # speedup with forward cost A + B·(n−1) ms
"""

import heapq
import json
import math
import sys
from collections import defaultdict

MIN_MATCH, MAX_MATCH = 1, 8


class Index:
    """n-gram → {next token: count} over the request's own text (as SuffixProposer)."""

    def __init__(self):
        self.next = defaultdict(lambda: defaultdict(int))

    def add(self, tokens, i):
        for n in range(MIN_MATCH, min(MAX_MATCH, i) + 1):
            self.next[tuple(tokens[i - n:i])][tokens[i]] += 1

    def candidates(self, tail):
        """{token: score} for the longest earlier match of ``tail``'s suffix."""
        for n in range(min(MAX_MATCH, len(tail)), MIN_MATCH - 1, -1):
            followers = self.next.get(tuple(tail[-n:]))
            if followers:
                total = sum(followers.values())
                return {t: c / total * n / (n + 1) for t, c in followers.items()}
        return {}


def tree(index, recycled, context, k, branches, threshold, use_suffix, use_recycling):
    """Best-first tree of ≤ k nodes: [(token, parent index or -1)]."""
    nodes, heap, counter = [], [], [0]

    def push(parent, tail, probability):
        candidates = index.candidates(tail) if use_suffix else {}
        if use_recycling and tail[-1] in recycled:
            for token, logprob in recycled[tail[-1]]:
                candidates[token] = max(candidates.get(token, 0.0), math.exp(logprob))
        best = sorted(((s, t) for t, s in candidates.items()), reverse=True)[:branches]
        for score, token in best:
            if probability * score >= threshold:
                counter[0] += 1
                heapq.heappush(heap, (-probability * score, counter[0], token, parent, tail))

    push(-1, context[-MAX_MATCH:], 1.0)
    while heap and len(nodes) < k:
        negative, _, token, parent, tail = heapq.heappop(heap)
        nodes.append((token, parent))
        push(len(nodes) - 1, (list(tail) + [token])[-MAX_MATCH:], -negative)
    return nodes


def accepted(nodes, truth):
    """Length of the longest root path of ``nodes`` matching ``truth``."""
    at, n = -1, 0
    while n < len(truth):
        children = [i for i, (t, p) in enumerate(nodes) if p == at and t == truth[n]]
        if not children:
            break
        at, n = children[0], n + 1
    return n


def replay(data, k, branches, threshold, use_suffix=True, use_recycling=False, shared=False,
           cost=None):
    """Mean acceptance length, drafted tokens per cycle, per group; and the speedup under
    ``cost`` (a, b) when given."""
    cycles = drafted = accepted_total = 0
    seconds = tokens = 0.0
    by_group = defaultdict(lambda: [0, 0, 0.0])
    recycled = {}
    for question in data:
        sequence = question["prompt"] + question["output"]
        start = len(question["prompt"])
        index = Index()
        if not shared:
            recycled = {}
        for i in range(1, start):
            index.add(sequence, i)
        t = start
        while t < len(sequence):
            nodes = tree(index, recycled, sequence[:t], k, branches, threshold, use_suffix,
                         use_recycling)
            a = accepted(nodes, sequence[t:])
            advance = min(a + 1, len(sequence) - t)
            for i in range(t, t + advance):
                index.add(sequence, i)
                j = i - start
                recycled[sequence[i - 1]] = list(zip(question["top"][j], question["topp"][j]))
            step = (cost[0] + cost[1] * len(nodes)) if cost else 1.0
            t += advance
            cycles, drafted, accepted_total = cycles + 1, drafted + len(nodes), accepted_total + a
            seconds, tokens = seconds + step, tokens + advance
            entry = by_group[question["group"]]
            entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + advance, entry[2] + step
    groups = " ".join(f"{g[:5]}={v[1] / v[0]:.2f}" for g, v in by_group.items())
    speed = ""
    if cost:
        speed = f" speedup {tokens * cost[0] / seconds:.3f} (" + " ".join(
            f"{g[:5]}={v[1] * cost[0] / v[2]:.2f}" for g, v in by_group.items()) + ")"
    return (f"mean acceptance length {(accepted_total + cycles) / cycles:.3f}, drafted/cycle "
            f"{drafted / cycles:.2f}{speed}; by group: {groups}")


if __name__ == "__main__":
    data = json.load(open(sys.argv[1]))
    if sys.argv[2] == "trees":
        for k in (1, 2, 4, 8):
            print(f"k={k} suffix chain:", replay(data, k, 1, 0.1))
            for branches, threshold in ((3, 0.1), (3, 0.02)):
                print(f"k={k} suffix tree b={branches} t={threshold}:",
                      replay(data, k, branches, threshold))
                print(f"k={k} suffix+recycling tree b={branches} t={threshold} (shared):",
                      replay(data, k, branches, threshold, use_recycling=True, shared=True))
    else:
        a, b = float(sys.argv[3]), float(sys.argv[4])
        for threshold in (0.1, 0.3, 0.5, 0.6, 0.7, 0.8):
            print(f"chain k≤8, stop below path probability {threshold}:",
                  replay(data, 8, 1, threshold, cost=(a, b)))
        print("tree k≤8 b=3 t=0.6:", replay(data, 8, 3, 0.6, cost=(a, b)))
