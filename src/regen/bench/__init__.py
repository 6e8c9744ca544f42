"""The layout sweep's benchmark logic: statistics, SGLang's bench_serving, the report (regen.jobs.sweep)."""
