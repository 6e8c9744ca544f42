"""regen: prompt-completion regeneration and drafter training for large language models."""

__version__ = "0.1.0"


def package_version() -> str:
    """The installed distribution's version (package metadata: what `regen --version` and every job's
    --version print), or the source tree's when regen runs uninstalled (PYTHONPATH=src). importlib.metadata
    is imported here, not with the package: it costs ~50 ms of CPU, which every process importing
    regen paid (the generation job's judge workers start while the job generates)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _distribution_version

    try:
        return _distribution_version("regen")
    except PackageNotFoundError:
        return __version__
