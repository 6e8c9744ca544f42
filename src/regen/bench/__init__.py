"""Benchmark logic of the layout sweep: statistics, SGLang's bench_serving, the report (see regen.jobs.sweep)."""
