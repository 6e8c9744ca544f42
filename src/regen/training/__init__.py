"""Host-side helpers of the drafter_training role: launch and watch SpecForge, list its checkpoints,
capture hidden states offline.

`launcher`, `status` and `checkpoints` use only the standard library, so any Python on the training host
can run them; `capture` runs inside the training venv (torch, transformers, and SpecForge or SGLang).
"""
