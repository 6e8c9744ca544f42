"""Source files that the demo builder copies verbatim into the demo model directory.

They are the demo checkpoint's "remote code" (configuration, modeling, tokenizer, chat template), loaded by
transformers with ``trust_remote_code=True`` from the model directory, exactly like the code that ships
inside the real Kimi K2.5/K2.6 checkpoint. regen never imports them at run time; they live in a package
only so that wheels carry them and ruff lints them.
"""
