"""`+ngram`: n-gram lookup's continuation verified as one more branch of a model drafter's chain
or tree (draft LMs, sequential or parallel; EAGLE-3 chains and dynamic trees; Medusa heads' static
tree). Greedy output equals generate() in float64 on every engine; the lookup shares the model's
nodes where they agree; a step keeps whichever branch the target agrees with further, so tau is at
least each part's on copy-heavy text; and the model drafts exactly what it would alone, whichever
branch the last step took (its state is made of the accepted path only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from engines import ENGINES, on_engine, ready
from tiny import greedy_reference, noisy_copy, tiny_gemma3, tiny_lm

from drafttrain.decoding import DecodeSettings
from drafttrain.decoding.hybrid import hang_lookup
from drafttrain.kinds.base import Drafter
from drafttrain.kinds.factory import build_decoder, max_step_tokens, tree_name
from drafttrain.trees import tree_from_parents

KINDS_TESTS = Path(__file__).resolve().parents[1] / "kinds"
sys.path[:0] = [str(KINDS_TESTS / "eagle3"), str(KINDS_TESTS / "medusa")]  # the EAGLE-3 and Medusa tests' drafters
from eagle3_helpers import tiny_draft, tiny_target, trained_pair  # noqa: E402
from test_medusa_decoding import PlantedHeads, noisy_heads, planted_ranks  # noqa: E402

MASK = 9
# the second and third repeat themselves, as code re-emitting its prompt does
PROMPTS = [[5, 9, 13, 7, 5, 9], [3, 4, 5, 6, 7, 8, 3, 4, 5, 6, 7, 8, 3, 4], [40, 41, 42, 40, 41, 42, 40]]
TREE_MODELS = ["eagle3-dynamic", "eagle3-chain", "medusa"]


@pytest.fixture(scope="module")
def models():
    """name -> (target, Drafter, settings beyond K and +ngram) of each model drafter a hybrid takes
    here: EAGLE-3 (a trained draft) as a dynamic tree and as a chain, Medusa heads on their
    default tree, and a draft LM."""
    eagle3_target, draft = trained_pair()
    target = tiny_lm(0)
    dynamic = dict(tree="dynamic", tree_nodes=12, tree_topk=3)
    return {"eagle3-dynamic": (eagle3_target, Drafter("eagle3", draft), dynamic),
            "eagle3-chain": (eagle3_target, Drafter("eagle3", draft), dict(tree="chain")),
            "medusa": (target, Drafter("medusa", noisy_heads(target, 3)), dict(tree="default")),
            "draft": (target, Drafter("draft", noisy_copy(target, scale=0.6)), {})}


def paths(tokens, parents) -> list[tuple[int, ...]]:
    """Every node's root-to-node tokens (the root's own token left out)."""
    out = [()]
    for node in range(1, len(parents)):
        out.append(out[parents[node]] + (tokens[node],))
    return out


def merge_chain(tokens: list[int], parents: list[int], lookup: list[int]) -> tuple[list[int], list[int]]:
    """The reference merge, on the host: walk the lookup down the tree while a child holds its next
    token (twin siblings: the first), hang its rest below the last node shared."""
    children: dict[tuple[int, int], int] = {}
    for node in range(1, len(parents)):
        children.setdefault((parents[node], tokens[node]), node)
    node, shared = 0, 0
    while shared < len(lookup) and (node, lookup[shared]) in children:
        node = children[node, lookup[shared]]
        shared += 1
    tokens, parents = list(tokens), list(parents)
    for token in lookup[shared:]:
        tokens.append(token)
        parents.append(node)
        node = len(tokens) - 1
    return tokens, parents


def device_merge(tokens, parents, lookup):
    """`hang_lookup` on a tree built from host parents: (tokens, parents, added) read back."""
    merged, tree, added = hang_lookup(torch.tensor(tokens), tree_from_parents(list(parents)), lookup)
    return merged.tolist(), tree.parent.tolist(), int(added)


@pytest.mark.parametrize("tree, lookup, new_parents", [
    # root; 7 -> 8 -> 9 and 7 -> 1; 3
    ((-1, 0, 1, 2, 1, 0), [7, 8, 5, 6], [2, 6]),  # shares 7, 8; its rest hangs under 8
    ((-1, 0, 1, 2, 1, 0), [7, 1, 2], [4]),        # shares 7, 1 (a second child)
    ((-1, 0, 1, 2, 1, 0), [3], []),               # all shared: nothing added
    ((-1, 0, 1, 2, 1, 0), [4, 4], [0, 6]),        # nothing shared: a new branch at the root
    ((-1, 0, 1, 2, 1, 0), [], []),
    ((-1, 0, 1, 2), [7, 8, 9], []),               # a chain into an equal chain
    ((-1,), [4], [0]),                            # a model that drafted nothing
])
def test_the_lookup_shares_the_nodes_it_agrees_with(tree, lookup, new_parents):
    """The device merge appends one node per lookup token: the shared ones as twins of the model's
    (same parent and token, never kept: the verdict prefers the elder), the rest exactly where the
    host reference hangs them."""
    tokens = [0, 7, 8, 9, 1, 3][:len(tree)]
    merged, parents, added = device_merge(tokens, tree, lookup)
    reference, reference_parents = merge_chain(tokens, list(tree), lookup)
    assert reference_parents[len(tree):] == new_parents
    assert merged[:len(tokens)] == tokens and parents[:len(tree)] == list(tree)  # the model's nodes keep their index
    assert len(merged) == len(tree) + len(lookup) and added == len(new_parents)
    shared = len(lookup) - added
    moved = [p + shared if p >= len(tree) else p for p in new_parents]  # after the twins
    assert parents[len(tree) + shared:] == moved and merged[len(tree):] == lookup
    assert all(p < n for n, p in enumerate(parents) if n)                     # parents precede children
    tree_from_parents(parents)                                               # a valid tree
    got, want = paths(merged, parents), set(paths(tokens, list(tree))) | {tuple(lookup[:d]) for d in
                                                                           range(len(lookup) + 1)}
    assert set(got) == want and len(got) == len(want) + shared  # both trees' paths; the twins repeat `shared`
    for twin in range(len(tree), len(tree) + shared):               # a twin is childless
        assert twin not in parents


def test_the_walk_follows_the_first_twin():
    merged, parents, added = device_merge([0, 7, 7, 8], [-1, 0, 0, 2], [7, 5])
    assert added == 1 and parents[-1] == 1 and merge_chain([0, 7, 7, 8], [-1, 0, 0, 2], [7, 5])[1][-1] == 1


def lm_drafter(kind, model, engine):
    info = {"pard_token": MASK, "parallel_tokens": 4} if kind == "parallel_draft" else {}
    return Drafter(kind, on_engine(model, engine), info)


def check_greedy(target, decoder, k, max_new=25):
    """Output equals generate(), at the length limit and at an EOS; no step accepts more than K."""
    for prompt in PROMPTS:
        gen = decoder.generate(prompt, max_new)
        assert gen.tokens == greedy_reference(target, prompt, max_new)
        assert all(a <= k for a in gen.accepted_lengths)
        assert sum(gen.step_tokens) == len(gen.tokens)
    eos = greedy_reference(target, PROMPTS[0], 30)[7]
    decoder.eos = {eos}
    assert decoder.generate(PROMPTS[0], 30).tokens == greedy_reference(target, PROMPTS[0], 30, eos=eos)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("kind", ["draft", "parallel_draft"])
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("lookup_first", [False, True])
def test_greedy_equals_generate(engine, kind, k, lookup_first):
    target = tiny_lm(0)
    draft = noisy_copy(target) if kind == "draft" else tiny_lm(1)
    settings = DecodeSettings(num_draft_tokens=k, hybrid="ngram", lookup_first=lookup_first)
    decoder = ready(build_decoder(on_engine(target, engine), lm_drafter(kind, draft, engine), settings), engine)
    assert decoder.num_tree_nodes == (k + 1 if lookup_first else 2 * k + 1)
    check_greedy(target, decoder, k)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", TREE_MODELS)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("lookup_first", [False, True])
def test_tree_hybrids_equal_generate(models, engine, model, k, lookup_first):
    target, drafter, extra = models[model]
    settings = DecodeSettings(num_draft_tokens=k, hybrid="ngram", lookup_first=lookup_first, **extra)
    decoder = ready(build_decoder(on_engine(target, engine), drafter, settings), engine)
    alone = build_decoder(target, drafter, DecodeSettings(num_draft_tokens=k, **extra))
    assert decoder.num_draft_tokens == alone.num_draft_tokens
    largest = max(alone.num_tree_nodes, k + 1) if lookup_first else alone.num_tree_nodes + alone.num_draft_tokens
    assert decoder.num_tree_nodes == largest <= max_step_tokens(drafter, settings)
    assert decoder.tree_name == tree_name(drafter, settings)
    check_greedy(target, decoder, k)


@pytest.fixture(scope="module")
def gemma3_models():
    """Each kind again on a tiny Gemma-3 target (sliding and global layers, a 4-token window every
    prompt runs past); the LM drafters are models, put on the engine by the test."""
    target, eagle3_target = tiny_gemma3(0), tiny_target(seed=3, arch="gemma3")
    return {"draft": (target, noisy_copy(target, scale=0.6), {}),
            "parallel_draft": (target, tiny_gemma3(1), {}),
            "eagle3-dynamic": (eagle3_target, Drafter("eagle3", tiny_draft(eagle3_target, scale=0.5)),
                               dict(tree="dynamic", tree_nodes=12, tree_topk=3)),
            "medusa": (target, Drafter("medusa", noisy_heads(target, 3)), dict(tree="default"))}


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("model", ["draft", "parallel_draft", "eagle3-dynamic", "medusa"])
@pytest.mark.parametrize("lookup_first", [False, True])
def test_hybrids_equal_generate_on_gemma3(gemma3_models, engine, model, lookup_first):
    target, drafter, extra = gemma3_models[model]
    if model in ("draft", "parallel_draft"):
        drafter = lm_drafter(model, drafter, engine)
    settings = DecodeSettings(num_draft_tokens=3, hybrid="ngram", lookup_first=lookup_first, **extra)
    check_greedy(target, ready(build_decoder(on_engine(target, engine), drafter, settings), engine), 3)


def tau(decoders) -> float:
    """New tokens per step over PROMPTS; `decoders(prompt)` decodes that prompt."""
    gens = [decoders(p).generate(p, 40) for p in PROMPTS]
    return sum(len(g.tokens) for g in gens) / sum(len(g.accepted_lengths) for g in gens)


def check_taus(taus):
    """Greedy: the hybrid's tree holds each part's candidates, so per step it accepts the longer of
    the two; over a generation its tau is at least either part's alone (on self-repeating text)."""
    assert taus["hybrid"] >= max(taus["model"], taus["ngram"]) - 1e-9, taus
    assert taus["hybrid"] > min(taus["model"], taus["ngram"]), taus


@pytest.mark.parametrize("model", ["draft", "eagle3-dynamic", "eagle3-chain"])
def test_the_hybrid_accepts_at_least_what_each_part_does(models, model):
    target, drafter, extra = models[model]
    taus = {}
    for name, what, hybrid in (("model", drafter, False), ("ngram", Drafter("ngram"), False),
                               ("hybrid", drafter, True)):
        decoder = build_decoder(target, what, DecodeSettings(num_draft_tokens=3, hybrid="ngram" if hybrid else None, **extra))
        taus[name] = tau(lambda p: decoder)
    check_taus(taus)


def test_a_medusa_hybrid_accepts_at_least_what_each_part_does():
    """Heads that know the target's text (right at rank 0 most of the time), so that both branches
    win steps."""
    target = tiny_lm(0)

    def heads(prompt):
        text = prompt + greedy_reference(target, prompt, 48)
        return PlantedHeads(target, 3, text, planted_ranks(len(text), 3, seed=len(prompt), perfect=False))

    taus = {}
    for name, hybrid in (("model", False), ("hybrid", True)):
        taus[name] = tau(lambda p: build_decoder(target, Drafter("medusa", heads(p)),
                                                 DecodeSettings(num_draft_tokens=3, hybrid="ngram" if hybrid else None)))
    taus["ngram"] = tau(lambda p: build_decoder(target, Drafter("ngram"), DecodeSettings(num_draft_tokens=3)))
    check_taus(taus)


def spy(hybrid) -> list[dict]:
    """Record each step of `hybrid` (a HybridDrafter): the text so far, the depth asked for, the
    model's tokens and parents, the merged tree's node count, and the accepted path."""
    steps = []
    model_draft, hybrid_draft, commit = hybrid.model.draft, hybrid.draft, hybrid.model.commit

    def drafting_model(root, depth):
        tokens, tree = model_draft(root, depth)
        steps.append({"text": list(hybrid.sequence), "depth": depth, "model": tokens.tolist(),
                      "parents": tree.parent.tolist()})
        return tokens, tree

    def drafting(root, depth):
        tokens, tree = hybrid_draft(root, depth)
        steps[-1]["nodes"] = tokens.numel()
        steps[-1]["distinct"] = len(set(paths(tokens.tolist(), tree.parent.tolist())))
        return tokens, tree

    def committing(nodes, accepted, bonus, hidden=None):
        steps[-1]["path"] = list(nodes)
        return commit(nodes, accepted, bonus, hidden=hidden)

    hybrid.model.draft, hybrid.draft, hybrid.model.commit = drafting_model, drafting, committing
    return steps


def spied_hybrid(models, model, lookup_first=False):
    target, drafter, extra = models[model]
    settings = DecodeSettings(num_draft_tokens=3, hybrid="ngram", lookup_first=lookup_first, **extra)
    decoder = build_decoder(target, drafter, settings)
    return decoder, spy(decoder.drafter)


@pytest.mark.parametrize("model", ["draft", *TREE_MODELS])
def test_lookup_nodes_counts_the_nodes_the_lookup_added(models, model):
    decoder, steps = spied_hybrid(models, model)
    for prompt in PROMPTS:
        decoder.generate(prompt, 30)
    added = [s["distinct"] - len(s["model"]) for s in steps]
    assert decoder.drafter.lookup_nodes == sum(added) > 0
    assert all(0 <= a <= s["depth"] for a, s in zip(added, steps))
    assert max(s["nodes"] for s in steps) <= decoder.num_tree_nodes


@pytest.mark.parametrize("model", ["draft", *TREE_MODELS])
@pytest.mark.parametrize("lookup_first", [False, True])
def test_the_model_drafts_what_it_would_alone_whichever_branch_won(models, model, lookup_first):
    """The model is committed with the path the target accepted, through its own nodes or the
    lookup's (or, lookup first, after steps it did not draft at all): every step it drafts exactly
    what it drafts from the same text after a fresh prefill."""
    decoder, steps = spied_hybrid(models, model, lookup_first)
    for prompt in PROMPTS:
        decoder.generate(prompt, 30)
    lookup_won = [max(s["path"]) >= len(s["model"]) for s in steps]
    model_won = [not lookup and len(s["path"]) > 1 for lookup, s in zip(lookup_won, steps)]
    if lookup_first:  # the model drafts after steps it did not draft, from the state the lookup's path left
        assert any(won and after["depth"] for won, after in zip(lookup_won, steps[1:]))
    else:
        assert any(lookup_won) and any(model_won), "both branches must win steps for this to test anything"
    fresh, first = spied_hybrid(models, model, lookup_first)
    for s in steps:
        if s["depth"]:
            before = len(first)
            fresh.generate(s["text"], s["depth"] + 1)
            assert (first[before]["model"], first[before]["parents"]) == (s["model"], s["parents"]), s["text"]


def test_hybrids_refuse_what_they_cannot_verify(models):
    for model in ("draft", "eagle3-chain", "medusa"):
        target, drafter, extra = models[model]
        with pytest.raises(ValueError, match="greedy"):
            build_decoder(target, drafter, DecodeSettings(hybrid="ngram", temperature=0.5, **extra))
    for kind in ("ngram", "none"):
        with pytest.raises(ValueError, match=f"not {kind} at"):
            build_decoder(tiny_lm(0), Drafter(kind), DecodeSettings(hybrid="ngram"))


def test_a_hybrid_names_its_tree_and_bounds_its_steps(models):
    eagle3, medusa = models["eagle3-dynamic"][1], models["medusa"][1]
    s = DecodeSettings(num_draft_tokens=3, tree="dynamic", tree_nodes=12, tree_topk=3, hybrid="ngram")
    assert tree_name(eagle3, s) == "dynamic (12 nodes, top-3) + n-gram chain (up to 3 nodes)"
    assert max_step_tokens(eagle3, s) == 12 + 3
    assert tree_name(Drafter("draft"), s).startswith("model chain + n-gram chain")
    assert max_step_tokens(Drafter("draft"), s) == 2 * 3 + 1
    chain = DecodeSettings(num_draft_tokens=3, tree="chain", hybrid="ngram")
    assert tree_name(medusa, chain) == "chain + n-gram chain (up to 3 nodes)"
    assert max_step_tokens(medusa, chain) == 3 + 1 + 3


def test_the_lookup_goes_k_deep_where_the_node_budget_keeps_the_model_shallower(models):
    """EAGLE-3's dynamic tree of 2 nodes is 1 deep whatever K; the hybrid's n-gram chain still goes K
    deep, as its name and its plan say. Cut to the model's depth, it verified one n-gram token a step
    and accepted less than n-gram lookup alone (Gemma-3: tau 1.67 against 1.95, planned 1.78x,
    measured 1.25x)."""
    target, drafter, _ = models["eagle3-dynamic"]
    small = dict(tree="dynamic", tree_nodes=2, tree_topk=2)
    alone = build_decoder(target, drafter, DecodeSettings(num_draft_tokens=3, **small))
    hybrid = build_decoder(target, drafter, DecodeSettings(num_draft_tokens=3, hybrid="ngram", **small))
    assert (alone.num_draft_tokens, alone.num_tree_nodes) == (1, 2)
    assert (hybrid.num_draft_tokens, hybrid.num_tree_nodes) == (3, 2 + 3)
    steps = spy(hybrid.drafter)
    taus = {"model": tau(lambda p: build_decoder(target, drafter, DecodeSettings(num_draft_tokens=3, **small))),
            "ngram": tau(lambda p: build_decoder(target, Drafter("ngram"), DecodeSettings(num_draft_tokens=3))),
            "hybrid": tau(lambda p: hybrid)}
    check_taus(taus)
    assert max(len(s["path"]) for s in steps) == 3 + 1  # a lookup path accepted 3 deep
    assert all(len(s["model"]) <= 2 for s in steps)   # the model's own tree kept to its budget
    check_greedy(target, hybrid, 3)


@pytest.mark.parametrize("model", ["draft", *TREE_MODELS])
def test_lookup_first_verifies_the_lookup_alone_where_it_finds_one(models, model):
    """Lookup first: a step where the lookup finds a continuation verifies exactly that chain and the
    model runs no forward for it; a step where it finds none verifies the model's tree as it is.
    Both kinds of step happen, and the model's forwards are fewer than beside the lookup every step."""
    decoder, steps = spied_hybrid(models, model, lookup_first=True)
    hybrid, drafting = decoder.drafter, decoder.drafter.draft
    seen = []

    def checking(root, depth):
        forwards = hybrid.forwards
        tokens, tree = drafting(root, depth)
        seen.append((list(hybrid.last_lookup), tokens.tolist(), hybrid.forwards - forwards))
        return tokens, tree

    hybrid.draft = checking
    for prompt in PROMPTS:
        decoder.generate(prompt, 30)
    for (lookup, tokens, forwards), step in zip(seen, steps):
        if lookup:
            assert step["depth"] == 0 and tokens[1:] == lookup and forwards == 0
        else:
            assert tokens == step["model"] and (len(tokens) > 1 or step["depth"] == 0)  # 0: the budget is spent
    assert any(s[0] for s in seen) and not all(s[0] for s in seen)
    both, _ = spied_hybrid(models, model)
    for prompt in PROMPTS:
        both.generate(prompt, 30)
    assert hybrid.forwards < both.drafter.forwards
