"""The evaluate stage: how much a trained DFlash drafter speeds up its target.

`stats` (standard library only) turns per-step acceptance into the report's figures with 95% intervals;
`reference` (torch, transformers, SpecForge) is the CPU reference of DFlash block drafting and greedy
verification, `tree` scores its drafts as DDTrees; `report` writes report.json / report.md and draws the
plots (matplotlib, when present).
"""
