"""The two servers of the GPU evaluation: the target alone and with the trained drafter, in one layout.

Standard library only, pure: the `evaluation_servers_info` module runs it on the controller, the unit tests
call it directly, and tests/unit/test_serving_argv.py parses what it adds with SGLang 0.5.23's own parser
and DFLASH validator (`speculative_hook._handle_dflash`).

Both servers come from the serving role with the plan's layout (TP/EP/DP attention, attention backend,
memory share, context length), so the only difference between them is the drafter. SGLang 0.5.23's DFLASH
sets its own conditions, and the flags follow them, each stated in `constraints`:

* CUDA only (`_handle_dflash`: cuda, npu or xpu): a plan for the CPU is refused.
* No pipeline parallelism (`pp_size == 1`): a plan with pp > 1 is refused with what to change; the
  plain server keeps the same layout, so neither gets one.
* DP attention only with `--enable-dp-lm-head` (the drafter's greedy projection borrows the target's LM
  head), no context parallelism beside it, and `SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION` off: the flag
  goes to both servers (same layout), the variable is refused when the environment turns it on.
* One draft step and top-k 1: SGLang sets them itself; `--speculative-num-draft-tokens` is the drafter's
  block size (`block_size` in its config), as the train stage writes it.
* `--max-running-requests`: unset, DFLASH resets it to 48; both servers get the same explicit value (at
  least the batch setting's concurrency), so the batch level runs alike on both.
* The overlap scheduler: DFLASH runs under it in 0.5.23 (`DFlashWorkerV2` drives the overlap and the
  non-overlap loop), so it stays on for both; a `--disable-overlap-schedule` in the inventory applies to
  both alike.
"""

from __future__ import annotations

from .regen_drafter import DrafterPlanError, sglang_dflash_args

# Flags the inventory may not add to the evaluation servers: they would make the plain server speculative
# or give the speculative one another drafter than the one evaluated.
_SPECULATIVE_PREFIX = "--speculative-"
_TRUTHY = ("1", "true", "yes", "on")


class EvaluationPlanError(Exception):
    """Input that cannot give the two servers: the message says what is wrong and how to fix it."""


def _int(value, default=1):
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return default


def _flag_value(args, flag):
    """The value a flag has in an argv fragment (``--flag V`` or ``--flag=V``), None when absent."""
    for i, arg in enumerate(args):
        if arg == flag:
            return args[i + 1] if i + 1 < len(args) else ""
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def evaluation_servers(
    serving, checkpoint, block_size, batch_concurrency, extra_args=None, environment=None, train_args=None
):
    """The extra flags of the plain and the speculative server, with the DFLASH constraints they follow.

    serving: the plan's serving values (`regen_plan_values.serving`); checkpoint: the drafter directory
    on the host; block_size: its config's `block_size`; batch_concurrency: the batch setting's requests in
    flight; extra_args / environment: what the servers get anyway (the inventory's and the plan's sweep
    settings); train_args: the train stage's `sglang_dflash.args` next to the export, when there is one.

    Returns {"plain": {"extra_args", "identity"}, "dflash": {"extra_args", "identity"}, "drafter_args",
    "drafter_args_source", "constraints": [str]}: each server's extra args come on top of `extra_args`; its
    identity (layout, environment, flags) keys its records, so a new drafter redoes only the dflash server.
    """
    serving = dict(serving or {})
    extra_args = [str(a) for a in (extra_args or [])]
    environment = {str(k): str(v) for k, v in (environment or {}).items()}
    block = _int(block_size, 0)
    if block < 2:
        raise EvaluationPlanError(
            f"the drafter's block_size is {block_size!r}: a DFlash drafter config has a block_size of 2 or "
            "more (is the checkpoint a `specforge export --to hf` directory?)"
        )
    concurrency = _int(batch_concurrency, 0)
    if concurrency < 1:
        raise EvaluationPlanError(
            f"drafter_evaluation_batch_concurrency is {batch_concurrency!r}: give the requests in flight of "
            "the batch setting (1 or more)"
        )
    device = str(serving.get("device") or "cuda")
    if device != "cuda":
        raise EvaluationPlanError(
            f"the serving plan runs on {device!r}, but SGLang 0.5.23 serves DFLASH only on CUDA (or NPU/XPU) "
            "devices: evaluate on a GPU host, or use drafter_evaluation_backend: reference on this one"
        )
    speculative = [a for a in extra_args if a.startswith(_SPECULATIVE_PREFIX)]
    if speculative:
        raise EvaluationPlanError(
            f"sglang_server_extra_args already holds {', '.join(speculative)}: the plain baseline would then "
            "decode speculatively too. Remove the speculative flags from the inventory; the evaluation adds "
            "the drafter's flags to its second server itself"
        )
    try:
        drafter = sglang_dflash_args(checkpoint, block, serving)
    except DrafterPlanError as exc:
        raise EvaluationPlanError(str(exc)) from None
    pp = _int(serving.get("pp_size"))
    attn_dp = _int(serving.get("attn_dp_size"))
    constraints = [
        "SGLang 0.5.23 serves DFLASH on CUDA only: both servers run on the GPUs of this host",
        f"pp_size {pp}: DFLASH needs pp_size == 1, and the plain server keeps the same layout",
        f"--speculative-num-draft-tokens {block}: the drafter's block size; SGLang sets one draft step and "
        "top-k 1 itself",
    ]
    common = []
    if attn_dp > 1:
        cp = _flag_value(extra_args, "--attn-cp-size")
        if cp is not None and _int(cp) != 1:
            raise EvaluationPlanError(
                f"DFLASH with DP attention (attn_dp_size {attn_dp}) does not support context parallelism, "
                f"but sglang_server_extra_args sets --attn-cp-size {cp}: remove it for the evaluation"
            )
        coordination = environment.get("SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION", "")
        if coordination.strip().lower() in _TRUTHY:
            raise EvaluationPlanError(
                "DFLASH with DP attention requires SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION=0, but "
                "sglang_server_environment turns it on: remove it for the evaluation"
            )
        if "--enable-dp-lm-head" not in extra_args:
            common.append("--enable-dp-lm-head")
        constraints.append(
            f"attn_dp_size {attn_dp}: DFLASH with DP attention needs --enable-dp-lm-head (the drafter's "
            "greedy projection borrows the target's LM head), given to both servers so the layout stays the "
            "same; no context parallelism; SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION off"
        )
    else:
        constraints.append("DP attention off: no --enable-dp-lm-head needed")
    running = _flag_value(extra_args, "--max-running-requests")
    if running is None:
        common += ["--max-running-requests", str(concurrency)]
        constraints.append(
            f"--max-running-requests {concurrency} on both servers: DFLASH resets an unset value to 48, the "
            "plain server would size its own; the batch setting runs alike on both"
        )
    elif _int(running, 0) < concurrency:
        raise EvaluationPlanError(
            f"sglang_server_extra_args caps --max-running-requests at {running}, below the batch setting's "
            f"{concurrency} requests in flight: lower drafter_evaluation_batch_concurrency or raise the cap"
        )
    else:
        constraints.append(f"--max-running-requests {running} from the inventory, on both servers")
    if "--disable-overlap-schedule" in extra_args:
        constraints.append(
            "overlap scheduler off for both servers (the inventory's --disable-overlap-schedule)"
        )
    else:
        constraints.append(
            "overlap scheduler on for both servers: SGLang 0.5.23's DFLASH runs under it (DFlashWorkerV2)"
        )
    source = "derived from the plan (no train-stage flags next to this drafter)"
    if train_args:
        train = [str(a) for a in train_args]
        if train == drafter:
            source = "the train stage's sglang_dflash.args"
        else:
            source = (
                "derived from the plan: the train stage wrote " + " ".join(train) + ", which no longer "
                "matches this drafter or the serving plan"
            )
    layout = {
        "serving": {k: serving.get(k) for k in sorted(serving) if k not in ("sweep", "simulator_estimate")},
        "extra_args": extra_args,
        "environment": environment,
    }
    plain = list(common)
    speculative_server = list(common) + drafter
    return {
        "plain": {"extra_args": plain, "identity": dict(layout, args=plain)},
        "dflash": {"extra_args": speculative_server, "identity": dict(layout, args=speculative_server)},
        "drafter_args": drafter,
        "drafter_args_source": source,
        "constraints": constraints,
    }
