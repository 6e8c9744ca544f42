"""Output quality of a served model: degeneration detector, probe set with known answers, and the gate.

`detector` judges a completion's text (and keeps a rolling share for the generation job), `probes`
loads the probe set and checks answers, `gate` runs the probes against an OpenAI-compatible endpoint;
`python -m regen.jobs.quality_gate` is the CLI the serving role runs after readiness.
"""
