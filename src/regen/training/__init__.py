"""Host-side helpers of the drafter_training role: launch and watch SpecForge, list its checkpoints,
capture hidden states offline.

`launcher`, `status` and `checkpoints` run in the job venv regen is installed in (the launcher's process
mode is `regen.procs`, shared with the model server); `capture` runs inside the training venv (torch,
transformers, and SpecForge or SGLang).
"""
