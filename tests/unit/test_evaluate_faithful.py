"""The reference decoder drafts exactly as SpecForge's own `DFlashDraftModel.spec_generate` does.

Both decoders run the same untrained drafter on the same demo target and prompt; a forward pre-hook on
the target's language model records the tokens of every target forward (the prefill, then each block:
the committed token followed by the drafter's proposals). Proposals of a fixed drafter are a function of
what it was shown (context features, positions, cache, mask token, target layers), so equal sequences
mean the reference feeds the drafter what SpecForge feeds it.

SpecForge 0.2.0 calls `cache.crop(absolute length)`, which the transformers of the pipeline's training
venv refuses (it takes a negative count of positions to remove); the test swaps in a DynamicCache
subclass that maps the old call onto the new one (a compatibility shim, named as such, test-only), and
hands `spec_generate` the inner DeepSeek-V3 model, where it expects `target.model.embed_tokens`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.evaluate_venv import DRAFTER_SNIPPET, run_python

DRIVER = (
    DRAFTER_SNIPPET
    + r"""
import sys, torch
import specforge.modeling.draft.dflash as sf
from transformers import DynamicCache
from regen.evaluate import reference as ref

class AbsoluteCropShim(DynamicCache):
    # SpecForge 0.2.0's crop(absolute length) on a transformers that wants crop(-positions to remove).
    def crop(self, length):
        if length >= 0:
            length = length - self.get_seq_length()
        if length < 0:
            super().crop(length)

sf.DynamicCache = AbsoluteCropShim

model_dir, work = sys.argv[1], sys.argv[2]
make_drafter(model_dir, f"{work}/drafter", seed=3)
target = ref.Target.load(model_dir)
drafter = ref.load_drafter(f"{work}/drafter")
inner = target.model.language_model
calls = []
def record(module, args, kwargs):
    ids = kwargs["input_ids"] if kwargs.get("input_ids") is not None else args[0]
    calls.append(ids[0].tolist())
inner.register_forward_pre_hook(record, with_kwargs=True)
prompt = [3840, 17, 400, 1029, 77, 5, 6]
MAX_NEW = 24
out = {}
for name in ("specforge", "reference"):
    calls.clear()
    if name == "specforge":
        ids = drafter.spec_generate(inner, torch.tensor([prompt]), max_new_tokens=MAX_NEW,
                                    stop_token_ids=None, temperature=0.0)
        tokens = ids[0, len(prompt):].tolist()
    else:
        spec = ref.speculative_decode(target, ref.DFlashProposer(drafter, target), prompt,
                                      block_size=drafter.block_size, mask_token_id=drafter.mask_token_id,
                                      layer_ids=list(drafter.target_layer_ids), max_new=MAX_NEW)
        tokens = spec.tokens
    out[name] = {"calls": list(calls), "tokens": tokens}
out["greedy"] = ref.greedy_decode(target, prompt, MAX_NEW).tokens
out["mask"] = drafter.mask_token_id
print(json.dumps(out))
"""
)


def test_reference_drafts_and_verifies_like_specforge_spec_generate(
    demo_model_dir: Path, tmp_path: Path
) -> None:
    run = run_python(DRIVER, str(demo_model_dir), str(tmp_path))
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    sf, mine = out["specforge"], out["reference"]
    # SpecForge runs one block past max_new_tokens at most; compare the blocks both ran.
    n = min(len(sf["calls"]), len(mine["calls"]))
    assert n >= 10
    assert mine["calls"][:n] == sf["calls"][:n]
    # The blocks carry real proposals (not the mask token), so the comparison covers the drafter's output.
    assert any(tok != out["mask"] for block in mine["calls"][1:] for tok in block[1:])
    assert mine["tokens"] == out["greedy"] == sf["tokens"][: len(out["greedy"])]
