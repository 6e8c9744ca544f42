"""Which SpecForge spec-capture patch fits an installed SGLang, and the record of what was applied.

Standard library only, pure functions; `library/sglang_capture_patch.py` does the I/O.

SpecForge's online (disaggregated) training reads hidden states from an SGLang server that runs with
SpecForge's spec-capture patch. The patch ships only in SpecForge's source repository, one file per SGLang
release it was written against (`patches/sglang/<target>/spec-capture.patch`, e.g. `v0.5.14`), never in its
wheel or sdist, and a patch for one release does not apply to another. So the choice is strict: the target
named in the inventory, else `v<installed sglang version>`, else a refusal that lists what the checkout has.
"""

from __future__ import annotations

import os

PATCH_NAME = "spec-capture.patch"
# Kept inside the installed package: the exact patch text applied, so a revised patch is reversed with the
# text that went in (content-aware idempotence), and a reinstall of sglang forgets it with the files.
RECORD_NAME = ".regen-spec-capture.patch"


class CapturePatchError(Exception):
    """Nothing can be applied; the message says why and what to change."""


def available_targets(specforge_source):
    """Patch targets of a SpecForge checkout: the directories of patches/sglang/ that hold the patch."""
    root = os.path.join(specforge_source, "patches", "sglang")
    if not os.path.isdir(root):
        return []
    return sorted(
        name for name in os.listdir(root) if os.path.isfile(os.path.join(root, name, PATCH_NAME))
    )


def choose_target(targets, sglang_version, requested=None, source="the SpecForge checkout"):
    """The patch target for this SGLang; CapturePatchError with the remedy when there is none."""
    if not targets:
        raise CapturePatchError(
            f"{source} has no patches/sglang/*/{PATCH_NAME}: it is not a SpecForge source checkout (the "
            "SpecForge wheel and sdist ship no patch); check out the SpecForge repository at the pinned "
            "commit (capture_patch_specforge_commit) or point capture_patch_specforge_source at a checkout"
        )
    if requested:
        if requested not in targets:
            raise CapturePatchError(
                f"capture_patch_target={requested!r} is not in {source}; it has patches for "
                f"{', '.join(targets)}"
            )
        return requested
    wanted = f"v{sglang_version}"
    if wanted in targets:
        return wanted
    raise CapturePatchError(
        f"no spec-capture patch for sglang {sglang_version} in {source}, which has patches for "
        f"{', '.join(targets)}: pin the capture venv's sglang to a release with a patch (e.g. "
        f"sglang=={targets[0].lstrip('v')} for {targets[0]}), or name a target that fits it in "
        "capture_patch_target"
    )


def plan_action(patch_text, recorded_text, forward_applies, reverse_applies):
    """What to do, from the record and two dry runs: (action, reason).

    action: `keep` (this patch is applied and recorded), `replace` (another patch is recorded: reverse it,
    apply this one), `apply`, `adopt` (applied before, without a record: record it), or `refuse`.
    """
    if recorded_text is not None:
        if recorded_text == patch_text:
            return "keep", "the patch is applied (its record matches)"
        return "replace", "a different spec-capture patch is applied: it is reversed and this one applied"
    if forward_applies:
        return "apply", "the installed sglang is unpatched and the patch applies cleanly"
    if reverse_applies:
        return "adopt", "the installed sglang already carries this exact patch (applied without a record)"
    return "refuse", (
        "the installed sglang neither accepts the patch nor carries it: its files differ from the release "
        "the patch was written for; reinstall that sglang release in the capture venv and run again"
    )
