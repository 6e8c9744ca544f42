"""The CPU reference decoder on the real demo model and SpecForge's real DFlashDraftModel.

Speculative decoding with greedy verification must reproduce plain greedy decoding token for token,
whatever the drafter proposes; the oracle (the target's own continuation) must reach the block size, an
untrained drafter about 1, and a drafter wrong at slot k exactly k - 1 accepted drafts per step. Plain
greedy decoding itself is checked against transformers' `generate`. Everything runs in one subprocess of
the evaluate venv (SpecForge 0.2.0 on the project's torch/transformers, as the pipeline's training venv).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.evaluate_venv import DRAFTER_SNIPPET, run_python

DRIVER = (
    DRAFTER_SNIPPET
    + r"""
import sys, torch
from regen.evaluate import reference as ref

model_dir, work = sys.argv[1], sys.argv[2]
make_drafter(model_dir, f"{work}/untrained-export")
target = ref.Target.load(model_dir)
drafter = ref.load_drafter(f"{work}/untrained-export")
ref.check_compatible(drafter, target)
bs, mask, layers = drafter.block_size, drafter.mask_token_id, list(drafter.target_layer_ids)
prompts = [[3840, 17, 400, 1029, 77], [3843, 2000, 5, 9, 9, 9, 12, 800], [100] * 3, list(range(200, 240))]
MAX_NEW = 20

class WrongAtSlot:
    # Fault injection: the target's own continuation with draft slot `k` (1-based) replaced by another token.
    def __init__(self, continuation, k):
        self.inner, self.k = ref.OracleProposer(continuation, bs), k
    def reset(self):
        pass
    def propose(self, block, context, start):
        tokens = self.inner.propose(block, context, start).clone()
        tokens[self.k - 1] = (tokens[self.k - 1] + 1) % target.embed.num_embeddings
        return tokens

out = {"greedy_vs_generate": [], "lossless": [], "untrained": [], "oracle": [], "wrong_at_3": []}
for prompt in prompts:
    plain = ref.greedy_decode(target, prompt, MAX_NEW)
    with torch.inference_mode():
        gen = target.model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)
    out["greedy_vs_generate"].append(gen[0, len(prompt):].tolist() == plain.tokens)
    cont = prompt + ref.greedy_decode(target, prompt, MAX_NEW + bs).tokens
    for name, proposer in (("untrained", ref.DFlashProposer(drafter, target)),
                           ("oracle", ref.OracleProposer(cont, bs)),
                           ("wrong_at_3", WrongAtSlot(cont, 3))):
        spec = ref.speculative_decode(target, proposer, prompt, block_size=bs, mask_token_id=mask,
                                      layer_ids=layers, max_new=MAX_NEW, tree_budgets=(1, 4, 64),
                                      continuation=cont)
        out["lossless"].append([name, spec.tokens == plain.tokens, len(spec.tokens)])
        out[name].append(spec.accepted)
        tree = {str(k): v for k, v in spec.tree_accepted.items()}
        out.setdefault("tree", []).append([name, spec.accepted, tree])

# A stop token ends both decodes at the same place.
stop = ref.greedy_decode(target, prompts[0], MAX_NEW).tokens[5]
plain = ref.greedy_decode(target, prompts[0], MAX_NEW, [stop])
oracle = ref.OracleProposer(prompts[0] + ref.greedy_decode(target, prompts[0], MAX_NEW + bs).tokens, bs)
spec = ref.speculative_decode(target, oracle, prompts[0], block_size=bs, mask_token_id=mask,
                              layer_ids=layers, max_new=MAX_NEW, stop_ids=[stop])
out["stop"] = [plain.tokens, spec.tokens]
# One decode gives both the plain (stopped) output and the longer continuation the oracle proposes from.
both = ref.greedy_decode(target, prompts[0], MAX_NEW, [stop], continue_to=MAX_NEW + bs)
longer = ref.greedy_decode(target, prompts[0], MAX_NEW + bs).tokens
out["continue_to"] = [both.tokens == plain.tokens, both.continuation == longer, len(both.continuation)]

# Weights that do not fit the config are refused, not silently re-initialised.
import shutil
from safetensors.torch import load_file, save_file
shutil.copytree(f"{work}/untrained-export", f"{work}/broken")
state = load_file(f"{work}/broken/model.safetensors")
state.pop(next(iter(state)))
save_file(state, f"{work}/broken/model.safetensors")
try:
    ref.load_drafter(f"{work}/broken")
    out["broken"] = None
except ref.EvaluationError as exc:
    out["broken"] = str(exc)
out["block_size"] = bs
print(json.dumps(out))
"""
)


@pytest.fixture(scope="module")
def decoded(demo_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    work = tmp_path_factory.mktemp("evaluate-reference")
    run = run_python(DRIVER, str(demo_model_dir), str(work))
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_plain_greedy_equals_transformers_generate(decoded: dict) -> None:
    assert decoded["greedy_vs_generate"] == [True] * 4


def test_speculative_output_equals_greedy_for_every_proposer_and_prompt(decoded: dict) -> None:
    assert len(decoded["lossless"]) == 12
    assert all(same and n == 20 for _, same, n in decoded["lossless"]), decoded["lossless"]


def test_one_decode_gives_the_stopped_output_and_the_longer_continuation(decoded: dict) -> None:
    same_plain, same_continuation, length = decoded["continue_to"]
    assert same_plain and same_continuation and length == 20 + decoded["block_size"]


def test_oracle_reaches_the_block_size(decoded: dict) -> None:
    bs = decoded["block_size"]
    for steps in decoded["oracle"]:
        assert steps and all(a == bs - 1 for a in steps)


def test_untrained_drafter_accepts_about_nothing(decoded: dict) -> None:
    steps = [a for prompt in decoded["untrained"] for a in prompt]
    assert len(steps) >= 4 * 10  # about one token per target forward: 20 tokens need many steps
    assert (sum(steps) + len(steps)) / len(steps) < 1.2


def test_a_wrong_draft_ends_acceptance_at_its_slot(decoded: dict) -> None:
    # Slot 3 wrong: slots 1 and 2 accepted, then the target's own token; never more, never less.
    for steps in decoded["wrong_at_3"]:
        assert steps and all(a == 2 for a in steps)


def test_a_stop_token_ends_speculative_and_plain_decoding_alike(decoded: dict) -> None:
    plain, spec = decoded["stop"]
    assert spec == plain and len(plain) <= 6


def test_weights_that_do_not_fit_the_config_are_refused(decoded: dict) -> None:
    assert decoded["broken"] and "do not fit its config.json" in decoded["broken"]


def test_tree_scores_agree_with_the_chain_verification(decoded: dict) -> None:
    # Only the DFlash drafter has per-slot distributions; a one-node tree is its first argmax draft,
    # which the chain's verification accepted exactly when the chain accepted at least one token.
    rows = [row for row in decoded["tree"] if row[0] == "untrained"]
    assert rows and all(not tree for name, _, tree in decoded["tree"] if name != "untrained")
    for _, chain, tree in rows:
        assert tree["1"] == [min(a, 1) for a in chain]
        assert all(d <= 4 for d in tree["4"]) and len(tree["64"]) == len(chain)
        assert all(a <= b for a, b in zip(tree["4"], tree["64"], strict=True))
